"""Where the capturing server's scheduler spends its time, from a py-spy profile: the share of samples
in sglang-hs code (the copy in the forward, the finish-time gather into the ring, the hooks), which on
two shared cores is a steadier figure of the in-server cost of capture than comparing throughputs.

The server (capture on, K = 3 + last) serves prompts of --length tokens, --concurrency in flight,
while a reader thread drains the ring; py-spy samples every thread of the scheduler process for
--seconds (`--threads`: each sample names its thread; idle samples, a thread waiting on a lock or a
queue, are left out). The figures are per thread, since the cost that matters is the scheduler thread's
(SGLang's MainThread: it launches the forwards) and the finish worker (sglang-hs-finish) and staging
scatter (sglang-hs-scatter) run beside it: per thread, the share of its busy samples in sglang-hs code,
its busy share of the wall time (samples / (rate x seconds)), and the same over the whole process.
Writes profile_capture.csv (one row per sglang-hs function, a total row and a busy row; per thread a
column of shares), profile_capture.png (the sglang-hs share per thread) and prints the table.

    python benchmarks/profile_capture.py --out benchmarks/results [--length 512] [--concurrency 8] [--copy staging]
"""
from __future__ import annotations

import argparse
import collections
import importlib.metadata
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_extract import LAYERS, _warm, run_plain  # noqa: E402
from benchmarks.common import machine, plot_bars, write_csv  # noqa: E402
from sglang_hs import envs  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess, scheduler_pid  # noqa: E402


def py_spy() -> str:
    dist = importlib.metadata.distribution("py-spy")  # installed with sglang
    path = next(str(dist.locate_file(f)) for f in dist.files if str(f).endswith("bin/py-spy"))
    return os.path.normpath(path)


def upstream_call_sites() -> set:
    """(file, line) of the calls by which sglang-hs hands over to upstream: the overlay's calls of the
    model and the logits processor, and each hook's call of the method it wraps (`ORIGINALS[...]`).
    Samples below them are SGLang's work, not ours. Found in the source, not hard-coded."""
    import ast

    import sglang_hs

    root = os.path.dirname(sglang_hs.__file__)
    sites = set()
    for rel in ("models/deepseek_v2.py", "patches/capture_hooks.py"):
        for node in ast.walk(ast.parse(open(os.path.join(root, rel)).read())):
            if isinstance(node, ast.Call):
                src = ast.unparse(node.func)
                if src in ("super().forward", "self.model", "self.logits_processor") or src.startswith("ORIGINALS["):
                    sites.add((f"sglang_hs/{rel}", node.lineno))
    return sites


# The CPU engine's own fixes (sglang_hs/server/patches, the ledger's "CPU mode only" rows): model compute that
# SGLang's CPU engine lacks and a GPU server runs upstream, so their samples are the model's, not capture's.
CPU_ENGINE_PATCHES = tuple(f"sglang_hs/server/patches/{m}.py" for m in (
    "mla_torch_native", "torch_native_cpu_pad", "moe_native_ep", "dsa_torch_native", "cpu_gloo_groups"))


def ours(stack: list, sites: set) -> str:
    """The innermost sglang-hs frame of a stack ("function (file:line)" strings), or '' when the sample
    is upstream work: outside our code, below one of our hand-over calls, or in a CPU-engine patch (the
    model's compute: skipped, the frames outside it decide)."""
    for frame in reversed(stack):
        if "sglang_hs/" in frame:
            fn, where = frame.rsplit(" (", 1)
            file, _, line = where.rstrip(")").rpartition(":")
            file = file[file.index("sglang_hs/"):]
            if file in CPU_ENGINE_PATCHES:
                continue
            if (file, int(line)) in sites:
                return ""
            return fn
    return ""


SCHEDULER_THREAD = "MainThread"  # the scheduler process's main thread runs SGLang's event loop
RATE = 100  # py-spy samples per second


def thread_of(stack: list) -> str:
    """The thread name of a `py-spy --threads` sample (its root frame "thread (ID): NAME"), ID if unnamed."""
    head = stack[0] if stack else ""
    if not head.startswith("thread ("):
        return "?"
    tid, _, name = head[len("thread ("):].partition("):")
    return name.strip() or tid


def tabulate(raw_lines, sites: set, seconds: float):
    """Per-thread figures of a raw `py-spy --threads` profile: (busy samples per thread, sglang-hs samples
    per (function, thread), busy share of the wall per thread, samples in CPU-engine patches per thread)."""
    busy, by_fn = collections.Counter(), collections.defaultdict(collections.Counter)
    cpu_patch = collections.Counter()
    for line in raw_lines:
        if not line.strip():
            continue
        stack, n = line.rstrip().rsplit(" ", 1)
        frames = stack.split(";")
        thread = thread_of(frames)
        busy[thread] += int(n)
        fn = ours(frames[1:], sites)
        if fn:
            by_fn[fn][thread] += int(n)
        elif any(p in f for f in frames for p in CPU_ENGINE_PATCHES):
            cpu_patch[thread] += int(n)
    wall = {t: n / (RATE * seconds) for t, n in busy.items()}
    return busy, by_fn, wall, cpu_patch


def table(busy, by_fn, wall, cpu_patch, base: dict) -> list:
    """CSV rows: one per sglang-hs function, then "ALL sglang-hs", the CPU-engine patches (model compute,
    not in ALL) and "busy (share of wall)"; columns
    `all threads` (share of the process's busy samples) and, per thread, the share of that thread's busy
    samples (threads with sglang-hs code or the scheduler thread first, then the busiest)."""
    total = sum(busy.values())
    threads = sorted(busy, key=lambda t: (t != SCHEDULER_THREAD, -sum(c[t] for c in by_fn.values()), -busy[t]))
    rows = []
    fns = sorted(by_fn, key=lambda f: -sum(by_fn[f].values()))
    for fn in fns + ["ALL sglang-hs"]:
        counts = by_fn[fn] if fn in by_fn else collections.Counter(
            {t: sum(c[t] for c in by_fn.values()) for t in threads})
        row = {**base, "function": fn, "samples": sum(counts.values()),
               "all threads": round(sum(counts.values()) / total, 4) if total else 0.0}
        row.update({t: round(counts[t] / busy[t], 4) if busy[t] else 0.0 for t in threads})
        rows.append(row)
    rows.append({**base, "function": "CPU-engine patches (model compute, not counted)",
                 "samples": sum(cpu_patch.values()),
                 "all threads": round(sum(cpu_patch.values()) / total, 4) if total else 0.0,
                 **{t: round(cpu_patch[t] / busy[t], 4) if busy[t] else 0.0 for t in threads}})
    rows.append({**base, "function": "busy (share of wall)", "samples": total,
                 "all threads": round(sum(wall.values()), 4), **{t: round(wall[t], 4) for t in threads}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--copy", choices=envs.COPY_STRATEGIES, default="direct", help="--hs-copy of the server")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="profile-capture-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    dump, raw = os.path.join(work, "hs"), os.path.join(work, "profile.txt")
    server = ServerProcess(["--hs-dump-dir", dump, "--hs-layers", ",".join(map(str, LAYERS)), "--hs-last",
                            "--hs-copy", args.copy, "--chunked-prefill-size", "4096", "--max-total-tokens", str(max(16384, 8 * args.length))])
    stop = threading.Event()
    try:
        server.wait_ready()
        from sglang_hs.reader import HiddenStateReader

        reader = HiddenStateReader(dump, recycle_memory=True)

        def drain():
            while not stop.is_set():
                reader.poll()
                reader._ready.clear()
                time.sleep(0.001)

        threading.Thread(target=drain, daemon=True).start()
        _warm(server, args.length)
        spy = subprocess.Popen([py_spy(), "record", "-p", str(scheduler_pid(server.pids())), "-d", str(args.seconds),
                                "-r", str(RATE), "-f", "raw", "-o", raw, "--nonblocking", "--threads"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rng, t0, tokens = random.Random(0), time.monotonic(), 0
        while spy.poll() is None:
            prompts = [[rng.randint(5, 1000) for _ in range(args.length)] for _ in range(4 * args.concurrency)]
            tokens += run_plain(server, prompts, args.concurrency)["tokens"]
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed: {spy.stderr.read().decode()[-500:]}")
        wall = time.monotonic() - t0
    finally:
        stop.set()
        server.stop()
    with open(raw) as f:
        busy, by_fn, wall_share, cpu_patch = tabulate(f, upstream_call_sites(), args.seconds)
    base = {"machine": machine(), "length": args.length, "concurrency": args.concurrency, "copy": args.copy}
    rows = table(busy, by_fn, wall_share, cpu_patch, base)
    shutil.rmtree(work, ignore_errors=True)
    name = f"profile_capture{'' if args.copy == 'direct' else '_' + args.copy}"
    write_csv(os.path.join(args.out, name + ".csv"), rows)
    threads = [k for k in rows[-1] if k not in base and k not in ("function", "samples", "all threads")]
    print(f"scheduler process samples: {sum(busy.values())} busy over {wall:.0f}s ({tokens / wall:,.0f} prompt "
          f"tok/s under py-spy), {machine()}")
    print("  share of each thread's busy samples in sglang-hs code:")
    print("  " + "  ".join(f"{t[:18]:>18s}" for t in ["all threads", *threads]) + "  function")
    for r in rows:
        print("  " + "  ".join(f"{100 * r[t]:17.2f}%" for t in ["all threads", *threads]) + f"  {r['function']}")
    ours_row = next(r for r in rows if r["function"] == "ALL sglang-hs")
    sched = ours_row.get(SCHEDULER_THREAD, 0.0)
    print(f"scheduler thread ({SCHEDULER_THREAD}): {100 * sched:.2f}% of its busy samples in sglang-hs code, "
          f"{100 * sched * wall_share.get(SCHEDULER_THREAD, 0):.2f}% of the wall")
    plot_bars(os.path.join(args.out, name + ".png"), {t[:16]: 100 * ours_row[t] for t in threads[:6]},
              "% of the thread's busy samples in sglang-hs code",
              f"{args.length}-token prompts, --hs-copy {args.copy}, {args.concurrency} in flight; {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
