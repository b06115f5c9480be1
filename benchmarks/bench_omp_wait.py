"""OMP_WAIT_POLICY=PASSIVE against libgomp's default, for the launcher's CPU mode (issue 32, item 5).

bench_harvest.py found a plain CPU server decoding ~15x slower on an oversubscribed machine without
OMP_WAIT_POLICY=PASSIVE: libgomp's default spins its worker threads (GOMP_SPINCOUNT) after each parallel
region instead of sleeping, and on a machine with more runnable threads than cores the spinning takes the
core the next op needs. This measures it for what the launcher serves in CPU mode (the demo, the tests,
the benchmarks): `python -m sglang_hs.launch_server --device cpu` with the embedded tiny DeepSeek-V3,
served plain and capturing (--hs-dump-dir), each under both policies: four servers started at once and
kept for all repetitions. Each repetition runs the four ways in a rotated order; an idle server sleeps
(--sleep-on-idle), so each is woken by two short requests first. Per way and repetition: one request alone
(PROMPT prompt tokens, NEW greedy tokens, ignore_eos) and CONCURRENT such requests at once; time of each,
and generated tokens/s. The summary gives per configuration the median over repetitions and the ratio
default/PASSIVE per repetition (median, min-max). The default arm is OMP_WAIT_POLICY set empty, which the
launcher reads as "keep libgomp's default" and removes before SGLang starts. Writes bench_omp_wait.csv,
bench_omp_wait_summary.csv and bench_omp_wait.png.

    python benchmarks/bench_omp_wait.py --out benchmarks/results [--reps 3] [--new 32] [--concurrent 4]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, ratio_spread, save_figure, stop_servers, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess  # noqa: E402

POLICIES = {"default": "", "passive": "PASSIVE"}  # "": the launcher keeps libgomp's default
SAID = {"default": "OMP_WAIT_POLICY unset (empty in the environment", "passive": "OMP_WAIT_POLICY=PASSIVE"}  # its line
CONFIGS = ("plain", "capture")
PROMPT = 32


def generate(url: str, rid: str, new: int, seed: int) -> dict:
    ids = [(seed * 7919 + i * 104729) % 1000 + 10 for i in range(PROMPT)]
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json={"input_ids": ids, "rid": rid, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True}}, timeout=1800)
    r.raise_for_status()
    out = r.json()
    assert len(out["output_ids"]) == new, f"{rid}: {len(out['output_ids'])} tokens, asked {new}"
    return {"s": time.perf_counter() - t0}


def measure(way: str, url: str, rep: int, args) -> dict:
    for i in range(2):  # wake a sleeping scheduler before timing
        generate(url, f"omp-warm-{way}-{rep}-{i}", 2, 1000 + i)
    one = generate(url, f"omp-one-{way}-{rep}", args.new, rep)["s"]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrent) as pool:
        list(pool.map(lambda i: generate(url, f"omp-conc-{way}-{rep}-{i}", args.new, 100 * rep + i + 50),
                      range(args.concurrent)))
    conc = time.perf_counter() - t0
    config, policy = way.split("/")
    return {"machine": machine(), "way": way, "config": config, "omp_wait_policy": policy, "rep": rep,
            "single_s": round(one, 3), "single_tok_per_s": round(args.new / one, 2),
            "concurrent": args.concurrent, "concurrent_s": round(conc, 3),
            "concurrent_tok_per_s": round(args.concurrent * args.new / conc, 2),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def summarise(rows: List[dict]) -> List[dict]:
    out = []
    for config in CONFIGS:
        by = {p: {r["rep"]: r for r in rows if r["config"] == config and r["omp_wait_policy"] == p} for p in POLICIES}
        reps = sorted(set(by["default"]) & set(by["passive"]))
        if not reps:
            continue
        row = {"config": config, "reps": len(reps)}
        for key in ("single_s", "concurrent_s"):
            for p in POLICIES:
                row[f"{key}_{p}_median"] = round(statistics.median(by[p][r][key] for r in reps), 3)
            (row[f"{key}_ratio_default_over_passive_median"], row[f"{key}_ratio_min"],
             row[f"{key}_ratio_max"]) = ratio_spread(by["default"], by["passive"], key, reps, digits=2)
        out.append(row)
    return out


def plot(summary: List[dict], path: str, title: str) -> None:
    plt = _pyplot()
    if plt is None or not summary:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in zip(axes, ("single_s", "concurrent_s"), ("one request", "concurrent requests")):
        xs = range(len(summary))
        for k, (p, color) in enumerate((("default", "#888"), ("passive", "#2a7"))):
            vals = [s[f"{key}_{p}_median"] for s in summary]
            ax.bar([x + 0.4 * k for x in xs], vals, width=0.4, color=color, label=f"OMP_WAIT_POLICY {p}")
            for x, v in zip(xs, vals):
                ax.text(x + 0.4 * k, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks([x + 0.2 for x in xs])
        ax.set_xticklabels([f"{s['config']}\n(x{s[key + '_ratio_default_over_passive_median']})" for s in summary])
        ax.set_ylabel(f"{label}: seconds (median)")
        ax.legend(fontsize=8)
    save_figure(plt, fig, path, title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated per request")
    ap.add_argument("--concurrent", type=int, default=4, help="requests sent at once in the concurrent case")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="plain, capture or both")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or set(configs) - set(CONFIGS):
        ap.error(f"--configs: a comma-separated subset of {','.join(CONFIGS)}, got {args.configs!r}")
    if args.reps < 1 or args.new < 1 or args.concurrent < 1:
        ap.error("--reps, --new and --concurrent: at least 1")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the servers are stopped on the way out
    work = tempfile.mkdtemp(prefix="bench-omp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    logs = tempfile.mkdtemp(prefix="bench-omp-logs-")
    servers: Dict[str, ServerProcess] = {}
    rows: List[dict] = []
    ok = False
    try:
        for config in configs:
            for p, value in POLICIES.items():
                way = f"{config}/{p}"
                flags = ["--device", "cpu", "--context-length", "256"]
                if config == "capture":
                    flags += ["--hs-dump-dir", os.path.join(work, p)]
                servers[way] = ServerProcess(flags, log_path=os.path.join(logs, way.replace("/", "-") + ".log"),
                                             env={"OMP_WAIT_POLICY": value})  # the launcher's, on top of ours
        t0 = time.perf_counter()
        for way, s in servers.items():
            s.wait_ready()
            said = SAID[way.split("/")[1]]
            assert said in open(s.log_path, errors="replace").read(), f"{way}: no {said!r} in {s.log_path}"
        print(f"{len(servers)} servers ready in {time.perf_counter() - t0:.0f}s", flush=True)
        ways = list(servers)
        for rep in range(args.reps):
            for k in range(len(ways)):
                way = ways[(k + rep) % len(ways)]
                row = measure(way, servers[way].url, rep, args)
                rows.append(row)
                print(f"rep {rep} {way:16s} one {row['single_s']:.2f}s ({row['single_tok_per_s']} tok/s)  "
                      f"{args.concurrent} at once {row['concurrent_s']:.2f}s ({row['concurrent_tok_per_s']} tok/s)  "
                      f"load {row['loadavg_1m']}", flush=True)
                write_csv(os.path.join(args.out, "bench_omp_wait.csv"), rows)
        summary = summarise(rows)
        write_summary(args.out, "bench_omp_wait", summary, "summary:", str)
        plot(summary, os.path.join(args.out, "bench_omp_wait.png"),
             f"launcher CPU mode, tiny DeepSeek-V3, {args.new} new tokens; {machine()}")
        ok = True
    finally:
        stop_servers(servers, work, logs, ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
