"""What one synchronous finish costs the scheduler under SGLang's overlap scheduler (issue 48, item 5): the
path SGLANG_HS_SYNC_FINISH=1 and the KV allocators the finish worker is not checked with (the SWA ones
DeepSeek-V4 runs on) take, on the scheduler thread, for every finished request.

One overlap iteration, as SGLang 0.5.23 runs it: the iteration's start mark (the capture hook), step N+1's
"forward" launched on a forward stream (bf16 matmuls of --forward-ms), the schedule stream made to wait for
it (the write-after-read barrier), then step N's result processing, where a request of --tokens tokens
finishes and its record is gathered and published from a DeepSeek-V3-sized store (K = 3 + final, H = 7168):
  before  the old path: the current stream synchronised (waits for the whole forward N+1) and the slot ids
          copied with .cpu() there
  after   CaptureWriter.finish now: the slot ids (and the copy kernel's error counter) copied on the side
          stream after the iteration's mark (sglang_hs/server/store/slot_ids.py)
Per design, median and min-max over --reps iterations: finish_ms (the scheduler thread's time in the finish,
host clock) and its ratio to the forward's length; rows_bad (each record read back against the rows
written). CSV (and a plot when matplotlib is there) into --out.

    python benchmarks/bench_sync_finish_gpu.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import plot_bars, write_csv  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

LAYERS, N_LAYERS, H = [2, 30, 58], 61, 7168


def _forward(stream, a, b, n):
    with torch.cuda.stream(stream):
        for _ in range(n):
            torch.matmul(a, b, out=a)


def _old_finish(w, rid, ids, slots):
    """The synchronous finish as it was: the schedule stream synchronised, the ids copied there."""
    torch.cuda.current_stream().synchronize()
    w._host_store().check()
    w.publish_gathered(rid, torch.as_tensor(ids, dtype=torch.int32), slots.cpu())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--slots", type=int, default=65536)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--forward-ms", type=float, default=30.0, help="length of the stand-in forward N+1")
    p.add_argument("--out", default="benchmarks/results")
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sync_finish_gpu: needs an NVIDIA GPU")
        return 2
    os.makedirs(ns.out, exist_ok=True)
    d = tempfile.mkdtemp(prefix="bench_sync_finish-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    T = ns.tokens
    w = CaptureWriter(d, CaptureSpec.resolve(LAYERS, True, N_LAYERS, H), ns.slots, torch.bfloat16, 4 << 30,
                      device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.eye(4096, device="cuda", dtype=torch.bfloat16)
    # Calibrated after a warm-up: the first matmuls also create cuBLAS's handle and workspace and pick its
    # kernel, which made 10 of them look ~40x slower and the stand-in forward 0.8 ms instead of 30 ms
    _forward(torch.cuda.current_stream(), a, b, 10)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    _forward(torch.cuda.current_stream(), a, b, 50)
    t1.record()
    t1.synchronize()
    n_mm = max(1, round(50 * ns.forward_ms / t0.elapsed_time(t1)))
    forward = torch.cuda.Stream()
    ring_s, publish = [0.0], w.ring.publish

    def timed_publish(*args, **kwargs):  # the gather into the ring and the record's publication
        t = time.perf_counter()
        try:
            return publish(*args, **kwargs)
        finally:
            ring_s[0] += time.perf_counter() - t

    w.ring.publish = timed_publish
    rows, total_bad, gpu = [], 0, torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    with HiddenStateReader(d) as reader:
        for design in ("before", "after"):
            times, fwd, gathers, bad = [], [], [], 0
            for rep in range(ns.reps + 2):
                slots = (torch.randperm(ns.slots - 1, device="cuda", generator=g)[:T] + 1).to(torch.int32)
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
                aux, last = torch.cat([x * (k + 2) for k in range(len(LAYERS))], 1), x.neg()
                w.copy(aux, last, slots)  # step N's rows (its forward)
                torch.cuda.synchronize()  # step N's results: copy_done synchronised
                w.slot_ids.mark_iteration()  # the next iteration starts
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(forward)
                _forward(forward, a, b, n_mm)  # step N+1's forward, launched
                e1.record(forward)
                torch.cuda.current_stream().wait_stream(forward)  # the write-after-read barrier
                rid = f"{design}-{rep}"
                g0 = ring_s[0]
                t = time.perf_counter()
                (_old_finish if design == "before" else CaptureWriter.finish)(w, rid, list(range(T)), slots)
                finish_ms = (time.perf_counter() - t) * 1e3
                gather_ms = (ring_s[0] - g0) * 1e3  # of it, the gather into the ring (the same work in both)
                torch.cuda.synchronize()
                rec = reader.take(rid, timeout=60)
                want = torch.cat([aux.view(T, -1, H), last.view(T, 1, H)], 1).cpu()
                bad += int((torch.cat([rec.aux_hidden_states, rec.last_hidden_state[:, None]], 1) != want)
                           .flatten(1).any(1).sum())
                if rep >= 2:  # two warm-up iterations
                    times.append(finish_ms)
                    fwd.append(e0.elapsed_time(e1))
                    gathers.append(gather_ms)
            total_bad += bad
            med, fwd_med = statistics.median(times), statistics.median(fwd)
            rows.append({"gpu": gpu, "design": design, "tokens": T, "reps": ns.reps, "finish_ms": round(med, 3),
                         "finish_min_ms": round(min(times), 3), "finish_max_ms": round(max(times), 3),
                         "gather_ms": round(statistics.median(gathers), 3),
                         "forward_ms": round(fwd_med, 3), "of_forward": round(med / fwd_med, 4), "rows_bad": bad})
            print(f"{design:6s} finish {med:8.3f} ms (min {min(times):.3f}, max {max(times):.3f}) against a "
                  f"{fwd_med:.1f} ms forward N+1: {med / fwd_med:.2%} of it (the gather into the ring "
                  f"{statistics.median(gathers):.3f} ms of it); rows bad {bad}", flush=True)
    shutil.rmtree(d, ignore_errors=True)
    write_csv(os.path.join(ns.out, "bench_sync_finish_gpu.csv"), rows)
    plot_bars(os.path.join(ns.out, "bench_sync_finish_gpu.png"), {r["design"]: r["finish_ms"] for r in rows},
              "scheduler ms per synchronous finish", f"{gpu}: {T}-token record, {ns.forward_ms:.0f} ms forward N+1")
    return 0 if total_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
