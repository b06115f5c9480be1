"""How fast do a forward step's captured rows get to the host store, and what does it cost the step?

DeepSeek-V3-sized capture: K = 3 aux layers + the final state, H = 7168, bf16 (57 KB per token), at
512, 2048 and 8192 tokens, into a store of realistic size (--store-gib, 16 by default: ~300k KV slots),
each step at fresh random slots spread over the whole store, so page-table and TLB effects show.

The strategies of `--hs-copy`, as the server runs them (sglang_hs/server/ops/copy_rows.py, store/staging.py):
  direct_eager    the Triton copy kernel writes straight into the registered (pinned, mapped) store;
                  the compute stream is held for the whole copy
  direct_graph    the same launch captured in a CUDA graph, replayed with new slots each step
  staging_eager   kernel into a device stage, device copy to its twin (the compute stream waits for
                  that), copy to pinned host on a copy stream, scatter into the store by slot on the
                  scatter thread
  staging_graph   the stage write captured in a CUDA graph; after each replay the step is shipped
                  (both with the default scatter threads, SGLANG_HS_SCATTER_THREADS or 4)
  staging_eager_tN  staging_eager with N scatter threads (--scatter-threads, 1,2,8 by default)
  deferred_eager  the stage and its device copy as staging, then the copy kernel on the copy stream writes
                  the twin into the registered store by slot (no host buffer, no scatter thread)
  deferred_graph  the stage write captured in a CUDA graph, shipped after each replay
and two references: memcpy_d2h_pinned (cudaMemcpyAsync of the same bytes, device to pinned host: the
practical PCIe limit) and cpu_pageable (tensor.cpu(), what naive dumping does).

Per (tokens, strategy), median and min-max over --reps steps:
  ms            one step on its own, until its rows are in the store (events for direct; host clock
                through sync and drain for staging)
  pipelined_ms  per step, --reps steps back to back then one wait (3 rounds): GBps and bw_of_memcpy
                (memcpy_ms / pipelined_ms) come from it
  hold_ms       what the step holds the compute stream for: events on it, the GPU kept busy while the
                host enqueues the step (host launch time is not counted). For staging the copy stream
                is idle when the step starts, so a wait behind the previous step's copy to host (which
                a forward step longer than that copy never sees) is not counted either.
                hold_of_step: against one DeepSeek-V3 forward step at TP8 shapes, the bf16 matmuls of a
                layer (MLA projections, 8 routed + 1 shared expert, expert width split 8 ways) times
                61, attention left out, so the step is a lower bound and the fraction an upper bound
  scatter_ms    the scatter thread's time per step; wait_ms what the caller (the scheduler) waited for
                a host buffer or for the store (staging only)
  cost_ms       what the step adds to the forward that follows it on the compute stream (product strategies):
                the stand-in step's matmuls right after the step, minus the same matmuls alone (medians of
                --cost-reps, events on the compute stream): the hold plus what the copy's work on other
                streams (the copy stream's kernel or copies) takes from the forward meanwhile; cost_of_step
                against the step. Differences of two ~17-120 ms figures: a few tenths of a ms are noise.
                No finish worker runs here: waits for gathers (slot reuse, tests/gpu/test_write_order_gpu.py)
                are not in any figure
  device_MB, pinned_MB   what the strategy allocates on the device and in pinned host memory
  rows_checked, rows_bad after the timing, one more round of steps back to back, each at its own slots
                with its own rows (a tag in every row part: the step's number), read back from the
                store: a step's rows at another step's slots, a stage overwritten before its copy, a
                replay with stale slots or a lost step each leaves bad rows, and any fails the targets
From them, `bench_gpu_copy_verdict.txt`: the targets of the GPU issue at 8192 tokens (>= 80% of the
pinned-copy bandwidth, compute-stream hold < 2% of the step, no row lost or misplaced) for each
strategy, and the CUDA default for --hs-copy they point to.

    python benchmarks/bench_gpu_copy.py --out DIR    # DIR/bench_gpu_copy.csv (row by row), .png, _verdict.txt
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

K, H, P = 3, 7168, 4
DT = torch.bfloat16
ROW_BYTES = P * H * 2
TOKENS = (512, 2048, 8192)
STRATEGIES = ("direct", "staging", "deferred")  # the choices of --hs-copy (sglang_hs/envs.py)
PRODUCT = tuple(f"{c}_{v}" for c in STRATEGIES for v in ("eager", "graph"))
TARGET_BW, TARGET_HOLD = 0.80, 0.02  # of the pinned-copy bandwidth; of the forward step
ROUNDS = 3  # of back-to-back steps, for pipelined_ms
SPIN_CYCLES = 5_000_000  # ~2.5 ms of GPU clock: the host enqueues a timed step meanwhile
# One DeepSeek-V3 layer at TP8, per token: (in, out) of each bf16 matmul.
LAYER_MATMULS = [(7168, 1536), (1536, 16 * 192), (7168, 576), (512, 16 * 256), (16 * 128, 7168)] + \
    [(7168, 2 * 256), (256, 7168)] * 9
FIELDS = ["gpu", "tokens", "strategy", "ms", "ms_min", "ms_max", "pipelined_ms", "pipelined_min",
          "pipelined_max", "GBps", "bw_of_memcpy", "hold_ms", "hold_min", "hold_max", "hold_of_step",
          "hold_of_memcpy", "ms_of_step", "cost_ms", "cost_of_step", "scatter_ms", "wait_ms", "scatter_threads",
          "step_ms", "memcpy_ms", "device_MB", "pinned_MB", "rows_checked", "rows_bad"]


def spread(xs: Sequence[float]) -> Tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def event_ms(step: Callable[[int], None], reps: int, warmup: int = 3,
             between: Optional[Callable[[], None]] = None) -> List[float]:
    """Milliseconds of step(i), i = 0..reps-1, each between two events on the current stream, waited
    for before the next (after `warmup` untimed calls); `between()` runs untimed before each step."""
    stream = torch.cuda.current_stream()
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    out = []
    for i in range(reps):
        if between is not None:
            between()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SPIN_CYCLES)  # the GPU is busy while the host enqueues: `a` to `b` is GPU time
        a.record(stream)
        step(i)
        b.record(stream)
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def host_ms(step: Callable[[int], None], finish: Callable[[], None], reps: int, per_call: bool) -> List[float]:
    """Host-clock milliseconds until finish() returns: per step (each step then finish), or per round of
    `reps` steps back to back then one finish, divided by reps (ROUNDS rounds)."""
    out = []
    if per_call:
        for i in range(reps):
            t0 = time.perf_counter()
            step(i)
            finish()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for i in range(reps):
            step(i)
        finish()
        out.append((time.perf_counter() - t0) * 1e3 / reps)
    return out


def make_layer(T: int) -> Callable[[int], None]:
    """One stand-in DeepSeek-V3 layer of T tokens (LAYER_MATMULS) on the current stream."""
    xs = {i: torch.randn(T, i, device="cuda", dtype=DT) for i, _ in LAYER_MATMULS}
    ws = [torch.randn(i, o, device="cuda", dtype=DT) / i**0.5 for i, o in LAYER_MATMULS]

    def layer(_):
        for (i, _o), w in zip(LAYER_MATMULS, ws):
            xs[i] @ w

    return layer


def forward_step_ms(T: int) -> float:
    return 61 * statistics.median(event_ms(make_layer(T), 10))


def forward_cost_ms(step: Callable[[int], None], layer: Callable[[int], None], reps: int,
                    between: Optional[Callable[[], None]] = None) -> float:
    """cost_ms: the compute stream's time for step(i) then a 61-layer stand-in forward, minus the forward
    alone (medians over reps; `between()` untimed before each, as event_ms)."""
    def forward(_):
        for j in range(61):
            layer(j)

    alone = statistics.median(event_ms(forward, reps, warmup=1))
    both = statistics.median(event_ms(lambda i: (step(i), forward(i)), reps, warmup=1, between=between))
    return both - alone


def open_store(gib: float):
    """A [S, P, H] store of `gib` GiB in /dev/shm (as the server maps it) when it fits there, else in
    plain host memory; registered for the GPU. Returns (host view, device pointer, cleanup, where, register_s)."""
    from sglang_hs.server.store import pinned

    S = int(gib * 2**30) // ROW_BYTES
    nbytes = S * ROW_BYTES
    region, d = None, None
    try:
        from sglang_hs.server.store.shm import SharedRegion

        if shutil.disk_usage("/dev/shm").free < nbytes + (1 << 30):
            raise RuntimeError(f"/dev/shm has {shutil.disk_usage('/dev/shm').free / 2**30:.1f} GiB free")
        d = tempfile.mkdtemp(prefix="bench_gpu_copy-", dir="/dev/shm")  # gpu_check.sh removes leftovers
        region = SharedRegion.create(d, "store", nbytes)
        buf, where = region.buf, "/dev/shm"
    except Exception as e:  # noqa: BLE001 - no extension, or /dev/shm too small: the same bytes, unshared
        print(f"(store in plain host memory: {e})", flush=True)
        if d:
            shutil.rmtree(d, ignore_errors=True)
        d, buf, where = None, torch.empty(nbytes, dtype=torch.uint8), "host memory"
    t0 = time.perf_counter()
    ptr = pinned.register(buf)
    register_s = time.perf_counter() - t0

    def cleanup():
        pinned.unregister(buf)
        if region is not None:
            region.unlink()
            shutil.rmtree(d, ignore_errors=True)

    return buf.view(DT).view(S, P, H), ptr, cleanup, where, register_s


class Case:
    """One token count: the store, disjoint random slot sets (one per step), and fresh rows per strategy."""

    def __init__(self, host: torch.Tensor, T: int, reps: int, device: str = "cuda"):
        self.host, self.T, self.device = host, T, device
        S = host.shape[0]
        n = max(1, min(reps, (S - 1) // T))  # slot 0 is the padding slot: never handed out
        perm = torch.randperm(S - 1, device=device)[: n * T] + 1
        self.sets = perm.view(n, T)
        self.slots = torch.empty(T, dtype=torch.int64, device=device)  # the graphs' static input
        self.layer: Optional[Callable[[int], None]] = None  # the stand-in layer cost_ms runs (main sets it)
        self.cost_reps = 0

    def new_rows(self):
        """Fresh aux/last (so that rows left by another strategy never pass the check), and the rows due."""
        aux = torch.randn(self.T, K * H, device=self.device, dtype=DT)
        last = torch.randn(self.T, H, device=self.device, dtype=DT)
        return aux, last, torch.cat([aux.view(self.T, K, H), last[:, None]], 1).cpu()

    def set_slots(self, i: int) -> None:
        self.slots.copy_(self.sets[i % self.sets.shape[0]], non_blocking=True)

    def tagged_round(self, aux, last, want, step: Callable[[int], None], finish: Callable[[], None]) -> Tuple[int, int]:
        """(rows checked, rows not as written): one step per slot set, back to back, step j's rows tagged j
        (the first element of every row part, written into the static aux/last on the compute stream
        before the step), then every set read back: set j must hold step j's rows, bit for bit."""
        n = self.sets.shape[0]
        for j in range(n):
            aux.view(torch.int16).view(self.T, K, H)[:, :, 0].fill_(j + 1)
            last.view(torch.int16)[:, 0].fill_(j + 1)
            step(j)
        finish()
        if self.sets.is_cuda:
            torch.cuda.synchronize()
        bad, exp = 0, want.clone()
        for j in range(n):
            exp.view(torch.int16)[:, :, 0] = j + 1
            got = self.host[self.sets[j].cpu()].view(torch.int16)
            if not torch.equal(got, exp.view(torch.int16)):
                bad += int((got != exp.view(torch.int16)).flatten(1).any(1).sum())
        return n * self.T, bad


def capture(body: Callable[[], None], warm: Optional[Callable[[], None]] = None) -> torch.cuda.CUDAGraph:
    """body captured in a CUDA graph, after a warm-up (`warm`, else body) on a side stream, as SGLang's
    runner does."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (warm or body)()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def run_direct(case: Case, store, graph: bool, reps: int) -> dict:
    from sglang_hs.server.ops.copy_rows import copy_rows

    aux, last, want = case.new_rows()
    m0 = torch.cuda.memory_allocated()
    if graph:
        case.set_slots(0)
        g = capture(lambda: copy_rows(aux, last, case.slots, store))

        def step(i):
            case.set_slots(i)
            g.replay()
    else:
        def step(i):
            case.set_slots(i)
            copy_rows(aux, last, case.slots, store)
    ms = event_ms(step, reps)
    device_mb = (torch.cuda.memory_allocated() - m0) / 2**20
    pipelined = host_ms(step, torch.cuda.synchronize, reps, per_call=False)
    checked, bad = case.tagged_round(aux, last, want, step, torch.cuda.synchronize)
    store.check()
    cost = forward_cost_ms(step, case.layer, case.cost_reps) if case.layer is not None else ""
    return dict(ms=ms, pipelined=pipelined, hold=ms, cost=cost, device_MB=device_mb, pinned_MB=0.0,
                rows_checked=checked, rows_bad=bad)


def run_staging(case: Case, graph: bool, reps: int, threads: int, store=None, cost: bool = True) -> dict:
    """--hs-copy staging, or with `store` (the registered HostStore) --hs-copy deferred; cost_ms unless not `cost`."""
    from sglang_hs.server.store.staging import StagedCopy

    aux, last, want = case.new_rows()
    T = case.T
    m0 = torch.cuda.memory_allocated()
    sc = StagedCopy(case.host, T, "cuda", scatter_threads=threads, host_store=store)
    device_mb = (torch.cuda.memory_allocated() - m0) / 2**20
    pinned_mb = sum(h.nbytes + l.nbytes for h, l in sc.host) / 2**20
    try:
        def eager():  # a step as an eager forward runs it: the write ships its own rows
            sc.before_step()
            sc.write(aux, last, case.slots)
            sc.after_step(T, graph_replayed=False)

        if graph:
            case.set_slots(0)
            # the capture's warm-up runs eagerly and ships; the captured call only stages
            g = capture(lambda: sc.write(aux, last, case.slots), warm=eager)

            def step(i):
                case.set_slots(i)
                sc.before_step()
                g.replay()
                sc.after_step(T, graph_replayed=True)
        else:
            def step(i):
                case.set_slots(i)
                eager()

        def into_store():
            torch.cuda.current_stream().synchronize()  # the step computed: drain waits for its rows
            sc.drain()

        # compute stream: kernel, slot copy, wait for the device copy (host buffers emptied before each)
        hold = event_ms(step, reps, between=into_store)
        into_store()
        alone = host_ms(step, into_store, reps, per_call=True)
        scatter0, wait0 = sc.stats["scatter_s"], sc.stats["stage_wait_s"]
        pipelined = host_ms(step, into_store, reps, per_call=False)
        steps = ROUNDS * reps
        scatter_ms = (sc.stats["scatter_s"] - scatter0) / steps * 1e3
        wait_ms = (sc.stats["stage_wait_s"] - wait0) / steps * 1e3
        checked, bad = case.tagged_round(aux, last, want, step, into_store)
        cost = forward_cost_ms(step, case.layer, case.cost_reps, between=into_store) \
            if cost and case.layer is not None else ""
        into_store()
    finally:
        sc.close()
    if store is not None:  # deferred: no scatter thread, no host buffer to wait for
        return dict(ms=alone, pipelined=pipelined, hold=hold, cost=cost, device_MB=device_mb,
                    pinned_MB=pinned_mb, rows_checked=checked, rows_bad=bad)
    return dict(ms=alone, pipelined=pipelined, hold=hold, cost=cost, scatter_ms=scatter_ms, wait_ms=wait_ms,
                scatter_threads=threads, device_MB=device_mb, pinned_MB=pinned_mb, rows_checked=checked, rows_bad=bad)


def row(gpu: str, T: int, name: str, r: dict, step_ms: float, memcpy_ms: Optional[float]) -> dict:
    ms, ms_lo, ms_hi = spread(r["ms"])
    pl, pl_lo, pl_hi = spread(r["pipelined"])
    hold, hold_lo, hold_hi = spread(r["hold"])
    memcpy_ms = memcpy_ms if memcpy_ms is not None else pl
    out = dict(gpu=gpu, tokens=T, strategy=name, ms=ms, ms_min=ms_lo, ms_max=ms_hi, pipelined_ms=pl,
               pipelined_min=pl_lo, pipelined_max=pl_hi, GBps=T * ROW_BYTES / pl / 1e6,
               bw_of_memcpy=memcpy_ms / pl, hold_ms=hold, hold_min=hold_lo, hold_max=hold_hi,
               hold_of_step=hold / step_ms, hold_of_memcpy=hold / memcpy_ms, ms_of_step=ms / step_ms,
               cost_ms=r.get("cost", ""), cost_of_step=r["cost"] / step_ms if r.get("cost", "") != "" else "",
               scatter_ms=r.get("scatter_ms", ""), wait_ms=r.get("wait_ms", ""),
               scatter_threads=r.get("scatter_threads", ""), step_ms=step_ms,
               memcpy_ms=memcpy_ms, device_MB=r.get("device_MB", ""), pinned_MB=r.get("pinned_MB", ""),
               rows_checked=r.get("rows_checked", ""), rows_bad=r.get("rows_bad", ""))
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in out.items()}


def verdict(rows: List[dict], tokens: int = 8192) -> Tuple[Optional[str], List[str]]:
    """The targets at `tokens` per product strategy, and the CUDA default for --hs-copy they point to:
    the strategy (STRATEGIES) whose eager AND graph variants meet every target, the lower compute-stream
    hold first; None when none does. Returns (default, lines to print)."""
    at = {r["strategy"]: r for r in rows if int(r["tokens"]) == tokens}
    lines = [f"targets at {tokens} tokens: >= {TARGET_BW:.0%} of the pinned-copy bandwidth, compute-stream hold "
             f"(and cost to the forward, where measured) < {TARGET_HOLD:.0%} of the forward step, no row lost or "
             "misplaced"]
    ok: Dict[str, bool] = {}
    for name in PRODUCT:
        r = at.get(name)
        if r is None:
            lines.append(f"  {name:14s} not measured")
            ok[name] = False
            continue
        bw, hold = float(r["bw_of_memcpy"]), float(r["hold_of_step"])
        bad = r["rows_bad"] == "" or int(r["rows_bad"]) != 0 or int(r["rows_checked"] or 0) == 0
        # The hold target is judged on what the step costs the forward too, where measured: a copy that leaves
        # the compute stream at once but takes its SMs from the forward meanwhile (deferred's kernel) holds it
        # all the same (issue 49's H200 run: hold 0.39% of the step, cost 7.7-12.3%)
        cost = float(r["cost_of_step"]) if r.get("cost_of_step", "") != "" else hold
        ok[name] = bw >= TARGET_BW and max(hold, cost) < TARGET_HOLD and not bad
        cost = f", cost to the forward {float(r['cost_of_step']):6.2%}" if r.get("cost_of_step", "") != "" else ""
        lines.append(f"  {name:14s} {'MEETS' if ok[name] else 'misses':6s}  bandwidth {bw:6.1%} of memcpy "
                     f"({float(r['GBps']):.1f} GB/s), hold {hold:6.2%} of a {float(r['step_ms']):.1f} ms step{cost}, "
                     f"{r['rows_bad'] if r['rows_bad'] != '' else '?'} bad of {r['rows_checked'] or 0} rows")
    passing = [c for c in STRATEGIES if ok[f"{c}_eager"] and ok[f"{c}_graph"]]
    passing.sort(key=lambda c: max(float(at[f"{c}_{v}"]["hold_of_step"]) for v in ("eager", "graph")))
    default = passing[0] if passing else None
    lines.append(f"CUDA default for --hs-copy: {default}" if default else
                 "CUDA default for --hs-copy: no strategy meets every target; keep the current default "
                 "and look at the misses above")
    eager = sorted((int(r["scatter_threads"]), float(r["bw_of_memcpy"])) for n, r in at.items()
                   if n.startswith("staging_eager") and r.get("scatter_threads", "") != "")
    if eager:
        enough = [n for n, bw in eager if bw >= TARGET_BW]
        lines.append("staging scatter threads (bandwidth of memcpy): " + ", ".join(f"{n}: {bw:.0%}" for n, bw in eager)
                     + (f"; {enough[0]} is the fewest reaching {TARGET_BW:.0%}" if enough
                        else f"; none reaches {TARGET_BW:.0%}"))
    return default, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=20, help="timed steps per strategy (default 20)")
    ap.add_argument("--store-gib", type=float, default=16.0, help="size of the store (default 16 GiB)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per step, comma-separated")
    ap.add_argument("--cost-reps", type=int, default=5,
                    help="stand-in forwards per product strategy for cost_ms (0: not measured; default 5)")
    ap.add_argument("--scatter-threads", default="1,2,8",
                    help="staging_eager also at these scatter thread counts (staging_eager_tN; staging_eager and "
                         "staging_graph run the default, SGLANG_HS_SCATTER_THREADS or 4)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_copy.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
    tokens = [int(t) for t in args.tokens.split(",")]
    sweep = [int(n) for n in args.scatter_threads.split(",") if n]
    from sglang_hs import envs

    default_threads = envs.SGLANG_HS_SCATTER_THREADS
    if min(sweep + [default_threads]) < 1:
        sys.exit("bench_gpu_copy.py: --scatter-threads and SGLANG_HS_SCATTER_THREADS must be >= 1")
    if args.reps < 1 or args.store_gib * 2**30 < (max(tokens) + 1) * ROW_BYTES:
        sys.exit(f"bench_gpu_copy.py: --reps must be >= 1 and --store-gib must hold {max(tokens) + 1} rows "
                 f"of {ROW_BYTES} bytes")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still unmaps the store (finally)
    from sglang_hs.server.ops.copy_rows import HostStore

    gpu = torch.cuda.get_device_name()
    host, ptr, cleanup, where, register_s = open_store(args.store_gib)
    store = HostStore(host, ptr)
    setup = (f"{gpu}; store {host.shape[0]} slots x {ROW_BYTES} B = {host.numel() * 2 / 2**30:.1f} GiB in {where}, "
             f"cudaHostRegister {register_s:.2f} s; {args.reps} steps per strategy, {ROUNDS} rounds back to back; "
             f"scatter threads {default_threads} (staging_eager, staging_graph); {os.cpu_count()} CPUs")
    print(setup, flush=True)
    rows: List[dict] = []
    csv_path = os.path.join(args.out, "bench_gpu_copy.csv")
    f = open(csv_path, "w", newline="")
    w = csv.DictWriter(f, fieldnames=FIELDS)
    w.writeheader()

    def emit(r: dict) -> None:
        w.writerow(r)
        f.flush()
        rows.append(r)
        extra = ""
        if r["scatter_ms"] != "":
            extra += f"; scatter {r['scatter_ms']:.3f} ms, caller waited {r['wait_ms']:.3f} ms"
        if r["rows_bad"] != "":
            extra += f"; {r['rows_bad']} bad rows of {r['rows_checked']}"
        print(f"{r['tokens']:6d} {r['strategy']:18s} {r['ms']:9.3f} ms alone ({r['ms_min']:.3f}-{r['ms_max']:.3f}), "
              f"{r['GBps']:6.1f} GB/s = {r['bw_of_memcpy']:6.1%} of memcpy back to back; holds compute "
              f"{r['hold_ms']:8.3f} ms = {r['hold_of_step']:6.2%} of a {r['step_ms']:.1f} ms step{extra}",
              flush=True)

    def one_size(T: int) -> None:
        step_ms = forward_step_ms(T)
        case = Case(host, T, args.reps)
        if args.cost_reps > 0:
            case.layer, case.cost_reps = make_layer(T), args.cost_reps
        src = torch.randn(T, P, H, device="cuda", dtype=DT)
        dst = torch.empty(T, P, H, dtype=DT, pin_memory=True)
        memcpy = event_ms(lambda i: dst.copy_(src, non_blocking=True), args.reps)
        r = dict(ms=memcpy, pipelined=host_ms(lambda i: dst.copy_(src, non_blocking=True),
                                              torch.cuda.synchronize, args.reps, per_call=False), hold=memcpy)
        emit(row(gpu, T, "memcpy_d2h_pinned", r, step_ms, statistics.median(memcpy)))
        memcpy_ms = rows[-1]["memcpy_ms"]
        runs = [("direct_eager", lambda: run_direct(case, store, False, args.reps)),
                ("direct_graph", lambda: run_direct(case, store, True, args.reps)),
                ("staging_eager", lambda: run_staging(case, False, args.reps, default_threads)),
                ("staging_graph", lambda: run_staging(case, True, args.reps, default_threads)),
                ("deferred_eager", lambda: run_staging(case, False, args.reps, 1, store=store)),
                ("deferred_graph", lambda: run_staging(case, True, args.reps, 1, store=store))]
        runs += [(f"staging_eager_t{n}", lambda n=n: run_staging(case, False, args.reps, n, cost=False))
                 for n in sweep if n != default_threads]
        for name, fn in runs:
            try:
                emit(row(gpu, T, name, fn(), step_ms, memcpy_ms))
            except Exception as e:  # noqa: BLE001 - one strategy failing must not lose the others
                print(f"{T:6d} {name:18s} FAILED: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
        pageable = []
        for _ in range(3):
            t0 = time.perf_counter()
            src.cpu()
            pageable.append((time.perf_counter() - t0) * 1e3)
        emit(row(gpu, T, "cpu_pageable", dict(ms=pageable, pipelined=pageable, hold=pageable), step_ms, memcpy_ms))

    try:
        for T in tokens:
            one_size(T)  # its buffers are freed when it returns
            torch.cuda.empty_cache()
    finally:
        f.close()
        cleanup()
    _, lines = verdict(rows, max(tokens))
    with open(os.path.join(args.out, "bench_gpu_copy_verdict.txt"), "w") as v:
        v.write("\n".join([setup] + lines) + "\n")
    print("\n".join(lines), flush=True)
    plot(rows, os.path.join(args.out, "bench_gpu_copy.png"), gpu)


def plot(rows: List[dict], path: str, gpu: str) -> None:
    from benchmarks.common import _pyplot, save_figure

    plt = _pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        rs = [r for r in rows if r["strategy"] == name]
        x = [r["tokens"] for r in rs]
        gbps = [r["GBps"] for r in rs]
        # back-to-back GB/s: the bar spans the rounds' fastest and slowest
        lo = [max(0.0, g - r["tokens"] * ROW_BYTES / r["pipelined_max"] / 1e6) for g, r in zip(gbps, rs)]
        hi = [max(0.0, r["tokens"] * ROW_BYTES / r["pipelined_min"] / 1e6 - g) for g, r in zip(gbps, rs)]
        ax1.errorbar(x, gbps, yerr=[lo, hi], marker="o", capsize=3, label=name)
        hold = [100 * r["hold_of_step"] for r in rs]
        ax2.errorbar(x, hold, yerr=[[max(0.0, h - 100 * r["hold_min"] / r["step_ms"]) for h, r in zip(hold, rs)],
                                    [max(0.0, 100 * r["hold_max"] / r["step_ms"] - h) for h, r in zip(hold, rs)]],
                     marker="o", capsize=3, label=name)
    mem = [r for r in rows if r["strategy"] == "memcpy_d2h_pinned"]
    ax1.plot([r["tokens"] for r in mem], [TARGET_BW * r["GBps"] for r in mem], "k:", label=f"{TARGET_BW:.0%} of memcpy")
    ax2.axhline(100 * TARGET_HOLD, color="k", ls=":", label=f"{TARGET_HOLD:.0%} target")
    ax1.set(xscale="log", xlabel="tokens per step", ylabel="GB/s into the store, back to back",
            title=f"capture copy, {gpu}")
    ax2.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="% of a forward step (compute stream held)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    save_figure(plt, fig, path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
