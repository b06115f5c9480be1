"""Deliver the aux hidden states (K = 3) of the same prompts to files, three ways, side by side in ONE run:

  a_sglang_hs   the launcher (--hs-dump-dir) + output ring + the extraction CLI (in this process,
                `--server`, safetensors files)
  b_sglang_json SGLang 0.5.23's built-in capture-only mode (--enable-return-aux-hidden-states
                --speculative-algorithm EAGLE3, return_hidden_states): JSON parsed and saved with
                torch.save by a straightforward threaded client
  c_plain       plain SGLang serving of the same prompts, no capture (the upper bound)
  a_server_only the sglang-hs server driven like c_plain while a reader thread drains the ring and
                writes nothing, on prompts of the same shape it has not cached: the in-server cost of
                capture, sinks excluded (1 - a_server_only/c)

Same build, same generated tiny checkpoint, same prompts (random token ids, one new token each). The
three servers run at once (idle ones sleep); each (prompt length, concurrency) point runs a, b, c in
turn, `--reps` times, and medians are reported with the ratios a/b and a/c, peak resident memory of
the server processes and of this client during the run, and bytes written. Writes bench_extract.csv
(every run) and bench_extract.png.

    python benchmarks/bench_extract.py --out benchmarks/results [--lengths 64,512,2048] [--concurrency 1,8,32]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time

import requests
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess  # noqa: E402

LAYERS = [2, 4, 5]  # the tiny model's default EAGLE-3 ids (8 layers)


# -- memory --
def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))
    except (OSError, StopIteration):
        return 0


def reset_peak(pids) -> None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak resident set
        except OSError:
            pass


def peak_mb(pids) -> float:
    return sum(_status_kb(p, "VmHWM:") for p in pids) / 1024


def cpu_s(pids) -> float:
    """CPU seconds (user + system) the processes have used so far. The scheduler's intra-op threads
    spin while they wait, so on these two cores this tracks wall time; a view of where the CPU went,
    not a steadier measure (the in-server cost is best read from a py-spy profile:
    docs/benchmarks.md#in-server-cost-profiled)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def client_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- the three ways --
def run_sglang_hs(server, dump, data, out, concurrency) -> dict:
    from sglang_hs.extract.cli import main as extract

    rc = extract(["--data", data, "--output", out, "--format", "safetensors", "--server", server.url,
                  "--hs-dump-dir", dump, "--concurrency", str(concurrency), "--no-progress"])
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert rc == 0 and not m["failed"], m["failed"][:3]
    return {"seconds": m["wall_s"], "samples": m["samples_written"], "tokens": m["tokens"], "bytes": m["bytes"]}


def _post(url, body):
    r = requests.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def run_json(server, prompts, out, concurrency) -> dict:
    os.makedirs(out, exist_ok=True)

    def one(i):
        reply = _post(server.url, {"input_ids": prompts[i], "return_hidden_states": True,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        rows = torch.tensor(reply["meta_info"]["hidden_states"][0], dtype=torch.bfloat16)
        assert rows.shape[0] == len(prompts[i]), rows.shape
        path = os.path.join(out, f"hs_{i}.pt")
        torch.save({"input_ids": torch.tensor(prompts[i]), "aux_hidden_states": rows}, path)
        return os.path.getsize(path)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        nbytes = sum(pool.map(one, range(len(prompts))))
    return {"seconds": time.perf_counter() - t0, "samples": len(prompts), "tokens": sum(map(len, prompts)),
            "bytes": nbytes}


def _warm(server, length) -> None:
    for _ in range(2):
        _post(server.url, {"input_ids": [7] * min(length, 64), "sampling_params": {"max_new_tokens": 1}})


def run_capture_only(server, dump, prompts, concurrency) -> dict:
    """The plain client against the capturing server, with a reader draining (and dropping) records."""
    import threading

    from sglang_hs.reader import HiddenStateReader

    reader, stop = HiddenStateReader(dump, recycle_memory=True), threading.Event()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the extraction CLI does (--torch-threads): no copy threads spinning on the server's cores

    def drain():
        while not stop.is_set():
            if not reader.poll():
                time.sleep(0.001)
            reader._ready.clear()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        return run_plain(server, prompts, concurrency)
    finally:
        stop.set()
        t.join(5)
        torch.set_num_threads(threads)


def run_plain(server, prompts, concurrency) -> dict:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: _post(server.url, {"input_ids": p, "sampling_params": {"max_new_tokens": 1}}),
                      prompts))
    return {"seconds": time.perf_counter() - t0, "samples": len(prompts), "tokens": sum(map(len, prompts)),
            "bytes": 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--lengths", default="64,512,2048")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens-per-run", type=int, default=8192, help="prompts per point = this / length")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-extract-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    files = tempfile.mkdtemp(prefix="bench-extract-files-")
    common = ["--chunked-prefill-size", "4096", "--max-total-tokens", str(max(4096, 4 * max(lengths) * 2))]
    dump = os.path.join(work, "hs")
    servers = {
        "a_sglang_hs": ServerProcess(["--hs-dump-dir", dump, "--hs-layers", ",".join(map(str, LAYERS)), *common]),
        "b_sglang_json": ServerProcess(["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                                        "--return-aux-hidden-state-layer-ids", *map(str, LAYERS),
                                        "--disable-radix-cache", *common]),
        "c_plain": ServerProcess(common),
    }
    rows = []
    try:
        for s in servers.values():
            s.wait_ready()
        rng = random.Random(0)
        for L in lengths:
            n = max(4, args.tokens_per_run // L)
            for conc in concs:
                for rep in range(args.reps):
                    # fresh random prompts per rep, the same for all three: no radix-cache hits anywhere
                    prompts = [[rng.randint(5, 1000) for _ in range(L)] for _ in range(n)]
                    data = os.path.join(work, "data.jsonl")
                    with open(data, "w") as f:
                        f.writelines(json.dumps({"input_ids": p}) + "\n" for p in prompts)
                    for method, server in [*servers.items(), ("a_server_only", servers["a_sglang_hs"])]:
                        out = os.path.join(files, f"{method}-{L}-{conc}-{rep}")
                        pids = server.pids()
                        _warm(server, L)  # an idle server sleeps (--sleep-on-idle): wake it before timing
                        reset_peak(pids + [os.getpid()])
                        cpu0, client0 = cpu_s(pids), client_cpu_s()
                        if method == "a_sglang_hs":
                            r = run_sglang_hs(server, dump, data, out, conc)
                        elif method == "b_sglang_json":
                            r = run_json(server, prompts, out, conc)
                        elif method == "a_server_only":  # same shape, other tokens: this server has cached the first set
                            r = run_capture_only(server, dump, [[t % 900 + 7 for t in p[::-1]] for p in prompts], conc)
                        else:
                            r = run_plain(server, prompts, conc)
                        server_cpu, client_cpu = cpu_s(pids) - cpu0, client_cpu_s() - client0
                        shutil.rmtree(out, ignore_errors=True)
                        row = {"machine": machine(), "method": method, "prompt_len": L, "concurrency": conc,
                               "rep": rep, **r, "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                               "samples_per_s": round(r["samples"] / r["seconds"], 2),
                               "server_peak_rss_mb": round(peak_mb(pids)),
                               "client_peak_rss_mb": round(peak_mb([os.getpid()])),
                               "server_cpu_s": round(server_cpu, 2), "client_cpu_s": round(client_cpu, 2),
                               "server_cpu_us_per_token": round(1e6 * server_cpu / r["tokens"], 1)}
                        rows.append(row)
                        print(f"L={L:5d} conc={conc:3d} rep={rep} {method:14s} {row['tokens_per_s']:>10,.0f} tok/s "
                              f"server {row['server_peak_rss_mb']} MB client {row['client_peak_rss_mb']} MB", flush=True)
                        write_csv(os.path.join(args.out, "bench_extract.csv"), rows)
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
    summary = summarise(rows)
    write_summary(args.out, "bench_extract", summary, f"\nmedians ({machine()}):", lambda s: (
        f"L={s['prompt_len']:5d} conc={s['concurrency']:3d}: sglang-hs {s['a_tok_s']:>8,.0f}  json "
        f"{s['b_tok_s']:>8,.0f}  plain {s['c_tok_s']:>8,.0f} tok/s   a/b {s['a_over_b']:.2f}  a/c {s['a_over_c']:.2f}"
        f" (ceiling c/b {s['c_over_b']:.2f})  in-server capture cost {100 * s['in_server_capture_cost']:+.1f}%"))
    plot(summary, os.path.join(args.out, "bench_extract.png"))
    return 0


def summarise(rows):
    out = []
    keys = sorted({(r["prompt_len"], r["concurrency"]) for r in rows})
    for L, c in keys:
        def median(key, m):
            return statistics.median(r[key] for r in rows if (r["prompt_len"], r["concurrency"], r["method"]) == (L, c, m))

        methods = ("a_sglang_hs", "b_sglang_json", "c_plain", "a_server_only")
        med = {m: median("tokens_per_s", m) for m in methods}
        cpu = {m: median("server_cpu_us_per_token", m) for m in methods}
        out.append({"prompt_len": L, "concurrency": c, "a_tok_s": med["a_sglang_hs"], "b_tok_s": med["b_sglang_json"],
                    "c_tok_s": med["c_plain"], "a_over_b": round(med["a_sglang_hs"] / med["b_sglang_json"], 3),
                    "a_over_c": round(med["a_sglang_hs"] / med["c_plain"], 3),
                    "c_over_b": round(med["c_plain"] / med["b_sglang_json"], 3),  # the ceiling of a/b
                    "server_only_tok_s": med["a_server_only"],
                    "in_server_capture_cost": round(1 - med["a_server_only"] / med["c_plain"], 3),
                    "server_cpu_us_per_token_a_c": f'{cpu["a_sglang_hs"]:.0f}/{cpu["c_plain"]:.0f}',
                    "a_client_cpu_s": median("client_cpu_s", "a_sglang_hs")})
    return out


def plot(summary, path):
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in sorted({s["concurrency"] for s in summary}):
        ss = [s for s in summary if s["concurrency"] == c]
        x = [s["prompt_len"] for s in ss]
        axes[0].plot(x, [s["a_over_b"] for s in ss], marker="o", label=f"a/b (vs SGLang JSON), conc {c}")
        axes[1].plot(x, [s["a_over_c"] for s in ss], marker="o", label=f"a/c (vs plain serving), conc {c}")
    for ax, t in zip(axes, ("sglang-hs / SGLang JSON aux path", "sglang-hs / plain serving (no capture)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("throughput ratio (tokens/s)")
        ax.set_title(t)
        ax.axhline(1.0, color="#999", lw=0.8)
        ax.legend(fontsize=8)
    save_figure(plt, fig, path, f"aux hidden states (K=3) of the same prompts to files, tiny DeepSeek-V3; {machine()}")


if __name__ == "__main__":
    sys.exit(main())
