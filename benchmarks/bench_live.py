"""Files or no files: the same prompts from one sglang-hs server, four ways, side by side in ONE run:

  a_cli_bf16    the extraction CLI (in this process, `--server`) writing speculators' safetensors files, bf16
  b_cli_fp8     the same with `--save-dtype fp8` (e4m3, one scale per token: about half the bytes)
  c_live        sglang_hs.live.LiveHiddenStates through a DataLoader (no worker), feeding a consumer that
                only touches each tensor (reads its last element): the samples never reach a disk
  d_live_2w     the same with num_workers=2 (worker 0 routes the records; the workers' start is timed)

One server (--hs-last, the default EAGLE-3 layers, radix cache off so every variant computes every prompt),
the embedded tiny DeepSeek-V3, random token-id prompts (one new token each), fresh per repetition and the
same for the four variants; the variants take turns in a rotating order across repetitions, so drift of a
loaded machine spreads over all of them. Each run is timed around the whole call (the CLI's tokenizer load
and dataset finalize, the live dataset's tokenizer load and worker start included). Figures per run:
samples/s, tokens/s and bytes/s, where bytes are those written to disk (a, b) or handed to the consumer
(c, d; the samples' tensors, bf16). The summary gives medians with the min..max spread and each variant's
samples/s over a's. Writes bench_live.csv (every run), bench_live_summary.csv and bench_live.png.

    python benchmarks/bench_live.py --out benchmarks/results [--lengths 128,1024] [--reps 4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess  # noqa: E402

VARIANTS = ("a_cli_bf16", "b_cli_fp8", "c_live", "d_live_2w")
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


def run_cli(server, dump, data, out, concurrency, fp8: bool) -> dict:
    from sglang_hs.extract.cli import main as extract

    args = ["--data", data, "--output", out, "--format", "safetensors", "--server", server.url,
            "--hs-dump-dir", dump, "--concurrency", str(concurrency), "--no-progress"]
    t0 = time.perf_counter()
    rc = extract(args + (["--save-dtype", "fp8"] if fp8 else []))
    seconds = time.perf_counter() - t0
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert rc == 0 and not m["failed"], m["failed"][:3]
    files = {}  # by inode: hidden_states/hs_{row} is a hard link to hs_{i}, counted once
    for d, _, fs in os.walk(out):
        for f in fs:
            st = os.stat(os.path.join(d, f))
            files[(st.st_dev, st.st_ino)] = st.st_size
    nbytes = sum(files.values())
    return {"seconds": seconds, "samples": m["samples_written"], "tokens": m["tokens"], "bytes": nbytes,
            "own_wall_s": m["wall_s"]}


def warm(server) -> None:
    """An idle server sleeps (--sleep-on-idle): wake it before timing."""
    for _ in range(2):
        r = requests.post(f"{server.url}/generate", json={"input_ids": [7] * 32, "sampling_params": {"max_new_tokens": 1}},
                          timeout=600)
        r.raise_for_status()


def run_live(server, dump, data, concurrency, workers: int) -> dict:
    from torch.utils.data import DataLoader

    from sglang_hs.live import LiveHiddenStates

    ds = LiveHiddenStates(data, server.url, dump, concurrency=concurrency)
    samples = tokens = nbytes = 0
    touched = 0.0
    t0 = time.perf_counter()
    for s in DataLoader(ds, batch_size=None, num_workers=workers):
        for k in KEYS:  # touch: read one element of each tensor, nothing more
            touched += float(s[k].reshape(-1)[-1])
            nbytes += s[k].numel() * s[k].element_size()
        samples += 1
        tokens += s["input_ids"].shape[0]
    return {"seconds": time.perf_counter() - t0, "samples": samples, "tokens": tokens, "bytes": nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--lengths", default="128,1024")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens-per-run", type=int, default=16384, help="prompts per run = this / length")
    ap.add_argument("--reps", type=int, default=4, help="4: each variant once in each place of the order")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-live-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    files = tempfile.mkdtemp(prefix="bench-live-files-")  # on disk, as a user's output would be
    dump = os.path.join(work, "hs")
    server = ServerProcess(["--hs-dump-dir", dump, "--hs-last", "--disable-radix-cache", "--chunked-prefill-size",
                            "4096", "--max-total-tokens", str(max(8192, 2 * args.concurrency * max(lengths)))])
    rows = []
    try:
        server.wait_ready()
        for _ in range(4):  # first requests after start-up are slow: not any variant's
            warm(server)
        rng = random.Random(0)
        for L in lengths:
            n = max(4, args.tokens_per_run // L)
            for rep in range(args.reps):
                prompts = [[rng.randint(5, 1000) for _ in range(L)] for _ in range(n)]
                data = os.path.join(work, "data.jsonl")
                with open(data, "w") as f:
                    f.writelines(json.dumps({"input_ids": p}) + "\n" for p in prompts)
                order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
                for method in order:
                    out = os.path.join(files, f"{method}-{L}-{rep}")
                    warm(server)
                    if method.startswith("a_") or method.startswith("b_"):
                        r = run_cli(server, dump, data, out, args.concurrency, fp8=method.startswith("b_"))
                    else:
                        r = run_live(server, dump, data, args.concurrency, workers=2 if method == "d_live_2w" else 0)
                    shutil.rmtree(out, ignore_errors=True)
                    assert r["samples"] == n, (method, r["samples"], n)
                    row = {"machine": machine(), "method": method, "prompt_len": L, "concurrency": args.concurrency,
                           "rep": rep, **r, "samples_per_s": round(r["samples"] / r["seconds"], 2),
                           "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                           "mb_per_s": round(r["bytes"] / r["seconds"] / 1e6, 2)}
                    rows.append(row)
                    print(f"L={L:5d} rep={rep} {method:11s} {row['samples_per_s']:8.2f} samples/s "
                          f"{row['tokens_per_s']:>9,.0f} tok/s {row['mb_per_s']:8.1f} MB/s", flush=True)
                    write_csv(os.path.join(args.out, "bench_live.csv"), rows)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
    summary = summarise(rows)
    write_summary(args.out, "bench_live", summary, f"\nmedians [min..max] over {args.reps} reps ({machine()}):",
                  lambda s: f"L={s['prompt_len']:5d} {s['method']:11s} {s['samples_per_s']:8.2f} samples/s "
                            f"[{s['samples_per_s_min']:.2f}..{s['samples_per_s_max']:.2f}]  {s['mb_per_s']:8.1f} MB/s  "
                            f"{s['bytes_per_sample'] / 1e3:8.1f} KB/sample  x{s['samples_per_s_over_a']:.2f} of a")
    plot(summary, os.path.join(args.out, "bench_live.png"))
    return 0


def summarise(rows):
    out = []
    for L in sorted({r["prompt_len"] for r in rows}):
        def runs(m):
            return [r for r in rows if (r["prompt_len"], r["method"]) == (L, m)]

        base = statistics.median(r["samples_per_s"] for r in runs(VARIANTS[0]))
        for m in VARIANTS:
            rs = runs(m)
            sps = [r["samples_per_s"] for r in rs]
            out.append({"prompt_len": L, "method": m, "reps": len(rs), "samples_per_s": statistics.median(sps),
                        "samples_per_s_min": min(sps), "samples_per_s_max": max(sps),
                        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                        "mb_per_s": statistics.median(r["mb_per_s"] for r in rs),
                        "bytes_per_sample": round(statistics.median(r["bytes"] / r["samples"] for r in rs)),
                        "samples_per_s_over_a": round(statistics.median(sps) / base, 3)})
    return out


def plot(summary, path):
    plt = _pyplot()
    if plt is None:
        return
    lengths = sorted({s["prompt_len"] for s in summary})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        ss = [s for s in summary if s["prompt_len"] == L]
        med = [s["samples_per_s"] for s in ss]
        err = [[m - s["samples_per_s_min"] for m, s in zip(med, ss)], [s["samples_per_s_max"] - m for m, s in zip(med, ss)]]
        ax.bar([s["method"] for s in ss], med, yerr=err, capsize=4, color=["#888", "#a82", "#2a7", "#27a"])
        for i, s in enumerate(ss):
            ax.text(i, s["samples_per_s_max"], f"{s['samples_per_s']:.2f}\n{s['mb_per_s']:.1f} MB/s", ha="center",
                    va="bottom", fontsize=8)
        ax.set_ylim(0, 1.2 * max(s["samples_per_s_max"] for s in ss))
        ax.set_ylabel("samples/s (median, min..max)")
        ax.set_title(f"prompts of {L} tokens")
        ax.tick_params(axis="x", labelsize=8)
    save_figure(plt, fig, path, f"hidden states of the same prompts: files (bf16, fp8) vs live dataset; tiny "
                                f"DeepSeek-V3; {machine()}")


if __name__ == "__main__":
    sys.exit(main())
