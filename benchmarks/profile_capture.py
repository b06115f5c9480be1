"""Where the capturing server's scheduler spends its time, from a py-spy profile: the share of samples
in sglang-hs code (the copy in the forward, the finish-time gather into the ring, the hooks), which on
two shared cores is a steadier figure of the in-server cost of capture than comparing throughputs.

The server (capture on, K = 3 + last) serves prompts of --length tokens, --concurrency in flight,
while a reader thread drains the ring; py-spy samples the scheduler process for --seconds. Writes
profile_capture.csv (one row per sglang-hs function, and the total) and prints the table.

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
from benchmarks.common import machine, write_csv  # noqa: E402
from sglang_hs import envs  # noqa: E402
from sglang_hs.server_process import ServerProcess, scheduler_pid  # noqa: E402


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


def ours(stack: list, sites: set) -> str:
    """The innermost sglang-hs frame of a stack ("function (file:line)" strings), or '' when the sample
    is upstream work: outside our code, or below one of our hand-over calls."""
    for frame in reversed(stack):
        if "sglang_hs/" in frame:
            fn, where = frame.rsplit(" (", 1)
            file, _, line = where.rstrip(")").rpartition(":")
            if (file[file.index("sglang_hs/"):], int(line)) in sites:
                return ""
            return fn
    return ""


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
                                "-r", "100", "-f", "raw", "-o", raw, "--nonblocking"],
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
    total, by_fn, sites = 0, collections.Counter(), upstream_call_sites()
    with open(raw) as f:
        for line in f:
            if not line.strip():
                continue
            stack, n = line.rstrip().rsplit(" ", 1)
            total += int(n)
            fn = ours(stack.split(";"), sites)
            if fn:
                by_fn[fn] += int(n)
    rows = [{"machine": machine(), "length": args.length, "concurrency": args.concurrency, "copy": args.copy,
             "function": fn, "samples": n, "share": round(n / total, 4)} for fn, n in by_fn.most_common()]
    rows.append({"machine": machine(), "length": args.length, "concurrency": args.concurrency, "copy": args.copy,
                 "function": "ALL sglang-hs", "samples": sum(by_fn.values()),
                 "share": round(sum(by_fn.values()) / total, 4)})
    shutil.rmtree(work, ignore_errors=True)
    write_csv(os.path.join(args.out, f"profile_capture{'' if args.copy == 'direct' else '_' + args.copy}.csv"), rows)
    print(f"scheduler samples: {total} over {wall:.0f}s ({tokens / wall:,.0f} prompt tok/s under py-spy), "
          f"{machine()}")
    for r in rows:
        print(f"  {100 * r['share']:5.1f}%  {r['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
