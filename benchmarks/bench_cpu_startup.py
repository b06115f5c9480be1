"""A CPU-mode server's start-up with SGLang's torch.compile'd helpers run eagerly or compiled.

On the CPU engine a server that SGLang serves in float32 runs with TORCHDYNAMO_DISABLE=1 unless the environment
sets it (docs/cpu-mode.md#torchdynamo_disable): SGLang compiles a few helpers with torch.compile at import (the MoE
grouped top-k among them), and without it every scheduler process traces them with dynamo and builds them
with inductor at its first forward. This measures what that costs where the launcher's CPU mode is used (the
demo, the tests, the benchmarks): `python -m sglang_hs.launch_server --device cpu --hs-dump-dir ...` with the
embedded tiny DeepSeek-V3 (float32, --hs-last), started alone, one server at a time, in an order rotated
each repetition. Ways: `eager` (TORCHDYNAMO_DISABLE unset: the default where SGLang serves float32) and
`compile` (TORCHDYNAMO_DISABLE=0); the server's own line confirms each. Per start: seconds from launch to the
ready line, CPU seconds of the server's processes at that moment (their reaped children, inductor's compiler
among them, included), and two greedy requests of the same prompt (the first after ready; the second, its
prompt cached, once nothing is left to compile), whose tokens must be the same in every start. The summary
gives per way the median over repetitions and the ratio compile/eager per repetition (median, min-max). Inductor's on-disk cache is left as it is (warm after the first compile): the
figures are those of a machine that has started a server before. Writes bench_cpu_startup.csv,
bench_cpu_startup_summary.csv and bench_cpu_startup.png.

    python benchmarks/bench_cpu_startup.py --out benchmarks/results [--reps 5] [--tp 1]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import psutil
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, ratio_spread, save_figure, stop_servers, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess  # noqa: E402

WAYS = {"eager": None, "compile": "0"}  # TORCHDYNAMO_DISABLE given to the launcher (None: unset, its default)
PROMPT = 24
KEYS = ("ready_s", "cpu_s", "first_request_s", "second_request_s")
EAGER_LINE = "TORCHDYNAMO_DISABLE=1 (set by sglang-hs for float32"  # serve.cpu_torch_compile's line


def generate(url: str, rid: str, new: int) -> dict:
    ids = [(i * 104729) % 1000 + 10 for i in range(PROMPT)]
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json={"input_ids": ids, "rid": rid, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True}}, timeout=1800)
    r.raise_for_status()
    out = r.json()
    assert len(out["output_ids"]) == new, f"{rid}: {len(out['output_ids'])} tokens, asked {new}"
    return {"s": time.perf_counter() - t0, "ids": out["output_ids"]}


def cpu_seconds(pids: List[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue  # gone between the listing and the read
        total += t.user + t.system + t.children_user + t.children_system
    return total


def start(way: str, rep: int, args, work: str, logs: str, servers: Dict[str, ServerProcess]) -> dict:
    t0 = time.perf_counter()
    name = f"{way}-{rep}"
    server = servers[name] = ServerProcess(
        ["--device", "cpu", "--dtype", "float32", "--tp", str(args.tp), "--hs-last",
         "--hs-dump-dir", os.path.join(work, name)], log_path=os.path.join(logs, name + ".log"),
        env={"TORCHDYNAMO_DISABLE": WAYS[way]})  # None: left out, the server's default
    server.wait_ready()
    ready = time.perf_counter() - t0
    said = EAGER_LINE if way == "eager" else "TORCHDYNAMO_DISABLE=0 (from the environment)"
    assert said in open(server.log_path, errors="replace").read(), f"{name}: no {said!r} in {server.log_path}"
    cpu = cpu_seconds(server.pids())
    first = generate(server.url, f"startup-{name}-1", args.new)
    second = generate(server.url, f"startup-{name}-2", args.new)
    server.stop()
    del servers[name]
    return {"machine": machine(), "way": way, "rep": rep, "tp": args.tp, "ready_s": round(ready, 2),
            "cpu_s": round(cpu, 2), "first_request_s": round(first["s"], 3),
            "second_request_s": round(second["s"], 3), "output_ids": " ".join(map(str, first["ids"])),
            "second_output_ids": " ".join(map(str, second["ids"])),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def summarise(rows: List[dict]) -> List[dict]:
    by = {w: {r["rep"]: r for r in rows if r["way"] == w} for w in WAYS}
    reps = sorted(set(by["eager"]) & set(by["compile"]))
    if not reps:
        return []
    out = []
    for key in KEYS:
        ratio, low, high = ratio_spread(by["compile"], by["eager"], key, reps)
        out.append({"measure": key, "reps": len(reps),
                    "eager_median": round(statistics.median(by["eager"][r][key] for r in reps), 3),
                    "compile_median": round(statistics.median(by["compile"][r][key] for r in reps), 3),
                    "ratio_compile_over_eager_median": ratio, "ratio_min": low, "ratio_max": high})
    return out


def plot(rows: List[dict], summary: List[dict], path: str, title: str) -> None:
    plt = _pyplot()
    if plt is None or not summary:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in zip(axes, ("ready_s", "cpu_s"), ("launch to ready (s)", "CPU seconds at ready")):
        s = next(x for x in summary if x["measure"] == key)
        for k, (way, color) in enumerate((("eager", "#2a7"), ("compile", "#888"))):
            ax.bar(k, s[f"{way}_median"], width=0.6, color=color, label=f"{way} (median)")
            ax.text(k, s[f"{way}_median"], f"{s[f'{way}_median']:.1f}", ha="center", va="bottom", fontsize=8)
            pts = [r[key] for r in rows if r["way"] == way]
            ax.plot([k] * len(pts), pts, "k.", markersize=4)  # each repetition
        ax.set_xticks([0, 1])
        ax.set_xticklabels(["eager\n(launcher default, float32)", f"compile\n(x{s['ratio_compile_over_eager_median']})"])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    save_figure(plt, fig, path, title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=16, help="greedy tokens generated per request")
    ap.add_argument("--tp", type=int, default=1, help="--tp of the server (one scheduler process per rank)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.new < 1 or args.tp < 1:
        ap.error("--reps, --new and --tp: at least 1")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the servers are stopped on the way out
    work = tempfile.mkdtemp(prefix="bench-startup-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    logs = tempfile.mkdtemp(prefix="bench-startup-logs-")
    servers: Dict[str, ServerProcess] = {}
    rows: List[dict] = []
    ok = False
    try:
        ways = list(WAYS)
        for rep in range(args.reps):
            for k in range(len(ways)):
                way = ways[(k + rep) % len(ways)]
                row = start(way, rep, args, work, logs, servers)
                rows.append(row)
                print(f"rep {rep} {way:8s} ready {row['ready_s']:.1f}s  cpu {row['cpu_s']:.1f}s  first request "
                      f"{row['first_request_s']:.2f}s  second {row['second_request_s']:.2f}s  load {row['loadavg_1m']}",
                      flush=True)
                write_csv(os.path.join(args.out, "bench_cpu_startup.csv"), rows)
        outputs = {(r["output_ids"], r["second_output_ids"]) for r in rows}
        assert len(outputs) == 1, f"the greedy tokens differ between starts: {sorted(outputs)}"
        summary = summarise(rows)
        write_summary(args.out, "bench_cpu_startup", summary, "summary:", str)
        plot(rows, summary, os.path.join(args.out, "bench_cpu_startup.png"),
             f"launcher CPU mode, tiny DeepSeek-V3, --tp {args.tp}, started alone; {machine()}")
        ok = True
    finally:
        stop_servers(servers, work, logs, ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
