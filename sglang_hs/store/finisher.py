"""The finish path off the scheduler thread: a finished request's rows are gathered from the store into
the output ring by a worker thread, while the KV slots they come from are kept from being reused.

    scheduler thread (result processing)            worker thread "sglang-hs-finish"
    submit(rid, token ids, slots):                  for each job, in hand-over order:
      slots -> host: a CPU clone, or on CUDA a        wait for the job's event (the slot ids, and in
        non_blocking copy into pinned memory on       direct mode the step's copy into the store, have
        the current stream + a blocking-sync event    landed), then for the staging scatter;
        (no device sync on this thread)               gather store[slots] into the ring and publish
      queue the job; return                           (csrc/gather_rows_cpu.cpp: without the GIL)
    release_kv_cache -> allocator frees: HELD         report done (seq, rid, error)
    next step / next free / idle / a check:
      poll(): results -> admission release, stats,
      errors; held frees whose gathers are done are
      given back to the allocator

Slot reuse: a slot is read by a gather after SGLang has released it (its request is finished, its KV
row freed or put in the radix tree, whose eviction frees it later). While any gather is pending, EVERY
free of the KV allocator (`free` of the token allocator, `_release_page_ids` of the paged one: what
direct frees, `free_group_end`, `free_segment`/`free_page_ids` and radix-cache eviction all end in) is
held, tagged with the latest job handed over, and given back once the worker is past that job. A free
made inside a free group (result processing) is decided at the group's end, when every finish hook of
that pass has handed its request over: a request's slots can be freed before its own hook runs (beam
search frees a leader's decode slots in `commit_decode`), and tagged at the free they would go back
while that request's gather is still queued. Which
frees touch pending slots cannot be told without reading device tensors (a sync), so all are held;
frees made while nothing is pending go through at once. Held frees are given back on the scheduler
thread only (the allocator is not thread-safe): at the next free, at the start of every scheduler
iteration, and by `drain()` (wait for the worker, then give everything back).

Scheduling never sees the hold: `available_size()` counts held slots as free, so admission, eviction,
decode-capacity checks (no retraction), SGLang's idle leak check (available + evictable == total) and
its metrics come out exactly as without it, and with tensor parallelism (only attention-TP rank 0
writes, and holds) every rank still makes the same decisions. Only the free list lacks them: an
allocation that finds it short (`alloc`, `alloc_extend`, `alloc_decode` returning None) waits for the
worker to pass the oldest held free, gets it back and is retried (again while short and anything is
held): the one place the scheduler thread waits for the worker, and only as long as it must.
`drain()` also runs before the idle leak check and the busy self-check (`Scheduler.on_idle`,
`self_check_during_busy`: nothing is held while SGLang audits its pool) and `allocator.clear`.

Errors: a record refused by the ring (ValueError: larger than the ring; TimeoutError: the ring stayed
full) is counted in `dropped` and logged, as on the synchronous path. Any other failure of the worker
(a slot count or a store check that fails) is raised on the scheduler thread at its next poll, so the
server stops (and fails its health checks) with the worker's error, as the synchronous path would.

`SGLANG_HS_SYNC_FINISH=1` keeps the synchronous path (CaptureWriter.finish on the scheduler thread).
"""
from __future__ import annotations

import array
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    seq: int
    rid: str
    ids: Any  # int32 [T] host tensor, or a list of ints the worker converts
    slots: torch.Tensor  # [T] host (pinned when copied from the device)
    ready: Any = None  # torch.cuda.Event: slot ids (and direct-mode rows) have landed; None on the CPU
    slot_errors: Optional[torch.Tensor] = None  # pinned copy of the direct copy kernel's error counter
    skipped: Optional[str] = None  # a marker record of a request served without capture: its reason
    prompt_len: Optional[int] = None  # where the prompt ends in ids (None: all prompt)
    next_token: int = -1  # the token after the last row (the last generated one)
    ticket: Any = None  # the request's admission ticket, handed back to on_done: its reservation, exactly


class FinishWorker:
    """One writer's asynchronous finish path (module docstring). Methods other than the worker loop run
    on the scheduler thread."""

    def __init__(self, writer, on_done: Optional[Callable[[str, Any], None]] = None) -> None:
        self.writer = writer
        # called with each job's rid and the ticket it was handed with, once the job is done (published or not)
        self.on_done = on_done
        self.stats = writer.stats
        for key in ("finish_pending", "finish_failed", "frees_held", "frees_held_now", "drain_s"):
            self.stats.setdefault(key, 0)  # the writer has them from the start (the status thread reads them)
        self._q: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._handed = 0  # seq of the last job handed over (scheduler thread)
        self._done = 0  # seq of the last job the worker finished (under _cv)
        self._results: Deque[Tuple[int, str, Optional[BaseException], Any]] = collections.deque()  # under _cv
        self._pending: Dict[int, str] = {}  # seq -> rid, handed over and not yet polled (scheduler thread)
        self._held: Deque[Tuple[int, Callable, tuple, int]] = collections.deque()  # (tag, fn, args, tokens)
        self.held_tokens = 0
        self._fatal: Optional[BaseException] = None
        self._closed = False
        self._device = None
        from sglang_hs import envs

        self._test_delay = envs.SGLANG_HS_TEST_FINISH_DELAY  # test-only: widen the window slots are held
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="sglang-hs-finish", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(f"sglang-hs: the finish worker could not start: {self._start_error!r}")

    # --- the scheduler's side --------------------------------------------------------------------
    def submit(self, rid: str, token_ids, slots: torch.Tensor, prompt_len: Optional[int] = None,
               next_token: int = -1, ticket=None) -> None:
        """Hand over a finished request: its token ids (a list the caller no longer changes, or a tensor)
        and its KV slots in position order (a view of req_to_token is fine: the slot ids are copied
        here, before SGLang reuses the row), its prompt length and the token after its last row. A list
        is converted on the worker thread. `ticket` (its admission ticket) goes back to on_done."""
        self.poll()
        T = len(token_ids)
        if slots.shape[0] != T:
            raise RuntimeError(f"sglang-hs: request {rid}: {slots.shape[0]} KV slots for {T} forwarded tokens")
        ids = token_ids.to(torch.int32).clone() if torch.is_tensor(token_ids) else token_ids
        ready = errors = None
        if slots.is_cuda:
            if self._device is None:
                self._device = slots.device
            host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
            host.copy_(slots, non_blocking=True)  # on the current stream: after every write of the row
            w = self.writer
            if w.staging is None and getattr(w, "_registered", None) is not None:
                errors = torch.empty(w._registered.errors.counts.shape, dtype=torch.int64, pin_memory=True)
                errors.copy_(w._registered.errors.counts, non_blocking=True)
            ready = torch.cuda.Event(blocking=True)  # the worker sleeps in its sync instead of spinning
            ready.record()  # after the step's copy into the store too (direct mode), as a stream sync was
        else:
            host = slots.clone()
        self._handed += 1
        self._pending[self._handed] = rid
        self.stats["finish_pending"] = len(self._pending)
        self._enqueue(_Job(self._handed, rid, ids, host, ready, errors, prompt_len=prompt_len, next_token=next_token,
                           ticket=ticket))

    def submit_marker(self, rid: str, reason: str, ticket=None) -> None:
        """Hand over the marker record of a request served without capture (no rows, nothing to gather):
        published in order with the records, on the worker thread (the ring has one writer thread)."""
        self.poll()
        self._handed += 1
        self._pending[self._handed] = rid
        self.stats["finish_pending"] = len(self._pending)
        self._enqueue(_Job(self._handed, rid, None, torch.empty(0, dtype=torch.int64), skipped=reason, ticket=ticket))

    def pending_rids(self) -> List[str]:
        return list(self._pending.values())

    def poll(self) -> None:
        """Take the worker's results and give back the frees no pending gather can read. Raises the
        worker's error if it failed in an unexpected way."""
        with self._cv:
            results, self._results = self._results, collections.deque()
            done = self._done
        for seq, rid, err, ticket in results:
            self._pending.pop(seq, None)
            if self.on_done is not None:
                self.on_done(rid, ticket)
            if err is not None:
                self.stats["dropped"] += 1
                self.stats["finish_failed"] += 1
                logger.error("sglang-hs: record of request %s NOT published: %r", rid, err)
        self.stats["finish_pending"] = len(self._pending)
        while self._held and self._held[0][0] <= done:
            _, fn, args, n = self._held[0]
            fn(*args)  # given back first: a free that raises stays held (and counted)
            self._held.popleft()
            self.held_tokens -= n
        self.stats["frees_held_now"] = self.held_tokens
        if self._fatal is not None:
            err, self._fatal = self._fatal, None
            raise RuntimeError(f"sglang-hs: the finish worker failed: {err!r}") from err

    def drain(self) -> None:
        """Wait until every job handed over is done, then give back every held free."""
        self._wait_for(self._handed)
        self.poll()

    def give_back_oldest(self) -> None:
        """Wait until the worker is past the gathers the oldest held free waits for, then give back what
        it may (an allocation that found the free list short: wait no longer than it needs)."""
        if self._held:
            self._wait_for(self._held[0][0])
        self.poll()

    def _wait_for(self, seq: int) -> None:
        if self._done_now() >= seq:
            return
        t0 = time.perf_counter()
        with self._cv:
            while self._done < seq and self._thread.is_alive():
                self._cv.wait(timeout=1.0)
            gone = self._done < seq
        self.stats["drain_s"] += time.perf_counter() - t0
        if gone:  # never waits (or spins in an allocation's retry) on a worker that is not there
            raise RuntimeError("sglang-hs: the finish worker stopped with records handed over and not published")

    def idle(self) -> bool:
        return not self._pending and not self._held

    def hold(self, fn: Callable, args: tuple, tokens: int) -> None:
        """A free of the KV allocator: done now if no gather is pending, else held (module docstring)."""
        self.poll()
        if self._handed == self._done_now() and not self._held:
            fn(*args)
            return
        # Own the indices: the caller may pass a view of a row SGLang rewrites next (as free groups copy).
        self._held.append((self._handed, fn, tuple(a.clone() if torch.is_tensor(a) else a for a in args), tokens))
        self.held_tokens += tokens
        self.stats["frees_held"] += 1
        self.stats["frees_held_now"] = self.held_tokens

    def close(self) -> None:
        """Publish what was handed over, give back held frees, stop the worker."""
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            self._q.put(None)
            self._thread.join(timeout=60)

    def _done_now(self) -> int:
        with self._cv:
            return self._done

    # --- the worker thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                from sglang_hs.store.staging import _prepare_scatter_thread

                _prepare_scatter_thread(torch.device("cuda", torch.cuda.current_device()))
        except BaseException as e:  # noqa: BLE001 - raised by the constructor
            self._start_error = e
            return
        finally:
            self._started.set()
        while True:
            job = self._q.get()
            if job is None:
                return
            self._run(job)

    def _enqueue(self, job: _Job) -> None:
        if self._closed:  # a finish after close() (it runs at exit): published here, nothing left pending
            self._run(job)
            self.poll()
        else:
            self._q.put(job)

    def _run(self, job: _Job) -> None:
        err = None
        try:
            self._publish(job)
        except (TimeoutError, ValueError) as e:  # the ring refused the record: counted and logged
            err = e
        except BaseException as e:  # noqa: BLE001 - raised on the scheduler thread at its next poll
            err = e
            self._fatal = self._fatal or e
        with self._cv:
            self._done = job.seq
            self._results.append((job.seq, job.rid, err, job.ticket))
            self._cv.notify_all()

    def _publish(self, job: _Job) -> None:
        w = self.writer
        if job.skipped is not None:
            w.publish_marker(job.rid, job.skipped)
            return
        if self._test_delay:
            time.sleep(self._test_delay)
        if job.ready is not None:
            job.ready.synchronize()
        if job.slot_errors is not None:  # the direct copy kernel's counter, copied with the slots
            n, slot, S = job.slot_errors.tolist()
            if n:
                raise RuntimeError(
                    f"sglang-hs: the capture copy dropped {n} row(s) whose KV slot lay outside the store's "
                    f"[0, {S}) (e.g. slot {slot}): the store must hold every KV-cache slot the server hands out")
        if w.staging is not None:
            w.staging.drain()  # every computed row is in the store
        ids = job.ids
        if not torch.is_tensor(ids):  # array.array from a list: ~10x faster than torch.tensor
            ids = torch.frombuffer(array.array("i", ids), dtype=torch.int32) if len(ids) else \
                torch.empty(0, dtype=torch.int32)
        w.publish_gathered(job.rid, ids, job.slots, prompt_len=job.prompt_len, next_token=job.next_token)


def hold_frees(allocator, worker: FinishWorker) -> Optional[str]:
    """Route the KV allocator's frees through `worker.hold`, and drain before what needs them (module
    docstring). Returns None when done, or why this allocator cannot be handled (the caller then keeps
    the synchronous finish path)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if getattr(allocator, "_sglang_hs_held", False):
        return None
    if type(allocator) is TokenToKVPoolAllocator:
        name, unit = "free", 1  # free_group_end and free_page_ids end here too
    elif type(allocator) is PagedTokenToKVPoolAllocator:
        name, unit = "_release_page_ids", allocator.page_size  # free, free_page_ids, free_group_end end here
    else:
        return f"{type(allocator).__name__} is not one of the KV allocators whose frees sglang-hs can hold"
    original = getattr(allocator, name)

    def held(*args):
        if name == "free" and allocator.free_group is not None:
            # Result processing frees in a group, and a request's slots may be freed before its own finish
            # hook hands it over (beam search frees the leader's decode slots in commit_decode). Held now,
            # such a free would wait only for the gathers handed over so far, not for that request's; the
            # group's end frees it all again through here, after every hand-over of the pass.
            return original(*args)
        worker.hold(original, args, unit * sum(int(a.numel()) for a in args if torch.is_tensor(a)))

    setattr(allocator, name, held)
    available = allocator.available_size

    def available_size():
        return available() + worker.held_tokens  # held slots count as free: SGLang decides as if not held

    allocator.available_size = available_size
    for alloc_name in ("alloc", "alloc_extend", "alloc_decode"):
        fn = getattr(allocator, alloc_name, None)
        if fn is not None:
            setattr(allocator, alloc_name, _retry_after_drain(fn, worker, lambda out: out is None))
    clear = allocator.clear

    def drained_clear(*a, **k):
        worker.drain()
        return clear(*a, **k)

    allocator.clear = drained_clear
    allocator._sglang_hs_held = True
    return None


def _retry_after_drain(fn, worker: FinishWorker, failed: Callable[[Any], bool]):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        while failed(out) and worker.held_tokens:
            worker.give_back_oldest()  # the slots were only held: give back the oldest, ask again
            out = fn(*args, **kwargs)
        return out

    wrapped.__wrapped__ = fn
    return wrapped
