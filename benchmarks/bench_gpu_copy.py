"""How fast can a forward step's captured rows get to host memory, and what does it cost the step?

DeepSeek-V3-sized capture: K = 3 aux layers + the final state, H = 7168, bf16 (57 KB per token), at
512, 2048 and 8192 tokens. Strategies, each timed with CUDA events (median of repeats, after warm-up):
  a_kernel_to_host     Triton copy kernel writing straight into registered (pinned, mapped) host memory
                       at scattered KV slots (the zero-copy strategy; holds the compute stream throughout)
  b_stage_plus_async   kernel into a device staging buffer [T, P, H], then cudaMemcpyAsync to pinned host
                       on a separate copy stream (compute stream held only for the device-side kernel)
  c_memcpy_d2h_pinned  cudaMemcpyAsync of the same bytes, device -> pinned host (the practical PCIe limit)
  d_cpu_pageable       tensor.cpu() into pageable memory (what naive dumping does)
  a_graph, b_graph     a and b captured in a CUDA graph and replayed
  e_staging_writer     what `--hs-copy staging` runs (sglang_hs/store/staging.py, a T-row stage): kernel into
                       the stage, device copy to its twin (the compute stream waits for it), copy to pinned
                       host on the copy stream, scatter into the store by slot on the scatter thread; `ms` is
                       the wall time per step until the rows are in the store, `host_ms` the scatter thread's
                       time, `wait_ms` the time the caller (the scheduler) waited for it or for a host buffer
Cost is reported against a representative per-GPU forward step at the same token count: the bf16
matmuls of one DeepSeek-V3 layer at TP8 shapes (MLA projections, 8 routed + 1 shared expert with the
expert width split 8 ways), times 61 layers; attention itself is left out, so the step is a lower bound
and the fraction an upper bound.

    python benchmarks/bench_gpu_copy.py --out DIR     # DIR/bench_gpu_copy.csv and .png, written as it goes
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sglang_hs.ops.copy_rows import HostStore, copy_rows  # noqa: E402
from sglang_hs.store import pinned  # noqa: E402
from sglang_hs.store.staging import StagedCopy  # noqa: E402

K, H, P = 3, 7168, 4
DT = torch.bfloat16
TOKENS = (512, 2048, 8192)
# One DeepSeek-V3 layer at TP8, per token: (in, out) of each bf16 matmul.
LAYER_MATMULS = [(7168, 1536), (1536, 16 * 192), (7168, 576), (512, 16 * 256), (16 * 128, 7168)] + \
    [(7168, 2 * 256), (256, 7168)] * 9


def timed(fn, reps, stream=None):
    """Median milliseconds of fn over reps, with events on `stream`."""
    stream = stream or torch.cuda.current_stream()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def forward_step_ms(T):
    xs = {i: torch.randn(T, i, device="cuda", dtype=DT) for i, _ in LAYER_MATMULS}
    ws = [torch.randn(i, o, device="cuda", dtype=DT) / i**0.5 for i, o in LAYER_MATMULS]

    def layer():
        for (i, _), w in zip(LAYER_MATMULS, ws):
            xs[i] @ w

    return 61 * timed(layer, 10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "bench_gpu_copy.csv")
    gpu = torch.cuda.get_device_name()
    fields = ["gpu", "tokens", "strategy", "ms", "GBps", "compute_stream_ms", "host_ms", "wait_ms", "step_ms", "fraction_of_step"]
    f = open(csv_path, "w", newline="")
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    rows = []

    def emit(T, name, ms, hold_ms, step, host_ms="", wait_ms=""):
        nbytes = T * P * H * 2
        r = dict(gpu=gpu, tokens=T, strategy=name, ms=round(ms, 4), GBps=round(nbytes / ms / 1e6, 2),
                 compute_stream_ms=round(hold_ms, 4), host_ms=host_ms and round(host_ms, 4),
                 wait_ms=wait_ms and round(wait_ms, 4), step_ms=round(step, 3),
                 fraction_of_step=round(hold_ms / step, 5))
        w.writerow(r)
        f.flush()
        rows.append(r)
        print(f"{T:6d} {name:22s} {ms:9.3f} ms {r['GBps']:8.1f} GB/s  holds compute {hold_ms:8.3f} ms "
              f"= {100 * r['fraction_of_step']:.2f}% of a {step:.1f} ms step"
              f"{f'; scatter thread {host_ms:.3f} ms, caller waited {wait_ms:.3f} ms' if host_ms != '' else ''}",
              flush=True)

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    for T in TOKENS:
        S = 2 * T
        step = forward_step_ms(T)
        aux = torch.randn(T, K * H, device="cuda", dtype=DT)
        last = torch.randn(T, H, device="cuda", dtype=DT)
        slots = (torch.randperm(S - 1, device="cuda")[:T] + 1).contiguous()
        ident = torch.arange(T, device="cuda")
        try:
            from sglang_hs.store.shm import SharedRegion

            region = SharedRegion.create(tempfile.mkdtemp(dir=shm), "store", S * P * H * 2)
            host_buf = region.buf
        except Exception as e:  # no extension or a small /dev/shm: plain host memory, same registration
            print(f"(store in plain host memory: {e})")
            region, host_buf = None, torch.empty(S * P * H * 2, dtype=torch.uint8)
        host = host_buf.view(DT).view(S, P, H)
        host.zero_()  # touch every page before timing
        store = HostStore(host, pinned.register(host_buf))
        staging = torch.empty(T, P, H, device="cuda", dtype=DT)
        pinned_stage = torch.empty(T, P, H, dtype=DT, pin_memory=True)
        flat = torch.empty(T, P, H, device="cuda", dtype=DT)
        copy_stream = torch.cuda.Stream()

        # (a) kernel straight into registered host memory
        a_ms = timed(lambda: copy_rows(aux, last, slots, store), args.reps)
        emit(T, "a_kernel_to_host", a_ms, a_ms, step)
        # check once: bit-exact rows at their slots
        torch.cuda.synchronize()
        want = torch.cat([aux.view(T, K, H), last[:, None]], 1)
        assert torch.equal(host[slots.cpu()].cuda(), want), "kernel wrote wrong rows"

        # (b) kernel into device staging, async copy on a copy stream
        stage_ms = timed(lambda: copy_rows(aux, last, ident, staging), args.reps)

        def b():
            copy_rows(aux, last, ident, staging)
            copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy_stream):
                pinned_stage.copy_(staging, non_blocking=True)
            torch.cuda.current_stream().wait_stream(copy_stream)

        emit(T, "b_stage_plus_async", timed(b, args.reps), stage_ms, step)
        # (c) the PCIe limit: one contiguous device -> pinned copy
        c_ms = timed(lambda: pinned_stage.copy_(flat, non_blocking=True), args.reps)
        emit(T, "c_memcpy_d2h_pinned", c_ms, c_ms, step)
        # (d) naive .cpu() into pageable memory (host-synchronous)
        t0 = time.perf_counter()
        for _ in range(5):
            flat.cpu()
        d_ms = (time.perf_counter() - t0) / 5 * 1e3
        emit(T, "d_cpu_pageable", d_ms, d_ms, step)

        # (a) and (b) inside a CUDA graph
        for name, body, hold in (("a_graph", lambda: copy_rows(aux, last, slots, store), None),
                                 ("b_graph", lambda: copy_rows(aux, last, ident, staging), stage_ms)):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                body()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            if name == "a_graph":
                ms = timed(g.replay, args.reps)
                emit(T, name, ms, ms, step)
            else:
                def replay_and_copy():
                    g.replay()
                    copy_stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(copy_stream):
                        pinned_stage.copy_(staging, non_blocking=True)
                    torch.cuda.current_stream().wait_stream(copy_stream)

                emit(T, name, timed(replay_and_copy, args.reps), timed(g.replay, args.reps), step)
        # (e) the staging strategy as the server runs it
        sc = StagedCopy(host, T, "cuda")

        def e():
            sc.before_step()
            sc.write(aux, last, slots)
            sc.after_step(T, graph_replayed=False)

        hold = timed(e, args.reps)  # compute stream: the kernel, the slot copy and the wait for the device copy
        torch.cuda.synchronize()
        sc.drain()
        host.zero_()
        scatter0, wait0, t0 = sc.stats["scatter_s"], sc.stats["stage_wait_s"], time.perf_counter()
        for _ in range(args.reps):
            e()
        torch.cuda.synchronize()
        sc.drain()
        wall = (time.perf_counter() - t0) / args.reps * 1e3
        assert torch.equal(host[slots.cpu()].cuda(), want), "staging wrote wrong rows"
        emit(T, "e_staging_writer", wall, hold, step, host_ms=(sc.stats["scatter_s"] - scatter0) / args.reps * 1e3,
             wait_ms=(sc.stats["stage_wait_s"] - wait0) / args.reps * 1e3)
        sc.close()
        sc = None  # free its device and pinned buffers before the next size
        pinned.unregister(host_buf)
        if region is not None:
            region.unlink()
        del store, host, host_buf, staging, pinned_stage, flat
        torch.cuda.empty_cache()
    f.close()
    plot(rows, os.path.join(args.out, "bench_gpu_copy.png"), gpu)


def plot(rows, path, gpu):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        rs = [r for r in rows if r["strategy"] == name]
        ax1.plot([r["tokens"] for r in rs], [r["GBps"] for r in rs], marker="o", label=name)
        ax2.plot([r["tokens"] for r in rs], [100 * r["fraction_of_step"] for r in rs], marker="o", label=name)
    ax1.set(xscale="log", xlabel="tokens per step", ylabel="GB/s to host", title=f"capture copy, {gpu}")
    ax2.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="% of a forward step (compute stream held)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
