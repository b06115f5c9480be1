"""What each of a CPU-mode server's processes spends importing SGLang, with and without the flashinfer stand-in.

In CPU mode the launcher puts two import stand-ins first on PYTHONPATH (sglang_hs/server/cpu/stubs): `sgl_kernel`,
and `flashinfer`, whose import fails as on SGLang's own CPU install, which has none
(docs/cpu-mode.md#what-the-launcher-sets). PyPI's sglang installs flashinfer-python, and without the stand-in every
SGLang process imports FlashInfer (and cutlass through it) at start, from a guarded import it never uses on the CPU
engine. This measures, in a fresh interpreter with SGLANG_USE_CPU_ENGINE=1, the import of the SGLang module each of
a --tp 1 server's processes runs from: the HTTP server's (the launcher's process), the scheduler's and the
detokenizer's (SGLang spawns those; a spawned child also imports sglang_hs's serve.py first, the same in both
ways). Ways: `stand-in` (the launcher's stubs folder) and `flashinfer` (a copy of it holding `sgl_kernel` only,
so the real FlashInfer is imported); each child reports whether FlashInfer and cutlass were loaded, which must
match its way. Per import: `cpu_s`, the child's CPU seconds (user + system, interpreter start and any process it
ran included) right after the import, and `wall_s`, seconds from the child's launch to its exit (the parent's
clock); the two ways alternate in an order rotated each repetition. The summary gives per process the median over
repetitions of each way, the median saving, and the ratio flashinfer/stand-in per repetition (median, min-max).
Writes bench_cpu_imports.csv, bench_cpu_imports_summary.csv and bench_cpu_imports.png.

    python benchmarks/bench_cpu_imports.py --out benchmarks/results [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, ratio_spread, save_figure, write_csv, write_summary  # noqa: E402
from sglang_hs.server.cpu import stubs_dir  # noqa: E402

WAYS = ("stand-in", "flashinfer")
MODULES = {  # a --tp 1 server's process -> the SGLang module it runs from
    "http_server": "sglang.srt.entrypoints.http_server",
    "scheduler": "sglang.srt.managers.scheduler",
    "detokenizer": "sglang.srt.managers.detokenizer_manager",
}
CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import {module}
ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
loaded = {{m.split(".")[0] for m in sys.modules}}
print(json.dumps({{"cpu_s": ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime, "import_wall_s": time.perf_counter() - t0,
                  "flashinfer": "flashinfer" in loaded, "cutlass": "cutlass" in loaded}}))
"""


def sgl_kernel_only(tmp: str) -> str:
    """A stubs folder like the launcher's without the flashinfer stand-in."""
    path = os.path.join(tmp, "stubs")
    shutil.copytree(os.path.join(stubs_dir(), "sgl_kernel"), os.path.join(path, "sgl_kernel"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return path


def measure(process: str, way: str, stubs: str) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (stubs, os.environ.get("PYTHONPATH")) if p))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD.format(module=MODULES[process])], env=env,
                         capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{process} ({way}): exit {out.returncode}: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = way == "flashinfer"
    assert got["flashinfer"] == want and got["cutlass"] == want, f"{process} ({way}): loaded {got}"
    return {"cpu_s": round(got["cpu_s"], 2), "wall_s": round(wall, 2), "import_wall_s": round(got["import_wall_s"], 2)}


def summarise(rows: List[dict]) -> List[dict]:
    out = []
    for process in MODULES:
        by = {w: {r["rep"]: r for r in rows if r["process"] == process and r["way"] == w} for w in WAYS}
        reps = sorted(set(by["stand-in"]) & set(by["flashinfer"]))
        if not reps:
            continue
        for key in ("cpu_s", "wall_s"):
            ratio, low, high = ratio_spread(by["flashinfer"], by["stand-in"], key, reps)
            out.append({"process": process, "measure": key, "reps": len(reps),
                        "stand_in_median": round(statistics.median(by["stand-in"][r][key] for r in reps), 2),
                        "flashinfer_median": round(statistics.median(by["flashinfer"][r][key] for r in reps), 2),
                        "saved_median": round(statistics.median(by["flashinfer"][r][key] - by["stand-in"][r][key]
                                                                for r in reps), 2),
                        "ratio_flashinfer_over_stand_in_median": ratio, "ratio_min": low, "ratio_max": high})
    return out


def plot(rows: List[dict], summary: List[dict], path: str, title: str) -> None:
    plt = _pyplot()
    if plt is None or not summary:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, process in enumerate(MODULES):
        s = next((x for x in summary if x["process"] == process and x["measure"] == "cpu_s"), None)
        if s is None:
            continue
        for k, (way, color) in enumerate((("stand-in", "#2a7"), ("flashinfer", "#888"))):
            x = i + (k - 0.5) * width
            v = s[f"{way.replace('-', '_')}_median"]
            ax.bar(x, v, width=width * 0.9, color=color, label=f"{way} (median)" if i == 0 else None)
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
            pts = [r["cpu_s"] for r in rows if r["process"] == process and r["way"] == way]
            ax.plot([x] * len(pts), pts, "k.", markersize=4)  # each repetition
    ax.set_xticks(range(len(MODULES)))
    ax.set_xticklabels([f"{p}\n(x{s['ratio_flashinfer_over_stand_in_median']})" for p in MODULES
                        for s in summary if s["process"] == p and s["measure"] == "cpu_s"])
    ax.set_ylabel("CPU seconds of the process's import")
    ax.legend(fontsize=8)
    save_figure(plt, fig, path, title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps: at least 1")
    os.makedirs(args.out, exist_ok=True)
    rows: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-imports-") as tmp:
        stubs: Dict[str, str] = {"stand-in": stubs_dir(), "flashinfer": sgl_kernel_only(tmp)}
        for rep in range(args.reps):
            for process in MODULES:
                for k in range(len(WAYS)):
                    way = WAYS[(k + rep) % len(WAYS)]
                    row = {"machine": machine(), "process": process, "way": way, "rep": rep,
                           **measure(process, way, stubs[way]), "loadavg_1m": round(os.getloadavg()[0], 2)}
                    rows.append(row)
                    print(f"rep {rep} {process:12s} {way:10s} cpu {row['cpu_s']:.1f}s  wall {row['wall_s']:.1f}s  "
                          f"load {row['loadavg_1m']}", flush=True)
                    write_csv(os.path.join(args.out, "bench_cpu_imports.csv"), rows)
    summary = summarise(rows)
    write_summary(args.out, "bench_cpu_imports", summary, "summary:", str)
    plot(rows, summary, os.path.join(args.out, "bench_cpu_imports.png"),
         f"a CPU-mode server's process imports, FlashInfer left out or imported; {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
