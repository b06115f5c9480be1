"""Store and output-ring throughput against a plain memcpy of the same bytes, on this machine.

DeepSeek-V3-sized rows (K = 3 aux layers + the final state, H = 7168, bf16: 57,344 bytes per token).
One run alternates, `--reps` times:
  memcpy      numpy copy of each record's bytes, DRAM to DRAM, into a ring-sized buffer (the yardstick)
  store+ring  the real path, two processes: the writer (this process) copies each record's rows into the
              store at scattered KV slots with the server's CPU op (what every forward step does), then at
              finish gathers them straight into the output ring; a reader process
              (sglang_hs.HiddenStateReader, recycle_memory=True as the extraction CLI runs it) drains them,
              one copy each: three copies of the bytes in all
  ring        the output ring alone: the writer publishes prepared rows, the reader drains them (two copies)
The figure is bytes delivered per second (record rows only), timed at the reader in steady state (after
one lap of the ring), with each process on one core, and each / memcpy, as medians.

    python benchmarks/bench_ring.py --out benchmarks/results     # bench_ring.csv (+ .png with matplotlib)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import machine, plot_bars, write_csv  # noqa: E402

K, H = 3, 7168
P = K + 1
METHODS = ("memcpy", "store+ring", "ring")


def _reader(dump_dir: str, warmup: int, n: int, q) -> None:
    from sglang_hs.reader import HiddenStateReader

    torch.set_num_threads(1)  # two processes on two cores
    reader = HiddenStateReader(dump_dir, poll_interval=0.0005, recycle_memory=True)
    q.put(("ready",))
    got, t0 = 0, None
    for i in range(warmup + n):
        rec = reader.next(timeout=120)
        if i == warmup - 1:
            t0 = time.perf_counter()  # steady state from here: the ring and the heap have been through once
        elif i >= warmup:
            got += rec.aux_hidden_states.numel() + rec.last_hidden_state.numel()
        del rec
    q.put(("done", time.perf_counter() - t0, got))


def run_ring(tokens: int, records: int, slots: int, ring_bytes: int, with_store: bool = True) -> float:
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    base = tempfile.mkdtemp(prefix="bench-ring-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    threads = torch.get_num_threads()
    try:
        spec = CaptureSpec.resolve([2, 30, 58], True, 61, H)
        writer = CaptureWriter(base, spec, slots, torch.bfloat16, ring_bytes)
        g = torch.Generator().manual_seed(0)
        aux = torch.randn(tokens, K * H, generator=g).bfloat16()
        last = torch.randn(tokens, H, generator=g).bfloat16()
        rows = torch.cat([aux.view(tokens, K, H), last.view(tokens, 1, H)], 1)
        ids, ids32 = list(range(tokens)), torch.arange(tokens, dtype=torch.int32)
        warmup = max(4, ring_bytes // (tokens * P * H * 2) + 2)  # one lap of the ring
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_reader, args=(base, warmup, records, q))
        proc.start()
        assert q.get(timeout=120)[0] == "ready"
        torch.set_num_threads(1)
        for i in range(warmup + records):
            if with_store:
                slots_i = torch.randperm(slots - 1, generator=g)[:tokens] + 1  # scattered, like KV slots
                writer.copy(aux, last, slots_i)
                writer.finish(f"bench-{i}", ids, slots_i)
            else:
                writer.ring.publish(f"bench-{i}", ids32, rows)
        _, seconds, got = q.get(timeout=300)
        proc.join(30)
        assert got == records * tokens * P * H
        return got * 2 / seconds
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(base, ignore_errors=True)


def run_memcpy(tokens: int, records: int, ring_bytes: int) -> float:
    """One numpy copy per record, from a large source to rotating places of a ring-sized buffer (so from
    and to DRAM, as the ring does, not between two cache-resident buffers)."""
    n = tokens * P * H * 2
    src = np.random.default_rng(0).integers(0, 255, max(2 * n, ring_bytes // 2), dtype=np.uint8)
    dst = np.ones(max(2 * n, ring_bytes), dtype=np.uint8)
    t0 = time.perf_counter()
    for i in range(records):
        s, d = (i * n) % (len(src) - n), (i * n) % (len(dst) - n)
        np.copyto(dst[d:d + n], src[s:s + n])
    return n * records / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per record")
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4096, help="KV slots of the store")
    ap.add_argument("--ring-mib", type=int, default=512)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for rep in range(args.reps):
        for method in METHODS:
            bps = run_memcpy(args.tokens, args.records, args.ring_mib << 20) if method == "memcpy" else \
                run_ring(args.tokens, args.records, args.slots, args.ring_mib << 20, with_store=method == "store+ring")
            rows.append({"machine": machine(), "method": method, "rep": rep, "tokens_per_record": args.tokens,
                         "records": args.records, "bytes": args.tokens * P * H * 2 * args.records,
                         "GBps": round(bps / 1e9, 3)})
            print(f"rep {rep} {method:>10}: {bps / 1e9:6.2f} GB/s", flush=True)
            write_csv(os.path.join(args.out, "bench_ring.csv"), rows)
    med = {m: statistics.median(r["GBps"] for r in rows if r["method"] == m) for m in METHODS}
    print(f"median GB/s ({machine()}): " + ", ".join(
        f"{m} {v:.2f} ({v / med['memcpy']:.2f} of memcpy)" for m, v in med.items()))
    plot_bars(os.path.join(args.out, "bench_ring.png"), med, "GB/s (median)",
              f"store + output ring vs memcpy, {args.tokens}-token records of 57 KB/token\n{machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
