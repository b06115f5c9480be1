"""The steady state that matters (issue 32, item 1): SGLang's own KV allocator and radix cache full to the
brim, at DeepSeek-V3 row size, a stream of requests whose prefixes hit and miss, the real CaptureWriter,
FinishWorker and a HiddenStateReader in another process. Per step, the scheduler thread's time in capture
code, INCLUDING any wait in allocation; the designs side by side in one run, with repetitions:

  old   the finish worker as it was until issue 32: every KV free is HELD while a gather is pending
        (available_size counts held slots as free, so eviction frees only need - available_size());
        an allocation that finds the free list short waits for the worker (give_back_oldest) and
        retries; a held free is POISONED (its store rows overwritten) when it is given back
  new   sglang_hs/server/store/finisher.py now: frees go straight to SGLang's allocator; the next write into
        a slot (CaptureWriter.copy: the CPU engine's forward copy) waits only for the gathers that
        read it; a rewrite is itself the poison. This is the CPU engine's path: its forward copy runs on
        the scheduler thread right after the previous step's hand-over (no overlap), so it waits there
  gpu-model         the CUDA path, `--hs-copy direct`, under SGLang's overlap scheduler, each CUDA call
        replaced by its host-side meaning (run_overlap): step N+1 is scheduled and launched (its bound
        from the real FreeListOrder on the real allocator: order_device_writes) before step N's results
        are processed; a device process stands in for the forward stream (it waits for the bound, the
        GPU's cuStreamWaitValue64, then writes the step's rows and runs out the forward). The scheduler
        thread's capture code is the poll, the bound and the hand-overs; the stream's wait is GPU idle
        time (`device_stall_ms`), not the scheduler's
  gpu-model-before  the same, with the slot-id copy as it was before (on the schedule stream, behind
        SGLang's write-after-read barrier): a job's gather starts only after the forward launched just
        before its result processing

Rows: the store is [slots, 4, 7168] bf16 (K = 3 aux layers + the final state, H = 7168: 57,344 bytes a
slot), `--slots` 24,576 by default (1.4 GB; DeepSeek-V3's real pool is several times larger, this machine has
24 GB shared); each write tags a row with its slot id and a write generation (its first 8 bytes, as
two int32); the reader process checks every row of every record against the (slot, generation) the
scheduler saw at finish: a row overwritten or poisoned before its gather shows as a bad row.

Workload: each step forwards ~`--step-tokens` new tokens (8,192) in requests of a prompt that either
extends one of `--docs` shared documents (a radix hit on part of it) or is all new (a miss). A step
runs as SGLang's does: its batch is scheduled and forwarded (per request: match_prefix + inc_lock_ref,
evict_to_free_tokens (SGLang's, on the allocator), alloc, the forward's copy of its new rows), then its
results are processed (per request: finish, i.e. hand-over to the worker, insert into the radix tree,
free the duplicate slots, dec_lock_ref). Warm-up steps run until the pool is full (available < one step);
measured steps follow. Each step lasts `--step-ms` (1,000 ms: the forward of an 8,192-token DeepSeek-V3
step, which the loop sleeps out between the batch's copy and its result processing; the worker and reader
run meanwhile), so both designs get the time a server gives them. The time counted per step (`capture_ms`,
wall; `capture_cpu_ms` the scheduler thread's CPU time in the same code, which preemption by other
processes on a loaded machine does not inflate): the worker's poll at the start of the step
(get_next_batch_to_run's hook, which follows the previous step's result processing at once: it hands that
step's finished requests to the worker, one queue put per step), every hand-over (submit), the old
design's free hook and its waits in allocation, the new design's whole check before each write
(`write_check_ms`: the per-slot look-up and any wait, `write_wait_ms` the waits alone: the copy here is the
CPU engine's, on the scheduler thread; on CUDA the wait is the forward stream's, on the GPU). Not counted
(the same in both): SGLang's own match/evict/alloc/insert and the copy itself (`copy_ms`).
Each timed window reads the wall clock (perf_counter: no system call) inside the thread's CPU clock
(thread_time: a system call that brings the thread's runtime up to date, so the kernel switches out a
thread whose time slice has run out right there instead of at its next tick): a preemption owed to the
code before a window is not charged to the window. Before this ordering, in a two-run benchmark whose
gpu-model p99 was 12.6 ms, the excess of every slow step sat in the first, nearly empty window after the
step's scheduling, with no CPU time in it.

    python benchmarks/bench_full_pool.py --out benchmarks/results   # bench_full_pool.csv, _summary.csv, .png
"""
from __future__ import annotations

import argparse
import collections
import gc
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, write_csv, write_summary  # noqa: E402

K, H = 3, 7168
P = K + 1
TARGETS = {"median_ms": 1.0, "p99_ms": 2.0}


class _GcPauses:
    """Seconds the scheduler (main) thread spent in Python's garbage collector, from gc.callbacks."""
    seconds = 0.0
    _t0 = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        """Once per process (main() may run more than once in one, as the unit test runs it)."""
        if cls._installed:
            return
        cls._installed = True
        main = threading.main_thread().ident

        def callback(phase, info):
            if threading.get_ident() != main:
                return
            if phase == "start":
                cls._t0 = time.perf_counter()
            else:
                cls.seconds += time.perf_counter() - cls._t0

        gc.callbacks.append(callback)


class Window:
    """One timed window of scheduler-thread code: wall (perf_counter, no system call) read inside the
    thread's CPU clock (thread_time, a system call: module docstring), and the garbage collector's pauses
    inside it, which `charge` books apart (a collection is the process's, triggered by whichever code
    allocates at the moment; it is counted, not hidden)."""

    def __enter__(self):
        self.cpu = time.thread_time()
        self.gc = _GcPauses.seconds
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.gc = _GcPauses.seconds - self.gc
        self.cpu = time.thread_time() - self.cpu
        return False

    def charge(self, t, key: str = "capture", part: Optional[str] = None) -> None:
        """Book the window into counter `t`: `key`_s and `key`_cpu_s without the GC pauses, gc_s, and the
        wall time again under `part` when given (which piece of capture code it was)."""
        t[f"{key}_s"] += self.wall - self.gc
        t[f"{key}_cpu_s"] += max(0.0, self.cpu - self.gc)
        t["gc_s"] += self.gc
        if part is not None:
            t[part] += self.wall - self.gc


# -- the old design, reproduced for comparison (sglang_hs/server/store/finisher.py before issue 32) -------------
def old_worker(writer):
    """A FinishWorker with the old hold mechanics: hold(), give_back_oldest(), held frees given back at poll."""
    from sglang_hs.server.store.finisher import FinishWorker

    class HoldingWorker(FinishWorker):
        def __init__(self, writer) -> None:
            self._held = collections.deque()
            self.held_tokens = 0
            super().__init__(writer)
            writer.finisher = None  # the old design did not order writes: the hold kept slots from reuse

        def submit(self, *args, **kwargs) -> None:
            super().submit(*args, **kwargs)
            self.flush()  # the old design handed each request over at once

        def poll(self) -> None:
            super().poll()
            done = self._done_now()
            while self._held and self._held[0][0] <= done:
                _, fn, args, n = self._held.popleft()
                fn(*args)
                self.held_tokens -= n

        def hold(self, fn, args, tokens) -> None:
            self.poll()
            if self._handed == self._done_now() and not self._held:
                fn(*args)
                return
            self._held.append((self._handed, fn, tuple(a.clone() for a in args), tokens))
            self.held_tokens += tokens

        def give_back_oldest(self) -> None:
            if self._held:
                self._wait_for(self._held[0][0])
            self.poll()

    return HoldingWorker(writer)


def install_old_hold(alloc, worker, poison, timers, tree):
    """hold_frees as it was: frees held (and poisoned at give-back), available_size counting them, alloc
    retried after waiting for the oldest held free."""
    original_free, available, original_alloc = alloc.free, alloc.available_size, alloc.alloc

    def give_back(idx):
        poison(idx)
        original_free(idx)

    def held_free(idx):
        if alloc.free_group is not None:
            return original_free(idx)
        worker.hold(give_back, (idx,), int(idx.numel()))

    def alloc_retry(n):
        out = original_alloc(n)
        while out is None and worker.held_tokens:
            timers["alloc_waits"] += 1
            timers["alloc_waits_evictable"] += tree.evictable_size() > 0
            with Window() as w:
                worker.give_back_oldest()
            w.charge(timers, "alloc_wait")
            out = original_alloc(n)
        return out

    alloc.free = held_free
    alloc.available_size = lambda: available() + worker.held_tokens
    alloc.alloc = alloc_retry


# -- the request stream and SGLang's side of a request (the same for every design) -------------------------
def request_ids(rng, docs, args) -> list:
    """A prompt that extends one of the shared documents (a radix hit on part of it), or all new (a miss)."""
    if rng.random() < args.hit_share:
        doc = docs[rng.randrange(len(docs))]
        return doc[: rng.randint(len(doc) // 2, len(doc))] + [rng.randrange(1, 129280)
                                                             for _ in range(rng.randint(64, 1024))]
    return [rng.randrange(1, 129280) for _ in range(rng.randint(256, args.max_req))]


def schedule(tree, alloc, ids, args, design):
    """SGLang's scheduling of one request: prefix match, lock, eviction, allocation of its new tokens (at
    most max_req: the rows buffer stays bounded). Returns (match, prefix length, prefix slots, ids, new slots)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(ids)))
    plen = m.device_prefix_len
    prefix = tree.path_device_indices(m.last_device_node)[:plen] if plen else torch.empty(0, dtype=torch.int64)
    tree.inc_lock_ref(m.last_device_node)
    ids = ids[: plen + args.max_req]
    need = len(ids) - plen
    alloc.evict_to_free_tokens(tree, need)
    new = alloc.alloc(need)
    if new is None:
        raise RuntimeError(f"{design}: allocation of {need} failed with {tree.evictable_size()} evictable")
    return m, plen, prefix, ids, new


def release(tree, alloc, m, plen, ids, slots):
    """SGLang's release of a finished request: insert into the radix tree, free the slots it already held
    (another request of the step inserted them first), unlock. Returns the free's Window."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    r = tree.insert(InsertParams(key=RadixKey(ids), value=slots))
    dups = slots[plen: r.prefix_len]
    with Window() as w:
        if dups.numel():
            alloc.free(dups)
    tree.dec_lock_ref(m.last_device_node)
    return w


# -- the reader process ------------------------------------------------------------------------------------
def _reader(dump_dir: str, jobs, results) -> None:
    torch.set_num_threads(1)
    from sglang_hs.reader import HiddenStateReader

    bad = rows = records = 0
    with HiddenStateReader(dump_dir) as reader:
        results.put("ready")
        while True:
            step = jobs.get()  # a step's finished requests: (rid, its rows' expected (slot, generation) tags)
            if step is None:
                break
            for rid, expected in step:
                rec = reader.take(rid, timeout=600)
                got = rec.aux_hidden_states[:, 0, :4].contiguous().view(torch.int32)[:, :2]
                exp = torch.frombuffer(bytearray(expected), dtype=torch.int32).view(-1, 2)
                bad += int((got != exp).any(dim=1).sum())
                rows += exp.shape[0]
                records += 1
    results.put((records, rows, bad))


def expected_tags(slots, gen) -> bytes:
    """What _reader expects of a record's rows: per row its slot id and the generation last written there,
    as int32 pairs."""
    return torch.stack([slots.to(torch.int32), gen[slots]], 1).numpy().tobytes()


def make_writer(dump: str, args):
    """The real CaptureWriter at DeepSeek-V3 row size; every store row tagged -1, and the generation the
    scheduler last wrote per slot."""
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    writer = CaptureWriter(dump, CaptureSpec.resolve([2, 30, 58], True, 61, H), args.slots + 1, torch.bfloat16,
                           args.ring_mib << 20)
    tags = writer.store.view(torch.int32)  # [slots, P, H/2]: [s, 0, 0] slot id, [s, 0, 1] generation
    tags[:, 0, :2] = -1
    return writer, tags, torch.full((args.slots + 1,), -1, dtype=torch.int32)


def start_reader(dump: str):
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(dump, jobs, results), daemon=True)
    reader.start()
    if results.get(timeout=300) != "ready":  # the reader has opened the ring before the first record
        raise RuntimeError("the reader process did not start")
    return reader, jobs, results


def finish_reader(reader, jobs, results, design, rep, full_at) -> dict:
    jobs.put(None)
    records, rows, bad = results.get(timeout=900)
    reader.join(timeout=60)
    return dict(design=design, rep=rep, records=records, rows=rows, bad_rows=bad, warmup_steps=full_at)


def step_row(design, rep, step, forwarded, t, tree, alloc, **own) -> dict:
    """One measured step's CSV row: what every design records, then the design's own fields."""
    return dict(design=design, rep=rep, step=step, forwarded=forwarded, rows_gathered=t["rows"],
                prefix_hit_tokens=t["hits"], capture_ms=round(t["capture_s"] * 1e3, 4),
                capture_cpu_ms=round(t["capture_cpu_s"] * 1e3, 4), gc_ms=round(t["gc_s"] * 1e3, 4),
                evictable=tree.evictable_size(), available=alloc.available_size(),
                sglang_ms=round(t["sglang_s"] * 1e3, 2), **own)


# -- one run of one design ---------------------------------------------------------------------------------
def run(design: str, rep: int, args, docs, out_rows) -> dict:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_hs.server.store.finisher import FinishWorker

    dump = tempfile.mkdtemp(prefix="hs-full-pool-", dir="/dev/shm")
    reader = None
    try:
        writer, tags, gen = make_writer(dump, args)
        alloc = TokenToKVPoolAllocator(args.slots, torch.bfloat16, "cpu", None, need_sort=False)
        tree = RadixCache.create_simulated(mock_allocator=alloc)
        timers = collections.Counter()

        def poison(idx):
            tags[idx.long(), 0, :2] = -7

        if design == "old":
            worker = old_worker(writer)
            install_old_hold(alloc, worker, poison, timers, tree)
        else:
            worker = FinishWorker(writer)
            checked = worker.wait_before_write  # CaptureWriter.copy's call: timed whole (check and wait)

            def timed_check(loc, upto=None):
                with Window() as w:
                    out = checked(loc, upto)
                w.charge(timers, "order")
                return out

            worker.wait_before_write = timed_check
        reader, jobs, results = start_reader(dump)
        rng = random.Random(1000 + rep)  # the same request stream for both designs
        aux = torch.zeros(args.max_req, K * H, dtype=torch.bfloat16)
        last = torch.zeros(args.max_req, H, dtype=torch.bfloat16)
        aux_tags = aux.view(torch.int32)
        step, measured, n_req, full_at = 0, 0, 0, None
        while measured < args.steps:
            step += 1
            full = full_at is not None and step > full_at + args.settle
            t = collections.Counter()
            step_end = time.perf_counter() + args.step_ms / 1e3
            with Window() as w:
                worker.poll()  # get_next_batch_to_run's hook
            w.charge(t)
            before = dict(timers)
            wait0 = writer.stats["write_wait_s"]
            forwarded, finishing = 0, []
            while forwarded < args.step_tokens:  # the batch: scheduled (prefix, eviction, allocation), then forwarded
                n_req += 1
                ids = request_ids(rng, docs, args)
                ts = time.perf_counter()
                wait_a = timers["alloc_wait_s"]
                m, plen, prefix, ids, new = schedule(tree, alloc, ids, args, design)
                need = new.shape[0]
                t["sglang_s"] += time.perf_counter() - ts - (timers["alloc_wait_s"] - wait_a)
                t["hits"] += plen
                # the forward: rows of the new slots, tagged (slot, generation), through the real copy
                gen[new] = step
                aux_tags[:need, 0] = new.to(torch.int32)
                aux_tags[:need, 1] = step
                tc = time.perf_counter()
                writer.copy(aux[:need], last[:need], new)
                t["copy_s"] += time.perf_counter() - tc
                forwarded += need
                finishing.append((f"{design}-{rep}-{n_req}", m, plen, ids, prefix, new))
            # the rest of the step: the forward (on a GPU; here slept out). Its results are processed after it
            # and the next step is scheduled at once (as under the overlap scheduler): the frees of one step
            # meet the allocations of the next with no forward between them
            time.sleep(max(0.0, step_end - time.perf_counter()))
            expected = []
            for rid, m, plen, ids, prefix, new in finishing:  # result processing: the step's requests finish
                slots = torch.cat([prefix.to(torch.int64), new])
                with Window() as w:
                    worker.submit(rid, ids, slots)
                w.charge(t)
                t["rows"] += len(ids)
                expected.append((rid, expected_tags(slots, gen)))
                ts = time.perf_counter()
                w = release(tree, alloc, m, plen, ids, slots)  # the old design's hold runs in its free
                t["sglang_s"] += time.perf_counter() - ts - (w.wall if design == "old" else 0.0)
                if design == "old":
                    w.charge(t)
            jobs.put(expected)  # one message per step: the queue's feeder thread wakes once
            alloc_wait = timers["alloc_wait_s"] - before.get("alloc_wait_s", 0.0)
            write_wait = writer.stats["write_wait_s"] - wait0
            order = timers["order_s"] - before.get("order_s", 0.0)
            # the old design's alloc waits sit in `sglang_s` (inside alloc): moved to capture; the new one's
            # check before each write (and any wait) sits in copy_s: moved to capture too
            t["capture_s"] += alloc_wait + order
            t["copy_s"] -= order
            t["capture_cpu_s"] += (timers["alloc_wait_cpu_s"] - before.get("alloc_wait_cpu_s", 0.0)
                                   + timers["order_cpu_s"] - before.get("order_cpu_s", 0.0))
            t["gc_s"] += timers["gc_s"] - before.get("gc_s", 0.0)
            if full_at is None and alloc.available_size() < args.step_tokens and tree.evictable_size() > 0:
                full_at = step
            if full:
                measured += 1
                out_rows.append(step_row(
                    design, rep, measured, forwarded, t, tree, alloc,
                    alloc_wait_ms=round(alloc_wait * 1e3, 4), write_wait_ms=round(write_wait * 1e3, 4),
                    write_check_ms=round(order * 1e3, 4),
                    alloc_waits=timers["alloc_waits"] - before.get("alloc_waits", 0),
                    alloc_waits_evictable=timers["alloc_waits_evictable"] - before.get("alloc_waits_evictable", 0),
                    write_waits=writer.stats["write_waits"], copy_ms=round(t["copy_s"] * 1e3, 2)))
                r = out_rows[-1]
                print(f"  {design} rep {rep} step {measured:3d}: capture {r['capture_ms']:8.3f} ms "
                      f"(alloc wait {r['alloc_wait_ms']:.2f}, write wait {r['write_wait_ms']:.2f}), "
                      f"{r['rows_gathered']} rows, {r['prefix_hit_tokens']} hit, copy {r['copy_ms']:.0f} ms",
                      flush=True)
        worker.close()
        return finish_reader(reader, jobs, results, design, rep, full_at)
    finally:
        if reader is not None and reader.is_alive():
            reader.kill()
        shutil.rmtree(dump, ignore_errors=True)


# -- the CUDA path under the overlap scheduler, modelled on the CPU --------------------------------------------
def _device_main(store_dir: str, store_name: str, store_shape, ctl_dir: str, cap: int, step_ms: float, q, done,
                 out, report_writes: bool) -> None:
    """The stand-in forward stream's process (_Device): each launched step waits until the worker's done
    counter reaches the step's bound (cuStreamWaitValue64 polls a memory word the same way), writes the
    step's rows into the store (the copy kernel inside the forward), runs out the forward, then sends
    ("done", step) on `done`; with `report_writes` (held gathers) also ("waits", bound) before a wait and
    ("wrote", step) after the copy. Sends ({step: seconds waited for gathers}, [steps that found their bound
    not reached]) on `out` at the end."""
    from sglang_hs._ext import ext
    from sglang_hs.server.store.shm import SharedRegion

    torch.set_num_threads(1)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    ctl = SharedRegion.open(ctl_dir, "device-ctl.bin")
    store = SharedRegion.open(store_dir, store_name).buf.view(torch.bfloat16).view(store_shape)
    rows = [_rows_views(SharedRegion.open(ctl_dir, f"rows-{b}.bin").buf, cap) for b in (0, 1)]
    stall, waited = {}, []
    while True:
        item = q.get()
        if item is None:
            break
        step, bound, n, b = item
        t0 = time.perf_counter()
        if ctl.load_acquire(0) < bound:  # a gather this step's slots are read by is pending
            waited.append(step)
            if report_writes:
                done.send(("waits", bound))
        while ctl.load_acquire(0) < bound:
            time.sleep(50e-6)
        stall[step] = time.perf_counter() - t0
        aux, last, loc = rows[b]
        ext().copy_rows_cpu(aux[:n], last[:n], loc[:n], store)
        if report_writes:
            done.send(("wrote", step))
        time.sleep(max(0.0, t0 + stall[step] + step_ms / 1e3 - time.perf_counter()))
        done.send(("done", step))
    out.put((stall, waited))


def _rows_views(buf, cap: int):
    """One step's rows in a shared buffer: aux [cap, K*H] and last [cap, H] bf16, loc [cap] int64."""
    a, l_ = cap * K * H * 2, cap * H * 2
    return (buf[:a].view(torch.bfloat16).view(cap, K * H), buf[a: a + l_].view(torch.bfloat16).view(cap, H),
            buf[a + l_: a + l_ + cap * 8].view(torch.int64))


class _Device:
    """Stands in for the GPU's forward stream, in its own process (_device_main): a GPU holds no lock of
    the scheduler's process and takes no CPU of its threads, and a thread standing in for it would hold
    the GIL between its calls (at nice 19 it could be preempted holding it, and the scheduler thread
    would wait for it). The worker's done counter it waits on is a shared word (on CUDA, the pinned
    `_done_dev` that order_device_writes' stream wait polls); the step's rows are shared memory too (two
    buffers: step N's are read while step N+1's are tagged). A forward's completion comes back on a pipe,
    read by one thread that wakes once per step: like a CUDA event's, it is waited for without the GIL
    (polling for it from the worker would take the GIL every few microseconds). The process runs at the
    lowest CPU priority (nice 19): a GPU takes no host CPU for its copy, and here the copy of a step's
    ~470 MB would otherwise share the two cores with the scheduler thread's result processing.
    With `report_writes` (SGLANG_HS_TEST_HOLD_GATHERS) the process also reports each step's copy and each
    bound it waits for: `written`, `waits_for` (_HeldGather waits on them)."""

    def __init__(self, worker, writer, cap: int, step_ms: float, report_writes: bool = False) -> None:
        from sglang_hs.server.store.shm import SharedRegion

        self.dir = tempfile.mkdtemp(prefix="hs-device-", dir="/dev/shm")
        self.ctl = SharedRegion.create(self.dir, "device-ctl.bin", 8)  # the worker's gathers done
        worker._done_dev = self.ctl.buf[:8].view(torch.int64)  # the worker publishes its done count there
        worker._done_dev[0] = worker._done_now()
        nbytes = cap * (K * H * 2 + H * 2 + 8)
        self.rows = [_rows_views(SharedRegion.create(self.dir, f"rows-{b}.bin", nbytes).buf, cap) for b in (0, 1)]
        ctx = mp.get_context("spawn")
        self.q, self.out = ctx.SimpleQueue(), ctx.SimpleQueue()  # no feeder thread in the scheduler's process
        recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_device_main, daemon=True,
                                args=(writer.region.dir_path, writer.region.name, tuple(writer.store.shape),
                                      self.dir, cap, step_ms, self.q, send, self.out, report_writes))
        self.proc.start()
        send.close()
        self.done = self.written = self.waits_for = 0
        self.closed, self._cv = False, threading.Condition()
        threading.Thread(target=self._completions, args=(recv,), name="device-done", daemon=True).start()

    def launch(self, step: int, bound: int, n: int) -> None:
        self.q.put((step, bound, n, step % 2))

    def _completions(self, recv) -> None:
        try:
            while True:
                kind, value = recv.recv()  # blocks without the GIL
                with self._cv:
                    setattr(self, {"done": "done", "wrote": "written", "waits": "waits_for"}[kind], value)
                    self._cv.notify_all()
        except EOFError:  # the process ended
            with self._cv:
                self._cv.notify_all()

    def wait(self, step: int) -> None:
        """Until forward `step` is done (the result sync; for gpu-model-before, also a job's slot ids)."""
        self.wait_for(lambda: self.done >= step)

    def wait_for(self, reached: Callable[[], bool], limit_s: Optional[float] = None) -> bool:
        """Until `reached()` (read under the lock the completions thread updates under) or `limit_s`
        seconds; False when the limit came first. Raises if the process died."""
        deadline = None if limit_s is None else time.monotonic() + limit_s
        with self._cv:
            while not reached():
                if not self.proc.is_alive():
                    raise RuntimeError(f"the device process died (exit code {self.proc.exitcode})")
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._cv.wait(timeout=1.0)
        return True

    def close(self):
        """Stop the process once its queued steps ran: ({step: seconds waited for gathers}, the steps that
        found their bound not reached)."""
        with self._cv:
            self.closed = True  # no forward follows: held gathers go
            self._cv.notify_all()
        self.q.put(None)
        stall, waited = self.out.get()
        self.proc.join(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)
        return stall, set(waited)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class _StepDone:
    """gpu-model-before: a job's `ready` event (a torch.cuda.Event on a GPU, whose synchronize() the worker
    calls): the slot ids land once forward `step` is done."""

    def __init__(self, device: _Device, step: int) -> None:
        self.device, self.step = device, step

    def synchronize(self) -> None:
        self.device.wait(self.step)


class _HeldGather:
    """SGLANG_HS_TEST_HOLD_GATHERS: a job's `ready` event that holds its gather until forward `next_step`
    (the first launched after the hand-over) has written its rows, or the forward stream waits for job `seq`
    (or a later one), or no forward follows: a write into a slot the gather reads, ordered or not, is issued
    before the gather, whatever the machine's load. Past SGLANG_HS_TEST_HOLD_S it fails (on the scheduler
    thread, at its next poll) instead of letting the gather go."""

    def __init__(self, device: _Device, next_step: int, seq: int, before: Optional[_StepDone]) -> None:
        self.device, self.next_step, self.seq, self.before = device, next_step, seq, before

    def synchronize(self) -> None:
        from sglang_hs import envs

        if self.before is not None:
            self.before.synchronize()
        d = self.device
        if not d.wait_for(lambda: d.written >= self.next_step or d.waits_for >= self.seq or d.closed,
                          envs.SGLANG_HS_TEST_HOLD_S):
            raise RuntimeError(f"held gather {self.seq}: forward {self.next_step} neither wrote nor waited for it "
                               f"in {envs.SGLANG_HS_TEST_HOLD_S} s (written {d.written}, waits for {d.waits_for})")


def run_overlap(design: str, rep: int, args, docs, out_rows) -> dict:
    """The CUDA path, `--hs-copy direct`, under SGLang's overlap scheduler, with every CUDA call replaced by
    its host-side meaning: each iteration polls the worker, schedules step N (SGLang's allocator watched by
    the real FreeListOrder: FinishWorker.watch_allocator), takes the step's bound (step_bound, what
    order_device_writes hands the stream), launches it on the device process, waits for step N-1's forward
    (the result sync, not capture code), and processes N-1's results (hand-overs, radix insert, frees).
    `gpu-model` hands the slot ids over at once (a side-stream copy, finisher.submit now);
    `gpu-model-before` as until this change: the slot-id copy sat on the schedule stream behind SGLang's
    write-after-read barrier, so a job's gather could start only after forward N, the one launched just
    before the result processing (its `ready` event here waits for that forward)."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_hs import envs
    from sglang_hs.server.store.finisher import FinishWorker

    hold = envs.SGLANG_HS_TEST_HOLD_GATHERS
    dump = tempfile.mkdtemp(prefix="hs-full-pool-", dir="/dev/shm")
    reader = device = None
    try:
        writer, tags, gen = make_writer(dump, args)
        alloc = TokenToKVPoolAllocator(args.slots, torch.bfloat16, "cpu", None, need_sort=False)
        tree = RadixCache.create_simulated(mock_allocator=alloc)
        worker = FinishWorker(writer)
        worker.watch_allocator(alloc)
        reader, jobs, results = start_reader(dump)
        device = _Device(worker, writer, args.step_tokens + args.max_req, args.step_ms, report_writes=hold)
        rng = random.Random(1000 + rep)  # the same request stream as the other designs
        step, measured, n_req, full_at, prev = 0, 0, 0, None, None
        while measured < args.steps:
            step += 1
            full = full_at is not None and step > full_at + args.settle
            t = collections.Counter()
            with Window() as w:
                worker.poll()  # get_next_batch_to_run's hook: hands over the requests the last iteration finished
            w.charge(t, part="poll_s")
            aux, _, loc = device.rows[step % 2]
            aux_tags = aux.view(torch.int32)
            forwarded, finishing, locs = 0, [], []
            while forwarded < args.step_tokens:  # step N's batch: scheduled, its rows tagged (slot, generation)
                n_req += 1
                ts = time.perf_counter()
                m, plen, prefix, ids, new = schedule(tree, alloc, request_ids(rng, docs, args), args, design)
                t["sglang_s"] += time.perf_counter() - ts
                need = new.shape[0]
                gen[new] = step
                aux_tags[forwarded: forwarded + need, 0] = new.to(torch.int32)
                aux_tags[forwarded: forwarded + need, 1] = step
                locs.append(new)
                forwarded += need
                finishing.append((f"{design}-{rep}-{n_req}", m, plen, ids, prefix, new))
            with Window() as w:
                bound = worker.step_bound()  # order_device_writes: the gathers this step's slots may be read by
            w.charge(t, part="bound_s")
            loc[:forwarded] = torch.cat(locs)
            device.launch(step, bound, forwarded)
            if prev is not None:  # step N-1's results: the result sync, then SGLang's result processing
                device.wait(step - 1)
                expected = []
                for rid, m, plen, ids, prefix, new in prev:
                    slots = torch.cat([prefix.to(torch.int64), new])
                    with Window() as w:
                        seq = worker.submit(rid, ids, slots)
                    w.charge(t, part="submit_s")
                    ready = _StepDone(device, step) if design == "gpu-model-before" else None  # after forward N
                    if hold:
                        ready = _HeldGather(device, step + 1, seq, ready)
                    if ready is not None:
                        worker._batch[-1].ready = ready
                    t["rows"] += len(ids)
                    t["hits"] += plen
                    expected.append((rid, expected_tags(slots, gen)))
                    ts = time.perf_counter()
                    release(tree, alloc, m, plen, ids, slots)
                    t["sglang_s"] += time.perf_counter() - ts
                jobs.put(expected)  # one message per step: the queue's feeder thread wakes once
            prev = finishing
            if full_at is None and alloc.available_size() < args.step_tokens and tree.evictable_size() > 0:
                full_at = step
            if full:
                measured += 1
                out_rows.append(step_row(
                    design, rep, measured, forwarded, t, tree, alloc, alloc_wait_ms=0.0, write_wait_ms=0.0,
                    write_check_ms=0.0, alloc_waits=0, alloc_waits_evictable=0, write_waits=0, copy_ms=0.0,
                    poll_ms=round(t["poll_s"] * 1e3, 4), bound_ms=round(t["bound_s"] * 1e3, 4),
                    submit_ms=round(t["submit_s"] * 1e3, 4), device_step=step))
                r = out_rows[-1]
                print(f"  {design} rep {rep} step {measured:3d}: capture {r['capture_ms']:8.3f} ms "
                      f"(cpu {r['capture_cpu_ms']:.3f}), {r['rows_gathered']} rows, {r['prefix_hit_tokens']} hit",
                      flush=True)
        device.wait(step)
        stall, waited = device.close()
        for r in out_rows:  # the stall of each measured step's forward is known once it ran
            if r["design"] == design and r["rep"] == rep and "device_step" in r:
                r["device_waited"] = int(r["device_step"] in waited)
                r["device_stall_ms"] = round(stall.get(r.pop("device_step"), 0.0) * 1e3, 3)
        worker.close()
        return finish_reader(reader, jobs, results, design, rep, full_at)
    finally:
        if device is not None:
            device.kill()
        if reader is not None and reader.is_alive():
            reader.kill()
        shutil.rmtree(dump, ignore_errors=True)


def stall_summary(rows) -> dict:
    """The modelled forward stream's waits for gathers (GPU idle time; the gpu-model designs only):
    `stalled_steps` those over 1 ms, `waited_steps` the steps that found a gather of their bound pending at
    all (with SGLANG_HS_TEST_HOLD_GATHERS, every step whose slots a job handed over just before it reads)."""
    st = [r["device_stall_ms"] for r in rows if "device_stall_ms" in r]
    if not st:
        return dict(stall_median_ms="", stall_p99_ms="", stall_max_ms="", stalled_steps="", waited_steps="")
    return dict(stall_median_ms=round(statistics.median(st), 3), stall_p99_ms=round(pct(st, 99), 3),
                stall_max_ms=round(max(st), 3), stalled_steps=sum(x > 1.0 for x in st),
                waited_steps=sum(r["device_waited"] for r in rows if "device_waited" in r))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--slots", type=int, default=24576, help="KV pool = store slots (57,344 bytes each: 1.4 GB)")
    ap.add_argument("--step-tokens", type=int, default=8192, help="new tokens forwarded per step")
    ap.add_argument("--steps", type=int, default=16, help="measured steps per run, once the pool is full")
    ap.add_argument("--step-ms", type=float, default=1000.0,
                    help="wall time of one step (the forward on the GPU; the loop sleeps out the rest): the "
                         "worker and reader get this long per step, as beside a real forward")
    ap.add_argument("--settle", type=int, default=3, help="unmeasured steps after the pool is full")
    ap.add_argument("--reps", type=int, default=2, help="runs of each design (alternating)")
    ap.add_argument("--docs", type=int, default=8, help="shared documents the prompts extend (radix hits)")
    ap.add_argument("--doc-len", type=int, default=1536)
    ap.add_argument("--hit-share", type=float, default=0.6, help="share of requests extending a document")
    ap.add_argument("--max-req", type=int, default=2048, help="most new tokens one request forwards")
    ap.add_argument("--ring-mib", type=int, default=768)
    ap.add_argument("--designs", default="old,new,gpu-model-before,gpu-model")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _GcPauses.install()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(7)
    docs = [[rng.randrange(1, 129280) for _ in range(args.doc_len)] for _ in range(args.docs)]
    rows, runs = [], []
    load0 = os.getloadavg()[0]  # other work on the machine shows in wall time (preemption), not in CPU time
    for rep in range(args.reps):
        for design in args.designs.split(","):
            print(f"{design}, rep {rep}", flush=True)
            runs.append((run_overlap if design.startswith("gpu-model") else run)(design, rep, args, docs, rows))
            print(f"  {runs[-1]}", flush=True)
    write_csv(os.path.join(args.out, "bench_full_pool.csv"), rows)
    summary = []
    for design in args.designs.split(","):
        steps = [r for r in rows if r["design"] == design]  # its measured steps, every run
        ms = [r["capture_ms"] for r in steps]
        mine = [r for r in runs if r["design"] == design]
        summary.append(dict(
            design=design, steps=len(ms), median_ms=round(statistics.median(ms), 3), p99_ms=round(pct(ms, 99), 3),
            max_ms=round(max(ms), 3),
            cpu_median_ms=round(statistics.median(r["capture_cpu_ms"] for r in steps), 3),
            cpu_p99_ms=round(pct([r["capture_cpu_ms"] for r in steps], 99), 3),
            load_before=load0, load_after=os.getloadavg()[0], alloc_waits=sum(r["alloc_waits"] for r in steps),
            alloc_waits_evictable=sum(r["alloc_waits_evictable"] for r in steps),
            write_waits=sum(r["write_waits"] for r in steps if r["step"] == args.steps),
            records=sum(r["records"] for r in mine), rows_checked=sum(r["rows"] for r in mine),
            bad_rows=sum(r["bad_rows"] for r in mine),
            median_rows_per_step=statistics.median(r["rows_gathered"] for r in steps),
            median_hit_tokens=statistics.median(r["prefix_hit_tokens"] for r in steps),
            gc_in_capture_ms=round(sum(r["gc_ms"] for r in steps), 3),
            gc_steps=sum(r["gc_ms"] > 0 for r in steps),
            **stall_summary(steps), machine=machine()))
    def line(s):
        ok = s["median_ms"] < TARGETS["median_ms"] and s["p99_ms"] < TARGETS["p99_ms"]
        return (f"{s['design']}: median {s['median_ms']} ms, p99 {s['p99_ms']} ms per {args.step_tokens}-token step "
                f"(target < 1 / < 2: {'met' if ok else 'NOT met'}; the thread's CPU time in it: median "
                f"{s['cpu_median_ms']}, p99 {s['cpu_p99_ms']}; load {s['load_before']:.1f} -> {s['load_after']:.1f}); alloc waits {s['alloc_waits']} "
                f"({s['alloc_waits_evictable']} with evictable tokens); bad rows {s['bad_rows']} of "
                f"{s['rows_checked']} in {s['records']} records; garbage collection inside its windows: "
                f"{s['gc_in_capture_ms']} ms in {s['gc_steps']} steps, booked apart"
                + (f"; the forward stream waited for gathers in {s['stalled_steps']} steps (median "
                   f"{s['stall_median_ms']}, max {s['stall_max_ms']} ms; found one pending in "
                   f"{s['waited_steps']})" if s["stall_median_ms"] != "" else ""))

    write_summary(args.out, "bench_full_pool", summary, "summary:", line)
    plt = _pyplot()
    if plt is not None:
        designs = args.designs.split(",")
        colors = dict(zip(designs, ("#c44", "#2a7", "#27c", "#c90", "#777")))
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
        for design in designs:
            for rep in range(args.reps):
                mine = [r for r in rows if r["design"] == design and r["rep"] == rep]
                a1.plot(range(1, len(mine) + 1), [r["capture_ms"] for r in mine], color=colors[design], alpha=0.8,
                        label=f"{design} rep {rep}")
                if any("device_stall_ms" in r for r in mine):
                    a3.plot(range(1, len(mine) + 1), [r["device_stall_ms"] + 1e-3 for r in mine],
                            color=colors[design], alpha=0.8, label=f"{design} rep {rep}")
        a1.set_yscale("log")
        a1.axhline(TARGETS["median_ms"], color="#888", ls="--", lw=0.8)
        a1.set_xlabel("step (pool full)")
        a1.set_ylabel("scheduler-thread ms in capture per step")
        a1.legend(fontsize=6)
        x = range(len(summary))
        a2.bar([i - 0.2 for i in x], [s["median_ms"] for s in summary], 0.4, label="median", color="#27a")
        a2.bar([i + 0.2 for i in x], [s["p99_ms"] for s in summary], 0.4, label="p99", color="#a72")
        a2.set_xticks(list(x), [s["design"] for s in summary], fontsize=7)
        a2.set_yscale("log")
        a2.axhline(TARGETS["p99_ms"], color="#888", ls="--", lw=0.8)
        a2.set_ylabel("scheduler-thread ms per step")
        a2.legend(fontsize=7)
        a3.set_yscale("log")
        a3.set_xlabel("step (pool full)")
        a3.set_ylabel("modelled forward stream's wait for gathers, ms (+0.001)")
        a3.legend(fontsize=6)
        fig.suptitle(f"full KV pool ({args.slots} slots, DeepSeek-V3 rows), {args.step_tokens}-token steps; "
                     f"{machine()}", fontsize=8)
        save_figure(plt, fig, os.path.join(args.out, "bench_full_pool.png"))
    return 0 if all(s["bad_rows"] == 0 for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
