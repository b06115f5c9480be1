"""The steady state that matters (issue 32, item 1): SGLang's own KV allocator and radix cache full to the
brim, at DeepSeek-V3 row size, a stream of requests whose prefixes hit and miss, the real CaptureWriter,
FinishWorker and a HiddenStateReader in another process. Per step, the scheduler thread's time in capture
code, INCLUDING any wait in allocation; the two designs side by side in one run, with repetitions:

  old   the finish worker as it was until issue 32: every KV free is HELD while a gather is pending
        (available_size counts held slots as free, so eviction frees only need - available_size());
        an allocation that finds the free list short waits for the worker (give_back_oldest) and
        retries; a held free is POISONED (its store rows overwritten) when it is given back
  new   sglang_hs/server/store/finisher.py now: frees go straight to SGLang's allocator; the next write into
        a slot (CaptureWriter.copy: the CPU engine's forward copy) waits only for the gathers that
        read it; a rewrite is itself the poison

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

    python benchmarks/bench_full_pool.py --out benchmarks/results   # bench_full_pool.csv, _summary.csv, .png
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, write_csv, write_summary  # noqa: E402

K, H = 3, 7168
P = K + 1
TARGETS = {"median_ms": 1.0, "p99_ms": 2.0}


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
            t0, c0 = time.perf_counter(), time.thread_time()
            timers["alloc_waits"] += 1
            timers["alloc_waits_evictable"] += tree.evictable_size() > 0
            worker.give_back_oldest()
            timers["alloc_wait_s"] += time.perf_counter() - t0
            timers["alloc_wait_cpu_s"] += time.thread_time() - c0
            out = original_alloc(n)
        return out

    alloc.free = held_free
    alloc.available_size = lambda: available() + worker.held_tokens
    alloc.alloc = alloc_retry


# -- the reader process ------------------------------------------------------------------------------------
def _reader(dump_dir: str, jobs, results) -> None:
    torch.set_num_threads(1)
    from sglang_hs.reader import HiddenStateReader

    bad = rows = records = 0
    with HiddenStateReader(dump_dir) as reader:
        results.put("ready")
        while True:
            job = jobs.get()
            if job is None:
                break
            rid, expected = job
            rec = reader.take(rid, timeout=600)
            got = rec.aux_hidden_states[:, 0, :4].contiguous().view(torch.int32)[:, :2]
            exp = torch.frombuffer(bytearray(expected), dtype=torch.int32).view(-1, 2)
            bad += int((got != exp).any(dim=1).sum())
            rows += exp.shape[0]
            records += 1
    results.put((records, rows, bad))


# -- one run of one design ---------------------------------------------------------------------------------
def run(design: str, rep: int, args, docs, out_rows) -> dict:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.finisher import FinishWorker
    from sglang_hs.server.store.writer import CaptureWriter

    dump = tempfile.mkdtemp(prefix="hs-full-pool-", dir="/dev/shm")
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    reader = None
    try:
        writer = CaptureWriter(dump, CaptureSpec.resolve([2, 30, 58], True, 61, H), args.slots + 1, torch.bfloat16,
                               args.ring_mib << 20)
        tags = writer.store.view(torch.int32)  # [slots, P, H/2]: [s, 0, 0] slot id, [s, 0, 1] generation
        tags[:, 0, :2] = -1
        gen = torch.full((args.slots + 1,), -1, dtype=torch.int32)  # what the scheduler last wrote per slot
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
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return checked(loc, upto)
                finally:
                    timers["order_s"] += time.perf_counter() - t0
                    timers["order_cpu_s"] += time.thread_time() - c0

            worker.wait_before_write = timed_check
        reader = ctx.Process(target=_reader, args=(dump, jobs, results), daemon=True)
        reader.start()
        if results.get(timeout=300) != "ready":  # the reader has opened the ring before the first record
            raise RuntimeError("the reader process did not start")
        rng = random.Random(1000 + rep)  # the same request stream for both designs
        aux = torch.zeros(args.max_req, K * H, dtype=torch.bfloat16)
        last = torch.zeros(args.max_req, H, dtype=torch.bfloat16)
        aux_tags = aux.view(torch.int32)
        step, measured, n_req, full_at = 0, 0, 0, None
        while measured < args.steps:
            step += 1
            full = full_at is not None and step > full_at + args.settle
            t = collections.Counter()
            t0, c0 = time.perf_counter(), time.thread_time()
            step_end = t0 + args.step_ms / 1e3
            worker.poll()  # get_next_batch_to_run's hook
            t["capture_s"] += time.perf_counter() - t0
            t["capture_cpu_s"] += time.thread_time() - c0
            before = dict(timers)
            wait0 = writer.stats["write_wait_s"]
            forwarded, finishing = 0, []
            while forwarded < args.step_tokens:  # the batch: scheduled (prefix, eviction, allocation), then forwarded
                n_req += 1
                if rng.random() < args.hit_share:  # a prompt extending one of the shared documents
                    doc = docs[rng.randrange(len(docs))]
                    ids = doc[: rng.randint(len(doc) // 2, len(doc))] + [rng.randrange(1, 129280)
                                                                         for _ in range(rng.randint(64, 1024))]
                else:
                    ids = [rng.randrange(1, 129280) for _ in range(rng.randint(256, args.max_req))]
                ts = time.perf_counter()
                m = tree.match_prefix(MatchPrefixParams(key=RadixKey(ids)))
                plen = m.device_prefix_len
                prefix = tree.path_device_indices(m.last_device_node)[:plen] if plen else \
                    torch.empty(0, dtype=torch.int64)
                tree.inc_lock_ref(m.last_device_node)
                need = len(ids) - plen
                if need > args.max_req:  # keep the rows buffer bounded: forward at most max_req new tokens
                    ids, need = ids[: plen + args.max_req], args.max_req
                alloc.evict_to_free_tokens(tree, need)
                wait_a = timers["alloc_wait_s"]
                new = alloc.alloc(need)
                if new is None:
                    raise RuntimeError(f"{design}: allocation of {need} failed with {tree.evictable_size()} evictable")
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
            for rid, m, plen, ids, prefix, new in finishing:  # result processing: the step's requests finish
                slots = torch.cat([prefix.to(torch.int64), new])
                ts, cs = time.perf_counter(), time.thread_time()
                worker.submit(rid, ids, slots)
                t["capture_s"] += time.perf_counter() - ts
                t["capture_cpu_s"] += time.thread_time() - cs
                t["rows"] += len(ids)
                jobs.put((rid, torch.stack([slots.to(torch.int32), gen[slots]], 1).numpy().tobytes()))
                ts = time.perf_counter()
                r = tree.insert(InsertParams(key=RadixKey(ids), value=slots))
                dups = slots[plen: r.prefix_len]
                tf, cf = time.perf_counter(), time.thread_time()
                if dups.numel():
                    alloc.free(dups)  # the old design's hold runs here (capture code)
                tfree = time.perf_counter() - tf
                t["capture_cpu_s"] += time.thread_time() - cf if design == "old" else 0.0
                tree.dec_lock_ref(m.last_device_node)
                t["sglang_s"] += time.perf_counter() - ts - tfree
                t["capture_s"] += tfree if design == "old" else 0.0
            alloc_wait = timers["alloc_wait_s"] - before.get("alloc_wait_s", 0.0)
            write_wait = writer.stats["write_wait_s"] - wait0
            order = timers["order_s"] - before.get("order_s", 0.0)
            # the old design's alloc waits sit in `sglang_s` (inside alloc): moved to capture; the new one's
            # check before each write (and any wait) sits in copy_s: moved to capture too
            t["capture_s"] += alloc_wait + order
            t["copy_s"] -= order
            t["capture_cpu_s"] += (timers["alloc_wait_cpu_s"] - before.get("alloc_wait_cpu_s", 0.0)
                                   + timers["order_cpu_s"] - before.get("order_cpu_s", 0.0))
            if full_at is None and alloc.available_size() < args.step_tokens and tree.evictable_size() > 0:
                full_at = step
            if full:
                measured += 1
                out_rows.append(dict(
                    design=design, rep=rep, step=measured, forwarded=forwarded, rows_gathered=t["rows"],
                    prefix_hit_tokens=t["hits"], capture_ms=round(t["capture_s"] * 1e3, 4),
                    capture_cpu_ms=round(t["capture_cpu_s"] * 1e3, 4),
                    alloc_wait_ms=round(alloc_wait * 1e3, 4), write_wait_ms=round(write_wait * 1e3, 4),
                    write_check_ms=round(order * 1e3, 4),
                    alloc_waits=timers["alloc_waits"] - before.get("alloc_waits", 0),
                    alloc_waits_evictable=timers["alloc_waits_evictable"] - before.get("alloc_waits_evictable", 0),
                    write_waits=writer.stats["write_waits"], evictable=tree.evictable_size(),
                    available=alloc.available_size(), copy_ms=round(t["copy_s"] * 1e3, 2),
                    sglang_ms=round(t["sglang_s"] * 1e3, 2)))
                r = out_rows[-1]
                print(f"  {design} rep {rep} step {measured:3d}: capture {r['capture_ms']:8.3f} ms "
                      f"(alloc wait {r['alloc_wait_ms']:.2f}, write wait {r['write_wait_ms']:.2f}), "
                      f"{r['rows_gathered']} rows, {r['prefix_hit_tokens']} hit, copy {r['copy_ms']:.0f} ms",
                      flush=True)
        worker.close()
        jobs.put(None)
        records, rows, bad = results.get(timeout=900)
        reader.join(timeout=60)
        return dict(design=design, rep=rep, records=records, rows=rows, bad_rows=bad, warmup_steps=full_at)
    finally:
        if reader is not None and reader.is_alive():
            reader.kill()
        shutil.rmtree(dump, ignore_errors=True)


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
    ap.add_argument("--designs", default="old,new")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(7)
    docs = [[rng.randrange(1, 129280) for _ in range(args.doc_len)] for _ in range(args.docs)]
    rows, runs = [], []
    load0 = os.getloadavg()[0]  # other work on the machine shows in wall time (preemption), not in CPU time
    for rep in range(args.reps):
        for design in args.designs.split(","):
            print(f"{design}, rep {rep}", flush=True)
            runs.append(run(design, rep, args, docs, rows))
            print(f"  {runs[-1]}", flush=True)
    write_csv(os.path.join(args.out, "bench_full_pool.csv"), rows)
    summary = []
    for design in args.designs.split(","):
        ms = [r["capture_ms"] for r in rows if r["design"] == design]
        mine = [r for r in runs if r["design"] == design]
        summary.append(dict(
            design=design, steps=len(ms), median_ms=round(statistics.median(ms), 3), p99_ms=round(pct(ms, 99), 3),
            max_ms=round(max(ms), 3),
            cpu_median_ms=round(statistics.median(r["capture_cpu_ms"] for r in rows if r["design"] == design), 3),
            cpu_p99_ms=round(pct([r["capture_cpu_ms"] for r in rows if r["design"] == design], 99), 3),
            load_before=load0, load_after=os.getloadavg()[0], alloc_waits=sum(r["alloc_waits"] for r in rows if r["design"] == design),
            alloc_waits_evictable=sum(r["alloc_waits_evictable"] for r in rows if r["design"] == design),
            write_waits=sum(r["write_waits"] for r in rows if r["design"] == design and r["step"] == args.steps),
            records=sum(r["records"] for r in mine), rows_checked=sum(r["rows"] for r in mine),
            bad_rows=sum(r["bad_rows"] for r in mine),
            median_rows_per_step=statistics.median(r["rows_gathered"] for r in rows if r["design"] == design),
            median_hit_tokens=statistics.median(r["prefix_hit_tokens"] for r in rows if r["design"] == design),
            machine=machine()))
    def line(s):
        ok = s["median_ms"] < TARGETS["median_ms"] and s["p99_ms"] < TARGETS["p99_ms"]
        return (f"{s['design']}: median {s['median_ms']} ms, p99 {s['p99_ms']} ms per {args.step_tokens}-token step "
                f"(target < 1 / < 2: {'met' if ok else 'NOT met'}; the thread's CPU time in it: median "
                f"{s['cpu_median_ms']}, p99 {s['cpu_p99_ms']}; load {s['load_before']:.1f} -> {s['load_after']:.1f}); alloc waits {s['alloc_waits']} "
                f"({s['alloc_waits_evictable']} with evictable tokens); bad rows {s['bad_rows']} of "
                f"{s['rows_checked']} in {s['records']} records")

    write_summary(args.out, "bench_full_pool", summary, "summary:", line)
    plt = _pyplot()
    if plt is not None:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for design, color in zip(args.designs.split(","), ("#c44", "#2a7")):
            for rep in range(args.reps):
                ys = [r["capture_ms"] for r in rows if r["design"] == design and r["rep"] == rep]
                a1.plot(range(1, len(ys) + 1), ys, color=color, alpha=0.8, label=f"{design} rep {rep}")
        a1.set_yscale("log")
        a1.axhline(TARGETS["median_ms"], color="#888", ls="--", lw=0.8)
        a1.set_xlabel("step (pool full)")
        a1.set_ylabel("scheduler-thread ms in capture per step")
        a1.legend(fontsize=7)
        names = [s["design"] for s in summary]
        x = range(len(names))
        a2.bar([i - 0.2 for i in x], [s["median_ms"] for s in summary], 0.4, label="median", color="#27a")
        a2.bar([i + 0.2 for i in x], [s["p99_ms"] for s in summary], 0.4, label="p99", color="#a72")
        a2.set_xticks(list(x), names)
        a2.set_yscale("log")
        a2.set_ylabel("ms per step")
        a2.legend(fontsize=7)
        fig.suptitle(f"full KV pool ({args.slots} slots, DeepSeek-V3 rows), {args.step_tokens}-token steps; "
                     f"{machine()}", fontsize=8)
        save_figure(plt, fig, os.path.join(args.out, "bench_full_pool.png"))
    return 0 if all(s["bad_rows"] == 0 for s in summary if s["design"] == "new") else 1


if __name__ == "__main__":
    sys.exit(main())
