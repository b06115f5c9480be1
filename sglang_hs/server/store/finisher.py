"""The finish path off the scheduler thread: a finished request's rows are gathered from the store into
the output ring by a worker thread, and the NEXT WRITE into a slot a pending gather reads waits for it.
SGLang's KV allocator, its radix cache and every scheduling decision are left exactly as they are.

    scheduler thread (result processing)            worker thread "sglang-hs-finish"
    submit(rid, token ids, slots):                  for each job, in hand-over order:
      slots -> host: a CPU clone (and the slots'      wait for the job's event (the slot ids have
        "last reader" set to this job), or on CUDA    landed), then for the staging scatter of the
        a non_blocking copy into pinned memory on     chunks shipped before the hand-over;
        a side stream after the iteration's start     gather store[slots] into the ring and publish
        mark + a blocking-sync event that the         (csrc/gather_rows_cpu.cpp: without the GIL)
        current stream waits for (no device sync
        on this thread, and no wait for the forward
        the overlap scheduler just launched)
      add the job to this step's batch; return
    release_kv_cache -> allocator frees: SGLang's     done = seq (and on CUDA into a pinned counter
      own, at once (records in parts: held until      the GPU can wait on); report (seq, rid, error)
      done, below)
    next iteration (intake, get_next_batch_to_run),
      idle, a check: poll(): flush (the batch to the
      worker: one queue put), then results ->
      admission release, stats, errors (no wait)

One hand-over per step: the requests one step finishes reach the worker together at the scheduler's
next poll, which follows result processing at once (the next iteration's intake), and before anything
that may wait on them: a write into the store (`wait_before_write`), a staging ship (`gathers_handed`),
the GPU's stream wait (`order_device_writes`), drain and close. The worker wakes once per step, not
once per request, and its gathers do not compete with the scheduler thread's own work on that step
(benchmarks/bench_full_pool.py).

Slot reuse: a slot is read by a gather after SGLang has released it (its request is finished, its KV
row freed or put in the radix tree, whose eviction frees it later), so the allocator may hand it out
and a later step may write a new row into it while the gather has not read the old one yet. Whatever
writes rows into the store first orders itself after the gathers that read the slots it writes:

    --hs-copy direct, CPU engine   the forward's copy (CaptureWriter.copy, on the scheduler thread)
                                   waits, before it writes, for the last gather that reads any slot of
                                   the step (`wait_before_write`; the per-slot last reader is a host
                                   array sized to the store, set at hand-over: with radix caching
                                   most reused slots were gathered long ago, and the write waits for
                                   nothing)
    --hs-copy staging (any device) the scatter thread, before it scatters a chunk, waits for the last
                                   gather that reads any slot of the chunk, capped at the last gather
                                   handed over when the chunk was shipped (per slot on the CPU engine;
                                   on CUDA, where the slot ids stay on the device at hand-over, for
                                   the gathers the step's slots may be read by, counted from the KV
                                   allocator's free-list order at `before_step`, as below)
    --hs-copy direct, CUDA         the copy kernel writes the store from the GPU, inside the forward
                                   (and its CUDA graph): before each step (ModelRunner.forward, outside
                                   any graph) the forward stream waits (cuStreamWaitValue64, no host
                                   sync) until the worker's pinned `done` counter reaches the gathers
                                   the step's slots may be read by (`order_device_writes`): counted
                                   from the KV allocator's free-list order (free_list_order.py: which
                                   frees the step's allocations took slots from, exact for SGLang's
                                   token and page allocators, no device read); nothing is issued
                                   while those gathers are done

Why every write that can hit a read slot is ordered: a job reads only slots its request held at its
finish; SGLang frees (or evicts) them only after that finish handed the job over, and a step writes
only slots allocated for it, so any step that can overwrite a slot of job j was scheduled, and its
rows copied or shipped, after j was handed over: "every gather handed over so far" is always enough,
and the per-slot array narrows it. Marker jobs read no slot and never count as a gather: a request
served without capture makes no write wait. No cycle: a gather waits (staging) only for chunks shipped
before its hand-over, a chunk waits only for gathers handed over before it was shipped.

Scheduling never sees any of this: no free is held or delayed, `available_size()`, eviction, the
idle leak check and every rank's decisions (with tensor parallelism only attention-TP rank 0 writes)
are SGLang's own. The scheduler thread waits only where the CPU engine's forward itself writes a slot
a gather still reads (counted: `write_wait_s`, `write_waits`), and, with staging, when both host
buffers are full (`stage_wait_s`).

The one exception, records in parts (--hs-record-part-size, `enable_parts`, attention TP 1 only): a record of
more row bytes than the bound is published a part at a time as the reader makes ring room (writer.publish_parts),
so its gather may wait for the reader; its request's KV release is then held (`submit(held=True)`, applied by
patches/hold_finished_kv.py: SGLang's own release call, made once the job is done), and so is that of every
request handed over while such a record is unfinished (the worker runs jobs in order). A held job never enters
the bound later writes wait for (`_gathered`, the free-list tags): its slots cannot be written before its gather,
so no forward step waits for the reader; SGLang sees the held slots as used and queues new requests instead.

Counters (the writer's stats dict, read by the status thread, /metrics and the log line): each key is
written by ONE thread, so `+=` never loses an update (a read from another thread may be a moment old):
  scheduler thread   finish_pending, finish_failed, dropped; write_waits / write_wait_s (the CPU engine's
                     forward copy waiting for gathers that read the slots it overwrites); staged_rows,
                     stage_wait_s (staging: waiting for a free host buffer); drain_s (drain/close waiting
                     for every gather: no serving path calls it)
  finish worker      records, rows, bytes, gather_s, markers, reader_offsets_refused; store_wait_s (staging:
                     waiting for the rows of chunks shipped before the hand-over to reach the store)
  scatter thread     scatter_s; scatter_waits / scatter_wait_s (waiting for gathers that read the slots a
                     chunk overwrites)
With SGLANG_HS_SYNC_FINISH=1 the scheduler thread does the worker's part (and there is no worker).

Errors: a record refused by the ring (ValueError: larger than the ring; TimeoutError: the ring stayed
full) is counted in `dropped` and logged, as on the synchronous path. Any other failure of the worker
(a slot count or a store check that fails) is raised on the scheduler thread at its next poll, so the
server stops (and fails its health checks) with the worker's error, as the synchronous path would.

`SGLANG_HS_SYNC_FINISH=1` keeps the synchronous path (CaptureWriter.finish on the scheduler thread).
"""
from __future__ import annotations

import array
import collections
import ctypes
import functools
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
PART_GIVE_UP_S = 60.0  # at shutdown, how long a record in parts still waits for the reader to make ring room


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
    meta: bytes = b""  # the record's metadata (ring.encode_meta)
    ticket: Any = None  # the request's admission ticket, handed back to on_done: its reservation, exactly
    shipped: int = 0  # staging: the last chunk shipped at hand-over (the gather needs none after it)
    part_rows: int = 0  # > 0: a long record, published in parts of at most this many rows (publish_parts)


class FinishWorker:
    """One writer's asynchronous finish path (module docstring). Methods other than the worker loop and
    `wait_before_write` (also the scatter thread's) run on the scheduler thread."""

    def __init__(self, writer, on_done: Optional[Callable[[str, Any], None]] = None) -> None:
        self.writer = writer
        # called with each job's rid and the ticket it was handed with, once the job is done (published or not)
        self.on_done = on_done
        self.stats = writer.stats
        for key in ("finish_pending", "finish_failed", "write_waits", "device_write_waits"):
            self.stats.setdefault(key, 0)  # the writer has them from the start (the status thread reads them)
        for key in ("drain_s", "write_wait_s", "store_wait_s"):
            self.stats.setdefault(key, 0.0)
        self._q: "queue.SimpleQueue[Optional[List[_Job]]]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._batch: List[_Job] = []  # jobs handed over since the last flush, in seq order (scheduler thread)
        self._queued = 0  # seq of the last job put on the worker's queue (flush; scheduler thread)
        self._handed = 0  # seq of the last job handed over (scheduler thread)
        self._gathered = 0  # seq of the last job handed over that reads slots (not a marker)
        self._done = 0  # seq of the last job the worker finished (under _cv)
        self._results: Deque[Tuple[int, str, Optional[BaseException], Any]] = collections.deque()  # under _cv
        self._pending: Dict[int, str] = {}  # seq -> rid, handed over and not yet polled (scheduler thread)
        self.untracked = 0  # of those, jobs handed over without an admission ticket (read by the status thread)
        # per store slot, the seq of the last job that reads it (set at hand-over when the slot ids are on the
        # host; on CUDA they are not, and every write then waits for every gather handed over before it)
        # (numpy: one np.put / np.take per request, no index tensors; an int64 read is atomic on the scatter thread)
        self._last_read = np.zeros(writer.store.shape[0], dtype=np.int64)
        self._per_slot = True
        self._done_dev: Optional[torch.Tensor] = None  # CUDA: pinned copy of _done the GPU waits on
        self._order = None  # CUDA: the KV allocator's free-list order (watch_allocator)
        self._fatal: Optional[BaseException] = None
        self._closed = False
        self._closing = 0.0  # monotonic time close() began (a record in parts then waits at most PART_GIVE_UP_S)
        # Records in parts (--hs-record-part-size; enable_parts): rows of more bytes than part_bytes leave in parts,
        # and the KV slots of the request, and of every request handed over while such a record is not yet
        # published, are held until its job is done (submit's `held`; patches/hold_finished_kv.py)
        self.part_bytes = 0
        self._row_bytes = self._part_rows = 0
        self._parted = 0  # seq of the last job in parts handed over
        self._cut_short: Optional[str] = None  # rid of a record whose parts stopped (shutdown, an error): nothing after
        # admission's part_room(nbytes, ticket) / part_room_done (capture_hooks sets them): a later part takes room
        # beyond the other requests' reservations; None (unit tests without admission): the ring's free room
        self.part_room: Optional[Callable[..., bool]] = None
        self.part_room_done: Callable[[], None] = lambda: None
        self._device = None
        from sglang_hs import envs

        self._test_delay = envs.SGLANG_HS_TEST_FINISH_DELAY  # test-only: widen the window gathers are pending
        self._test_hold, self._test_hold_s = envs.SGLANG_HS_TEST_HOLD_RID, envs.SGLANG_HS_TEST_HOLD_S  # test-only
        self._waiting_for = 0  # the highest job seq a writer has blocked on (_wait_for), under _cv
        self.watchdog_s = envs.SGLANG_HS_FINISH_WATCHDOG_S  # read here: a bad value stops start-up in one line
        self._current: Optional[Tuple[int, str]] = None  # (seq, rid) of the job the worker runs now
        self._progress_t = time.monotonic()  # when the worker last finished a job (or started)
        self._device_wait = 0  # CUDA: the highest seq a forward stream was made to wait for (order_device_writes)
        self._wait_began = 0.0  # when the device waits outstanding now began (an idle worker is not a stuck one)
        self._stuck: Optional[str] = None  # the watchdog's verdict: nothing is published after it
        self._watchdog = None  # CUDA: its thread, from the first device wait
        self.on_stuck: Callable[[str], None] = self._stop_the_server  # what the watchdog does once it trips
        self._nice = envs.SGLANG_HS_FINISH_NICE  # read here: a bad value stops start-up in one line
        self.native_id: Optional[int] = None  # the worker thread's kernel id (its nice value is per thread)
        # The scheduler's device, resolved HERE, on the constructing (scheduler) thread: a new thread's current
        # device is always 0, and a worker that set_device'd that would make a CUDA context (~0.3-0.6 GB) on
        # GPU 0 for every writer on another GPU, after SGLang sized GPU 0's KV pool (StagedCopy does the same)
        self._thread_device = (torch.device("cuda", torch.cuda.current_device())
                               if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="sglang-hs-finish", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(f"sglang-hs: the finish worker could not start: {self._start_error!r}")
        writer.finisher = self  # the writer's copy (CPU direct) and its scatter thread order writes through it
        if writer.staging is not None:
            writer.staging.finisher = self

    # --- the scheduler's side --------------------------------------------------------------------
    def enable_parts(self, part_bytes: int) -> None:
        """Publish a record of more than `part_bytes` row bytes in parts (--hs-record-part-size). The caller holds
        the KV slots of every job submit() says is held until that job is done (patches/hold_finished_kv.py)."""
        from sglang_hs.server.store.admission import part_rows_of

        assert part_bytes >= 1
        self.part_bytes = part_bytes
        store = self.writer.store
        self._row_bytes = store[0].numel() * store.element_size()
        self._part_rows = part_rows_of(part_bytes, self._row_bytes)  # as admission sizes their reservations

    def holds(self, T: int) -> bool:
        """Whether a job of T rows submitted now must have its KV slots held until it is done: a record in parts
        (its parts wait for ring room as the reader consumes, so a forward writing its slots meanwhile would
        wait for the reader), or any job behind one not done yet (the worker runs jobs in order)."""
        return bool(self.part_bytes) and T > 0 and (T * self._row_bytes > self.part_bytes
                                                   or self._parted > self._done_now())

    def submit(self, rid: str, token_ids, slots: torch.Tensor, prompt_len: Optional[int] = None,
               next_token: int = -1, ticket=None, meta: bytes = b"", held: bool = False) -> int:
        """Hand over a finished request: its token ids (a list or an int64 array.array the caller no
        longer changes, or a tensor) and its KV slots in position order (a view of req_to_token is fine:
        the slot ids are copied here, before SGLang reuses the row), its prompt length and the token after
        its last row, and its record's metadata (`meta`). A list or an array is converted on the worker
        thread. `ticket` (its admission ticket) goes back to on_done.
        On CUDA the slot ids and the rows (direct mode) must be final when submit is called: the forward
        that wrote the request's last rows has completed, as it has in SGLang's result processing (it
        synchronises the batch's copy_done before it finishes a request); the copy to the host does not
        wait for work queued on the current stream since then.

        The job reaches the worker at the next flush: every poll (each scheduler iteration: the next one
        follows this step's result processing), and before anything that waits on it (a write into the
        store, a staging ship, the GPU's stream wait, drain): one queue put and one wake-up of the worker
        per step instead of one per request.

        `held` (holds(T), asked just before): the caller holds the request's KV slots until this job is done, so
        no write into them can happen before its gather and the bound that later writes wait for (`_gathered`,
        and on CUDA the free-list tags) does not count it: a write never waits for a record in parts, which
        waits for the reader. A long record (more than part_bytes of rows) is published in parts only when held.
        Returns the job's seq."""
        T = len(token_ids)
        if slots.shape[0] != T:
            raise RuntimeError(f"sglang-hs: request {rid}: {slots.shape[0]} KV slots for {T} forwarded tokens")
        ids = token_ids.to(torch.int32).clone() if torch.is_tensor(token_ids) else token_ids
        ready = errors = None
        seq = self._handed + 1
        if slots.is_cuda:
            if self._device is None:
                self._device = slots.device
                self._done_dev = torch.zeros(1, dtype=torch.int64, pin_memory=True)
                self._done_dev[0] = self._done_now()
            self._per_slot = False  # the ids land later, on the worker's side: writes wait for every gather
            # on a side stream, not behind the forward launched just before this result processing (slot_ids.py);
            # the direct copy kernel's error counter with them (a forward running meanwhile may update its
            # fields one by one: the message, not the count, may be off)
            host, errors, ready = self.writer.slot_ids.to_host(slots, self.writer.copy_errors())
        else:
            host = slots.clone()
            if T:  # an id outside the store is clipped here, and refused by the worker's gather
                np.put(self._last_read, host.numpy(), seq, mode="clip")
        staging = self.writer.staging
        shipped = staging.shipped if staging is not None else 0
        self._handed = seq
        if T and not held:
            self._gathered = seq
        part_rows = 0
        if held and T * self._row_bytes > self.part_bytes:
            part_rows = self._part_rows
            self._parted = seq
        self._pending[seq] = rid
        self.untracked += ticket is None
        self._enqueue(_Job(seq, rid, ids, host, ready, errors, prompt_len=prompt_len, next_token=next_token,
                           ticket=ticket, shipped=shipped, meta=meta, part_rows=part_rows))
        return seq

    def done(self, seq: int) -> bool:
        """Whether job `seq` is done (published, refused or failed)."""
        return self._done_now() >= seq

    def submit_marker(self, rid: str, reason: str, ticket=None) -> None:
        """Hand over the marker record of a request served without capture (no rows, nothing to gather):
        published in order with the records, on the worker thread (the ring has one writer thread). It
        reads no slot, so no write ever waits for it."""
        self._handed += 1
        self._pending[self._handed] = rid
        self.untracked += ticket is None
        self._enqueue(_Job(self._handed, rid, None, torch.empty(0, dtype=torch.int64), skipped=reason, ticket=ticket))

    def mark_iteration(self) -> None:
        """CUDA, at the start of every scheduler iteration (ingest_requests' hook): the mark the slot-id
        copies of this iteration's hand-overs wait for (slot_ids.py, the writer's SlotIdCopy)."""
        self.writer.slot_ids.mark_iteration()

    @property
    def _side(self):
        """The stream the slot ids are copied to the host on (None before the first CUDA hand-over)."""
        return self.writer.slot_ids.side

    @property
    def _mark(self):
        return self.writer.slot_ids._mark

    def pending_rids(self) -> List[str]:
        return list(self._pending.values())

    def flush(self) -> None:
        """Hand the jobs submitted since the last flush to the worker (one queue put; never waits)."""
        if self._batch:
            batch, self._batch = self._batch, []
            self._queued = batch[-1].seq
            self._q.put(batch)

    def poll(self) -> None:
        """Hand over what was submitted (flush) and take the worker's results (never waits). Raises the
        worker's error if it failed in an unexpected way."""
        self.flush()
        with self._cv:
            results, self._results = self._results, collections.deque()
        for seq, rid, err, ticket in results:
            self._pending.pop(seq, None)
            if err is not None:  # counted before on_done releases its ticket (the status file's unaccounted)
                self.stats["dropped"] += 1
                self.stats["finish_failed"] += 1
                logger.error("sglang-hs: record of request %s NOT published: %r", rid, err)
            if self.on_done is not None:
                self.on_done(rid, ticket)
            if ticket is None:
                self.untracked -= 1  # likewise after its outcome is counted
        self.stats["finish_pending"] = len(self._pending)
        if self._fatal is not None:
            err, self._fatal = self._fatal, None
            raise RuntimeError(f"sglang-hs: the finish worker failed: {err!r}") from err

    def drain(self) -> None:
        """Wait until every job handed over is done (close, tests: no serving path calls it)."""
        t0 = time.perf_counter()
        self.flush()
        self._wait_for(self._handed)
        self.stats["drain_s"] += time.perf_counter() - t0
        self.poll()

    # --- ordering the store's writes after the gathers (module docstring) ---------------------------
    def gathers_handed(self) -> int:
        """The seq of the last gather handed over: a bound for any write issued now (staging records it
        with each chunk it ships: the scatter thread may wait for it, so it is flushed to the worker)."""
        self.flush()
        return self._gathered

    def wait_before_write(self, loc: torch.Tensor, upto: Optional[int] = None) -> float:
        """Called by the thread that writes store[loc] on the host (the CPU engine's forward copy; the
        staging scatter thread, with `upto` = gathers_handed() when its chunk was shipped, flushed then):
        return once no pending gather reads any of those slots. Returns the seconds waited (0.0 almost
        always). Only the scheduler thread calls it without `upto` (it flushes its own submits first)."""
        if upto is None:
            self.flush()
            upto = self._gathered
        if self._done_now() >= upto:
            return 0.0
        need = upto
        if self._per_slot and not loc.is_cuda:
            if loc.shape[0] == 0:
                return 0.0
            need = min(upto, int(np.take(self._last_read, loc.numpy(), mode="clip").max()))
            if self._done_now() >= need:
                return 0.0
        t0 = time.perf_counter()
        self._wait_for(need)
        return time.perf_counter() - t0

    def step_bound(self) -> int:
        """Before a step's forward (scheduler thread): the most gathers its writes into the store may have to
        wait for. With the KV allocator watched (CUDA, watch_allocator), the gathers the slots allocated
        since the last call may be read by (free_list_order.py; the call resets that count); otherwise
        every gather handed over. What was submitted is flushed: the worker has every gather counted."""
        self.flush()
        return self._gathered if self._order is None else self._order.take_bound()

    def order_device_writes(self, stream=None, upto: Optional[int] = None) -> bool:
        """CUDA: make `stream` wait (on the GPU, no host sync) until the worker has finished the gathers
        whose slots the writes queued next may overwrite, before they write the store. Direct copy: the
        current stream, before the forward (outside any graph capture), for the step's bound (`step_bound`).
        Deferred copy (staging.py): the copy stream, before a chunk's kernel, for the chunk's `upto` (the
        step's bound, taken at before_step, capped). Returns whether a wait was issued."""
        upto = self.step_bound() if upto is None else upto
        if self._done_dev is None or self._done_now() >= upto:
            return False
        if torch.cuda.is_current_stream_capturing():  # never inside a graph: replays would wait on a stale value
            raise RuntimeError("sglang-hs: order_device_writes called during CUDA-graph capture")
        stream = torch.cuda.current_stream() if stream is None else stream
        _stream_wait_value64(stream.cuda_stream, self._done_dev.data_ptr(), upto)
        self.stats["device_write_waits"] += 1
        if self._device_wait <= self._done_now():  # no wait outstanding before: the watchdog counts from now
            self._wait_began = time.monotonic()
        self._device_wait = max(self._device_wait, upto)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="sglang-hs-finish-watchdog", daemon=True)
            self._watchdog.start()
        return True

    # --- the watchdog of the device-side wait (CUDA, direct) -----------------------------------------
    def _watch(self) -> None:
        """While a stream waits on the GPU for a gather (order_device_writes: the forward stream with --hs-copy
        direct, the copy stream with deferred, which the forward then waits behind), the scheduler thread
        may be blocked behind it (SGLang's copy_done.synchronize()), so nothing on it notices a worker that
        stopped: its error is never raised, and only SGLang's own watchdog (--watchdog-timeout, 300 s, on the
        scheduler's forward count) would stop the server, without naming the cause. This thread does: when the
        worker has finished no job for `watchdog_s` (or its thread is gone) while such a wait is
        outstanding, it trips (below)."""
        period = min(1.0, self.watchdog_s / 4)
        while not self._closed and self._stuck is None:
            time.sleep(period)
            if self._device_wait <= self._done_now():
                continue
            dead = not self._thread.is_alive()
            idle = time.monotonic() - max(self._progress_t, self._wait_began)
            if dead or idle > self.watchdog_s:
                self.trip("its thread is gone" if dead else f"it finished no job for {idle:.0f}s")

    def trip(self, why: str) -> None:
        """A loud failure instead of a forward parked for good: the stuck gather named in the log, nothing
        published after it (should the worker wake, every job left is refused), and `on_stuck(message)`,
        by default SGLang's own way out of a stuck scheduler (its watchdog, sglang/srt/utils/watchdog.py):
        SIGQUIT to the server's main process, which takes every process down and the launcher with it. The
        GPU's wait is never released: the step behind it would overwrite slots the pending gathers read."""
        current = self._current
        job = f"gather {current[0]} (request {current[1]})" if current else f"gather {self._done_now() + 1}"
        msg = (f"sglang-hs: the finish worker is stuck: {why} at {job}, while a stream waits on the GPU "
               f"for gather {self._device_wait} (done {self._done_now()}); stopping the server "
               "(SGLANG_HS_FINISH_WATCHDOG_S)")
        logger.error("%s", msg)
        self._stuck = msg
        self._fatal = self._fatal or RuntimeError(msg)
        self.on_stuck(msg)

    @staticmethod
    def _stop_the_server(msg: str) -> None:
        import signal

        import psutil

        print(msg, file=sys.stderr, flush=True)
        psutil.Process().parent().send_signal(signal.SIGQUIT)

    def watch_allocator(self, allocator) -> None:
        """CUDA: narrow each step's writes (order_device_writes' stream wait; with staging, what the scatter of
        the step's chunks waits for) to the gathers that the slots allocated since the last step may be read
        by, from the allocator's free-list order (sglang_hs/server/store/free_list_order.py), instead of every gather
        handed over."""
        from sglang_hs.server.store.free_list_order import FreeListOrder

        self._order = FreeListOrder(allocator, lambda: self._gathered)  # flushed by order_device_writes

    def _wait_for(self, seq: int) -> None:
        if self._done_now() >= seq:
            return
        if seq > self._queued:  # a caller that did not flush first would wait forever
            raise RuntimeError(f"sglang-hs: waiting for finish job {seq}, which is not handed to the worker yet "
                               f"(last handed {self._queued}): flush() first")
        with self._cv:
            self._waiting_for = max(self._waiting_for, seq)
            self._cv.notify_all()  # (a test's held gather waits for this: _hold_for_a_write)
            while self._done < seq and self._thread.is_alive():
                self._cv.wait(timeout=1.0)
            gone = self._done < seq
        if gone:  # never waits on a worker that is not there
            raise RuntimeError("sglang-hs: the finish worker stopped with records handed over and not published")

    def idle(self) -> bool:
        return not self._pending

    def wait_progress(self, timeout: float) -> None:
        """Wait at most `timeout` seconds for the worker to finish a job (the scheduler's idle turn while KV
        releases wait for records in parts: a short wait instead of a spin that takes the reader's core)."""
        with self._cv:
            done = self._done
            self._cv.wait_for(lambda: self._done != done, timeout=timeout)

    def close(self) -> None:
        """Publish what was handed over, stop the worker."""
        if self._closed:
            return
        self._closing = time.monotonic()
        try:
            self.drain()
        finally:
            self._closed = True
            self._q.put(None)
            self._thread.join(timeout=60)

    def _done_now(self) -> int:
        return self._done  # one int, written under _cv by the worker: a read is atomic

    # --- the worker thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        self.native_id = threading.get_native_id()
        _lower_priority(self.native_id, self._nice)
        try:
            if self._thread_device is not None:
                from sglang_hs.server.store.staging import _prepare_scatter_thread

                _prepare_scatter_thread(self._thread_device)
        except BaseException as e:  # noqa: BLE001 - raised by the constructor
            self._start_error = e
            return
        finally:
            self._started.set()
        while True:
            jobs = self._q.get()
            if jobs is None:
                return
            for job in jobs:
                self._run(job)

    def _enqueue(self, job: _Job) -> None:
        if self._closed:  # a finish after close() (it runs at exit): published here, nothing left pending
            self._queued = job.seq
            self._run(job)
            self.poll()
        else:
            self._batch.append(job)

    def _run(self, job: _Job) -> None:
        err = None
        self._current = (job.seq, job.rid)
        try:
            if self._stuck is not None:  # the watchdog released the forward: the store may not hold this job's rows
                raise RuntimeError(self._stuck)
            if self._cut_short is not None:  # a record's parts stopped: a reader would take what follows as torn
                raise TimeoutError(f"not published after record {self._cut_short!r}, whose parts were cut short")
            self._publish(job)
        except (TimeoutError, ValueError) as e:  # the ring refused the record: counted and logged
            err = e
        except BaseException as e:  # noqa: BLE001 - raised on the scheduler thread at its next poll
            err = e
            self._fatal = self._fatal or e
        with self._cv:
            self._done = job.seq
            self._current, self._progress_t = None, time.monotonic()
            if self._done_dev is not None and self._stuck is None:  # tripped: the waits stay, the server stops
                self._done_dev[0] = job.seq  # after the gather: the GPU's waits see it (pinned, mapped)
            self._results.append((job.seq, job.rid, err, job.ticket))
            self._cv.notify_all()

    def _hold_for_a_write(self, seq: int) -> None:
        """Test-only (SGLANG_HS_TEST_HOLD_RID): before gathering job `seq`, wait until a writer blocks on it (or
        on a later job: every earlier one is done), at most SGLANG_HS_TEST_HOLD_S seconds."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting_for >= seq, timeout=self._test_hold_s)

    def _publish(self, job: _Job) -> None:
        w = self.writer
        if job.skipped is not None:
            w.publish_marker(job.rid, job.skipped)
            return
        if self._test_delay:
            time.sleep(self._test_delay)
        if self._test_hold and job.rid.startswith(self._test_hold):
            self._hold_for_a_write(job.seq)
        if job.ready is not None:
            job.ready.synchronize()
        if job.slot_errors is not None:  # the direct copy kernel's counter, copied with the slots
            from sglang_hs.server.ops.copy_rows import check_slot_errors

            check_slot_errors(*job.slot_errors.tolist())
        if w.staging is not None:
            # every computed row shipped before the hand-over is in the store (later chunks may wait for us)
            self.stats["store_wait_s"] += w.staging.drain(upto=job.shipped)
        ids = job.ids
        if not len(ids):
            ids = torch.empty(0, dtype=torch.int32)
        elif isinstance(ids, array.array) and ids.typecode == "q":  # the finish hook's: int64 at memory speed
            ids = torch.frombuffer(ids, dtype=torch.int64).to(torch.int32)
        elif not torch.is_tensor(ids):  # array.array from a list: ~10x faster than torch.tensor
            ids = torch.frombuffer(array.array("i", ids), dtype=torch.int32)
        if job.part_rows:
            published = w.stats["parts"]
            try:
                room = None if self.part_room is None else functools.partial(self.part_room, ticket=job.ticket)
                w.publish_parts(job.rid, ids, job.slots, job.part_rows, prompt_len=job.prompt_len,
                                next_token=job.next_token, meta=job.meta, give_up=self._give_up_parts,
                                room=room, room_done=self.part_room_done)
            except BaseException:
                if w.stats["parts"] > published:  # some of its parts are out: nothing may follow them
                    self._cut_short = job.rid
                raise
            return
        w.publish_gathered(job.rid, ids, job.slots, prompt_len=job.prompt_len, next_token=job.next_token,
                           meta=job.meta)

    def _give_up_parts(self) -> bool:
        """A record in parts waits for ring room as long as the reader takes, except at shutdown (close)."""
        return bool(self._closing) and time.monotonic() - self._closing > PART_GIVE_UP_S


def _lower_priority(tid: int, nice: int) -> None:
    """Add `nice` (SGLANG_HS_FINISH_NICE, default 0: nothing) to thread `tid`'s nice value (Linux's nice is
    per thread; raising it needs no privilege). On a machine whose cores are all busy (the worker's
    gathers, a reader, the CPU engine's forward) the kernel then runs the scheduler thread first instead
    of preempting it mid-step, but a write that must wait for a gather waits longer: bench_full_pool on 2
    cores, nice 10 against 0, median 6.9 against 24.6 ms per step, p99 570 against 120 ms."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # never fatal: the worker runs at the scheduler's priority
        logger.warning("sglang-hs: could not lower the finish worker's priority: %s", e)


@functools.lru_cache(maxsize=None)
def _cu_stream_wait_value64():
    """libcuda's cuStreamWaitValue64 (the driver API: the runtime has no stream wait on a memory value)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuStreamWaitValue64_v2 if hasattr(lib, "cuStreamWaitValue64_v2") else lib.cuStreamWaitValue64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _stream_wait_value64(stream: int, addr: int, value: int) -> None:
    """The stream waits until the 64-bit word at `addr` (pinned host memory: with unified addressing its
    host address is its device address) is >= value. A failure is raised: never a write unordered."""
    err = _cu_stream_wait_value64()(ctypes.c_void_p(stream), addr, value, _CU_STREAM_WAIT_VALUE_GEQ)
    if err != 0:
        raise RuntimeError(f"sglang-hs: cuStreamWaitValue64 failed with CUDA error {err}: the capture cannot order "
                           "the store's writes after its gathers; use --hs-copy staging or SGLANG_HS_SYNC_FINISH=1")


def check_stream_wait() -> None:
    """Start-up check for CUDA, --hs-copy direct: one stream wait on a value already reached, synchronised.
    A driver that refuses cuStreamWaitValue64 stops start-up in one line instead of the first step after
    the first finished request."""
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    _stream_wait_value64(torch.cuda.current_stream().cuda_stream, flag.data_ptr(), 0)
    torch.cuda.current_stream().synchronize()


def check_allocator(allocator) -> Optional[str]:
    """None when the finish worker can serve this KV allocator, or why not (the caller then keeps the
    synchronous finish path). Nothing of the allocator is patched: the worker orders the store's writes
    (module docstring), and a page allocator's slots are plain KV slots like a token allocator's."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if type(allocator) in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        return None
    return f"{type(allocator).__name__} is not one of the KV allocators sglang-hs's finish worker is checked with"
