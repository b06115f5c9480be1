"""The staging strategy of the capture copy (`--hs-copy staging`): the forward writes its rows into a
fixed device buffer, a copy stream takes them to pinned host memory after the step, and a scatter
thread puts them into the store by KV slot before any finish reads them.

    in the forward (or its CUDA graph)   stage[t] = rows of t, stage_loc[t] = loc[t]      (copy kernel)
    shipped, once the rows are computed  copy stream: stage -> stage2 (device to device), event `freed`;
                                         stage2 -> pinned host buffer, event `copied`;
                                         the compute stream waits on `freed` before it writes stage again
    scattered, in step order             the scatter thread waits for `copied`, then host buffer rows ->
                                         store[loc] (C++ op, without the GIL, on up to `scatter_threads`
                                         threads for a large step), and frees the host buffer

Why two device buffers: the compute stream must not overwrite `stage` while it is read. Waiting for
the device-to-device copy costs the next step about a tenth of a millisecond per thousand DeepSeek-V3
rows; waiting for the PCIe copy would cost it ~50x more. Two pinned host buffers let the copy of one
step land while the thread scatters the one before. The scatter runs on its own thread so that the
scheduler loop does not spend host time proportional to the bytes captured; it waits only when it
needs rows that are not in the store yet (`drain`: the finish worker, `store_wait_s`) or when both host
buffers are still full (`_ship`: the scheduler thread, `stage_wait_s`).

Slot reuse: a chunk may write a slot whose old row a pending gather of the finish worker still reads
(SGLang freed it at the request's finish and handed it out again). Before it scatters a chunk, the
thread waits for those gathers (`finisher.wait_before_write`, capped at the last gather handed over
when the chunk was shipped: sglang_hs/server/store/finisher.py says why that bound holds and cannot cycle),
counted in `scatter_waits` / `scatter_wait_s`. On the CPU the thread looks each slot's last reader up;
on CUDA (slot ids stay on the device at hand-over) the cap is the step's bound from the KV allocator's
free-list order, taken at `before_step` (FinishWorker.step_bound, free_list_order.py), as the direct
copy's stream wait: a step whose slots no pending gather can read scatters at once.

Where shipping happens: an eager forward ships its rows itself, in chunks of `rows` when it has more
(each chunk waits on the previous one's `freed` on the GPU). A CUDA-graph replay runs no Python, so
the graph only writes `stage`, and `after_step` ships it; a graph that would not fit `stage` is
refused when it is captured. Rows reach the store in the order the steps ran, so a slot reused by a
later step is never overwritten with an older step's row.

`drain()` is what finish waits on: until every shipped chunk whose rows are computed (its `ready`
event has fired) is in the store; the finish worker passes `upto`, the last chunk shipped when the
request was handed over (its rows are in no later chunk). It does not wait for chunks still being computed: such a step is
later than every step whose results are being processed, so the request being finished needs none
of its rows.

The scatter thread and CUDA-graph capture: the thread can be waiting for a copy while SGLang captures
a graph on the scheduler thread (a capture's warm-up forward ships a chunk and wakes the thread), and
SGLang captures in CUDA's global mode, under which an event query or sync from ANY other thread in the
default mode is refused and invalidates the capture. So the thread switches itself to the thread-local
capture mode when it starts (`_prepare_scatter_thread`, which says why that is enough), and it blocks
in the `copied` event's sync (a blocking-sync event) instead of spinning a core.

On the CPU the same bookkeeping and thread run with synchronous copies and events that have always
fired; it is what the CPU tests exercise.

`--hs-copy deferred` (CUDA; a StagedCopy given `host_store`, the registered store `--hs-copy direct` writes)
keeps the stage and its shipping, and replaces the host half: after the device copy, the copy stream itself
runs the copy kernel from the twin into the mapped store by slot (PCIe writes at the direct copy's speed, no
pinned host buffers, no scatter thread), then copies the kernel's slot-error counter to pinned memory and
records `copied`. Before the kernel, the copy stream waits on the GPU for the gathers the chunk's slots may
be read by (FinishWorker.order_device_writes with the chunk's bound, as the direct copy's forward stream
does), after `freed`: the step that wrote the chunk does not wait for them. One twin on one copy stream: the
next chunk's device copy is queued behind this chunk's wait and kernel, so the compute stream, which waits
for that copy's `freed` after the next step (or, in a step shipped in chunks, before its next chunk), does
wait where a gather or the PCIe write outlasts a whole forward: a step later than the direct copy would,
and shorter by that forward. (Two twins on two streams would take that too; not done.) `drain` syncs
`copied` of the chunks it needs (no thread) and raises if the counter says a row was dropped (its slot lay
outside the store).
Issue 49's H200 figures (docs/gpu.md), 8192 DeepSeek-V3 tokens: the direct copy holds the compute stream for
the whole PCIe copy (8-9.5% of a step), staging's host scatter reaches 27-44% of PCIe; deferred holds it for
the device copy only (0.4%) at 80-83% of PCIe, but its kernel takes SMs from the forward meanwhile: the
forward after it is 7.7-12.3% slower, as after a direct copy, so direct stays the default.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections import deque
from typing import NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)
HOST_BUFFERS = 2
_CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal (Global 0, ThreadLocal 1, Relaxed 2)


class _Fired:
    """An event of a synchronous (CPU) copy: it has always fired."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_FIRED = _Fired()


@functools.lru_cache(maxsize=None)
def _cudart():
    """The CUDA runtime library torch itself loaded (ctypes), or None where there is none (CPU torch)."""
    soname = f"libcudart.so.{torch.version.cuda.split('.')[0]}" if torch.version.cuda else None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libcudart.so" in line}
    except OSError:
        paths = set()
    names = sorted(paths, key=lambda p: (os.path.basename(p) != soname, p)) + ([soname] if soname else [])
    for name in names:  # torch's major version first; a soname already loaded resolves to that library
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaThreadExchangeStreamCaptureMode
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        return lib
    return None


def _prepare_scatter_thread(device: torch.device) -> None:
    """Run first on the scatter thread: make its CUDA calls safe while the scheduler thread captures.

    SGLang's graph runners capture in CUDA's global mode (`torch.cuda.graph` for the full backend,
    BreakableCUDAGraphCapture's capture_error_mode="global" for the breakable one). During such a
    capture, a thread in the default (global) mode is prohibited from "potentially unsafe" calls, the
    event queries and syncs this thread makes included: the call fails and invalidates the capture on
    the other thread. CUDA's capture mode is per thread (cudaThreadExchangeStreamCaptureMode), and a
    thread in thread-local mode is restricted only by captures of its own ("concurrent capture sequences
    in other threads are ignored"), so this thread, which never captures, may then sync its events
    during any capture. PyTorch settled its NCCL watchdog's identical problem (event queries from the
    watchdog thread while the training thread captures) the same way: the polling thread, not the
    capturing one, goes to thread-local mode (pytorch/pytorch#104555, #105182, #148594). Thread-local
    rather than relaxed: the same for a thread that does not capture, and stricter should it ever start
    one. Forbidden in every mode is a sync of an event last recorded INSIDE a capture; this thread syncs
    only `copied`, which `_ship` records, and nothing is shipped during a capture (`write` then only
    fills the stage; the ModelRunner.forward hook that calls `after_step` does not run in capture or its
    warm-ups). This covers every CUDA call the thread makes (the event destructors it runs included) for
    whichever SGLang entry point captures, so no pause around SGLang's capture is needed.

    The device first: a new thread's CUDA calls go to device 0, where the runtime would create a context
    (~0.5 GB) for a writer on another device (meta-pytorch/torchcomms#777, the same for a watchdog)."""
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    lib = _cudart()
    if lib is None:
        raise RuntimeError("no CUDA runtime library (libcudart) is loaded in this process")
    mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
    err = lib.cudaThreadExchangeStreamCaptureMode(ctypes.pointer(mode))  # mode <- the previous one
    if err != 0:
        raise RuntimeError(f"cudaThreadExchangeStreamCaptureMode failed with CUDA error {err}")


class _Shipped(NamedTuple):
    seq: int  # shipping order, from 1
    buf: int  # which pinned host buffer holds the rows
    n: int  # how many rows
    ready: object  # fired when the forward had computed the rows (compute stream)
    copied: object  # fired when the rows are in the host buffer (copy stream)
    gathers: int  # the most the scatter waits for: the step's bound (FinishWorker.step_bound), capped at the
    # last gather handed over when shipped


def device_bytes(rows: int, P: int, H: int, elem: int) -> int:
    """Device memory a StagedCopy of `rows` rows takes on CUDA (what its constructor allocates there):
    the stage and its copy-out twin, [rows, P, H] each, their int64 slot ids, and the int32 row ids."""
    return rows * (2 * P * H * elem + 2 * 8 + 4)


class StagedCopy:
    def __init__(self, store: torch.Tensor, rows: int, device, scatter_threads: int = 1, host_store=None) -> None:
        """`host_store`: the store's registered mapping (copy_rows.HostStore) for --hs-copy deferred (CUDA):
        the copy stream writes it with the copy kernel instead of shipping to the host (module docstring)."""
        assert store.dim() == 3 and store.is_contiguous() and store.device.type == "cpu"
        assert rows > 0, "staging rows must be > 0"
        assert scatter_threads > 0, "scatter threads must be > 0"
        self.store, self.rows, self.device = store, rows, torch.device(device)
        self.scatter_threads = scatter_threads
        self.cuda = self.device.type == "cuda"
        self.host_store = host_store
        self.deferred = host_store is not None
        if self.deferred and not self.cuda:
            raise ValueError(f"sglang-hs: --hs-copy deferred needs a CUDA device, not {self.device}")
        if self.cuda and self.device.index is None:  # the scatter thread must name the device (no default there)
            self.device = torch.device("cuda", torch.cuda.current_device())
        _, P, H = store.shape
        dt = store.dtype
        self.stage = torch.empty(rows, P, H, dtype=dt, device=self.device)
        self.stage_loc = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.ident = torch.arange(rows, dtype=torch.int32, device=self.device)
        if self.cuda:
            self.stage2 = torch.empty_like(self.stage)
            self.loc2 = torch.empty_like(self.stage_loc)
            self.copy_stream = torch.cuda.Stream(self.device)
        self.host = [] if self.deferred else [
            (torch.empty(rows, P, H, dtype=dt, pin_memory=self.cuda),
             torch.zeros(rows, dtype=torch.int64, pin_memory=self.cuda)) for _ in range(HOST_BUFFERS)]
        if self.deferred:  # the kernel's slot-error counter, copied after each chunk (read by drain)
            self._errors_host = torch.zeros(3, dtype=torch.int64, pin_memory=True)
        self.shipped_in_forward = False  # set by an eager forward; a graph replay leaves it False
        self._step_bound: Optional[int] = None  # the finisher's step_bound() for the step running (before_step)
        # each key written by one thread (finisher.py): scheduler staged_rows, stage_wait_s; scatter thread
        # scatter_s, scatter_waits, scatter_wait_s; the store_wait_s of drain() is its caller's to count
        self.stats = {"staged_rows": 0, "scatter_s": 0.0, "stage_wait_s": 0.0, "scatter_waits": 0,
                      "scatter_wait_s": 0.0}
        self.finisher = None  # the FinishWorker whose gathers a scatter waits for (set when it starts)
        # Shared with the scatter thread, under _cv:
        self._cv = threading.Condition()
        self.free = deque(range(HOST_BUFFERS))
        self.pending: deque = deque()  # _Shipped not yet in the store, in step order
        self._shipped = self._scattered = 0  # seq of the last chunk shipped / in the store
        self._error: Optional[BaseException] = None
        self._closed = False
        from sglang_hs._ext import ext

        self._scatter_op = ext().copy_rows_cpu  # here, so that a missing extension stops start-up, not the thread
        self._thread = None
        if self.deferred:  # the copy stream writes the store: no scatter thread
            return
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._scatter_loop, name="sglang-hs-scatter", daemon=True)
        self._thread.start()
        self._started.wait()  # before any capture can begin: the thread is capture-safe, or failed
        if self._error is not None:
            raise RuntimeError(
                f"sglang-hs: the staging scatter thread could not be made safe during CUDA-graph capture: "
                f"{self._error}; use --hs-copy direct") from self._error

    @property
    def nbytes(self) -> int:
        """Bytes held: device (stage and its copy-out twin on CUDA) and pinned host."""
        one = self.stage.numel() * self.stage.element_size()
        return one * ((2 if self.cuda else 1) + len(self.host))

    # --- inside the forward ------------------------------------------------------------------------
    def write(self, aux: torch.Tensor, last: Optional[torch.Tensor], loc: torch.Tensor) -> None:
        """The overlay forward's copy: rows [T, K*H] (+ last [T, H]) of KV slots loc [T]."""
        T = aux.shape[0]
        if self._capturing():
            if T > self.rows:
                raise RuntimeError(
                    f"sglang-hs: a CUDA graph of {T} rows does not fit the {self.rows}-row staging buffer; "
                    "raise --hs-staging-rows or lower --cuda-graph-max-bs")
            self._to_stage(aux, last, loc)  # each replay writes stage; after_step ships it
            return
        for start in range(0, T, self.rows):
            end = min(T, start + self.rows)
            self._to_stage(aux[start:end], None if last is None else last[start:end], loc[start:end])
            self._ship(end - start)
        self.shipped_in_forward = True

    def _capturing(self) -> bool:
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def _to_stage(self, aux, last, loc) -> None:
        n = aux.shape[0]
        if self.cuda:
            from sglang_hs.server.ops.copy_rows import copy_rows

            copy_rows(aux, last, self.ident[:n], self.stage)
        else:
            from sglang_hs._ext import ext

            ext().copy_rows_cpu(aux, last, self.ident[:n], self.stage)
        self.stage_loc[:n].copy_(loc)

    # --- around each step (ModelRunner.forward) ------------------------------------------------------
    def before_step(self) -> None:
        self.shipped_in_forward = False
        # the gathers this step's slots may be read by: on CUDA, where the scatter cannot look the slots up
        # per slot, from the KV allocator's free-list order instead of every gather handed over
        self._step_bound = self.finisher.step_bound() if self.finisher is not None else None

    def after_step(self, n: int, graph_replayed: bool) -> None:
        """After a step of n real rows: ship what a graph replay left in stage."""
        if graph_replayed and not self.shipped_in_forward and n > 0:
            assert n <= self.rows, f"{n} rows of a graph replay in a {self.rows}-row staging buffer"
            self._ship(n)
        self.shipped_in_forward = False
        self._step_bound = None  # a ship outside a step (a capture's warm-up) waits for every gather

    # --- the scheduler's side: ship, and wait for the store ------------------------------------------
    def _ship(self, n: int) -> None:
        if self.deferred:
            self._ship_deferred(n)
            return
        with self._cv:
            if self._error is not None:
                self._raise()
            if not self.free:  # both host buffers still hold rows: wait for the scatter thread
                t0 = time.perf_counter()
                self._wait(lambda: self.free)
                self.stats["stage_wait_s"] += time.perf_counter() - t0
            buf = self.free.popleft()
        host, host_loc = self.host[buf]
        if self.cuda:
            def to_host():
                host[:n].copy_(self.stage2[:n], non_blocking=True)
                host_loc[:n].copy_(self.loc2[:n], non_blocking=True)

            ready, copied = self._ship_on_copy_stream(n, to_host)
        else:
            host[:n].copy_(self.stage[:n])
            host_loc[:n].copy_(self.stage_loc[:n])
            ready, copied = self._cpu_copy_events()
        self._append(buf, n, ready, copied, self._gathers())

    def _gathers(self) -> int:
        """The most gathers a chunk shipped now may have to wait for: every one handed over (flushed: the
        scatter thread may wait for any of them), capped by the step's bound."""
        gathers = 0
        if self.finisher is not None:
            gathers = self.finisher.gathers_handed()
            if self._step_bound is not None:
                gathers = min(gathers, self._step_bound)
        return gathers

    def _append(self, buf: Optional[int], n: int, ready, copied, gathers: int) -> None:
        with self._cv:
            self._shipped += 1
            self.pending.append(_Shipped(self._shipped, buf, n, ready, copied, gathers))
            self.stats["staged_rows"] += n
            self._cv.notify_all()

    def _ship_deferred(self, n: int) -> None:
        """--hs-copy deferred: the device copy, then on the same copy stream the wait for the chunk's gathers,
        the copy kernel into the mapped store and the error counter's copy (module docstring)."""
        from sglang_hs.server.ops.copy_rows import copy_rows

        with self._cv:  # the chunks already in the store (their `copied` has fired) need no drain
            while self.pending and self.pending[0].copied.query():
                self._scattered = self.pending.popleft().seq
        gathers = self._gathers()
        P, H = self.stage.shape[1:]

        def into_store():
            if self.finisher is not None and gathers:
                self.finisher.order_device_writes(stream=self.copy_stream, upto=gathers)
            copy_rows(self.stage2[:n].view(n, P * H), None, self.loc2[:n], self.host_store)
            self._errors_host.copy_(self.host_store.errors.counts, non_blocking=True)

        ready, copied = self._ship_on_copy_stream(n, into_store)
        self._append(None, n, ready, copied, gathers)

    def _ship_on_copy_stream(self, n: int, out_of_twin) -> tuple:
        """CUDA: once the compute stream has the chunk's rows (`ready`), the copy stream copies stage to its
        twin and records `freed` (the compute stream's next write into stage waits for it, on the GPU), then
        runs `out_of_twin()` (staging: the copy to a pinned host buffer; deferred: the wait for gathers and the
        kernel into the store) and records `copied`, a blocking-sync event (its waiter sleeps, not spins).
        Returns (ready, copied)."""
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self.copy_stream.wait_event(ready)
        with torch.cuda.stream(self.copy_stream):
            self.stage2[:n].copy_(self.stage[:n])
            self.loc2[:n].copy_(self.stage_loc[:n])
            freed = torch.cuda.Event()
            freed.record(self.copy_stream)
            out_of_twin()
            copied = torch.cuda.Event(blocking=True)
            copied.record(self.copy_stream)
        compute.wait_event(freed)
        return ready, copied

    def _cpu_copy_events(self):
        """(ready, copied) of a CPU step: its copies are synchronous. The tests hold some back."""
        return _FIRED, _FIRED

    @property
    def shipped(self) -> int:
        """The seq of the last chunk shipped (scheduler thread)."""
        return self._shipped

    def drain(self, upto: Optional[int] = None) -> float:
        """Return once every shipped chunk (up to seq `upto`) whose rows are computed is in the store
        (module docstring). Returns the seconds waited, for the caller's own counter."""
        waited = 0.0
        with self._cv:
            target = self._scattered
            for s in self.pending:  # in step order: stop at the first one still being computed
                if (upto is not None and s.seq > upto) or not s.ready.query():
                    break
                target = s.seq
            if self.deferred:
                need = [s for s in self.pending if s.seq <= target]
            elif self._scattered < target:
                t0 = time.perf_counter()
                self._wait(lambda: self._scattered >= target)
                waited = time.perf_counter() - t0
            elif self._error is not None:
                self._raise()
        if self.deferred:
            return self._drain_deferred(need, target)
        return waited

    def _drain_deferred(self, need, target: int) -> float:
        """Sync `copied` of the chunks drain needs (on the calling thread, no scatter thread), then check the
        kernel's error counter: a row dropped because its slot lay outside the store stops the server."""
        t0 = time.perf_counter()
        for s in need:  # in order: each `copied` fires after the one before (one copy stream)
            s.copied.synchronize()
        waited = time.perf_counter() - t0 if need else 0.0
        with self._cv:
            while self.pending and self.pending[0].seq <= target:
                self.pending.popleft()
            self._scattered = max(self._scattered, target)
        from sglang_hs.server.ops.copy_rows import check_slot_errors

        # As of the last chunk whose `copied` fired: every chunk drain needs, and those _ship_deferred pruned
        # (a cumulative count: once a row is dropped, every drain raises)
        check_slot_errors(*self._errors_host.tolist())
        return waited

    def _wait(self, done) -> None:
        """Wait on _cv (held) until done(); a failed scatter thread is raised here instead."""
        while not done():
            if self._error is not None:
                self._raise()
            if not self._thread.is_alive():  # gone without a word (it reports every error): never wait on it
                raise RuntimeError("sglang-hs: the staging scatter thread has stopped; rows shipped to it will "
                                   "not reach the store")
            self._cv.wait(timeout=1.0)

    def _raise(self):
        raise RuntimeError(f"sglang-hs: the staging scatter thread failed: {self._error!r}") from self._error

    def close(self, timeout: float = 60.0) -> None:
        """Stop the scatter thread once what is shipped is in the store (deferred: wait for the copy stream,
        which may be parked on a gather that never comes: at most `timeout` seconds, then say so)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        elif self.cuda:
            done = torch.cuda.Event()
            done.record(self.copy_stream)
            deadline = time.monotonic() + timeout
            while not done.query():
                if time.monotonic() > deadline:
                    logger.warning("sglang-hs: the deferred copy stream still waits after %.0f s at close (a gather "
                                   "that never finished?): rows shipped since may not be in the store", timeout)
                    return
                time.sleep(0.01)

    # --- the scatter thread -----------------------------------------------------------------------
    def _await_copy(self, s: _Shipped) -> None:
        """Until s's rows are in its host buffer. On CUDA a blocking-sync event: the thread sleeps."""
        s.copied.synchronize()

    def _scatter_loop(self) -> None:
        try:
            _prepare_scatter_thread(self.device)
        except BaseException as e:  # noqa: BLE001 - raised by the constructor, which waits for _started
            self._error = e
            return
        finally:
            self._started.set()
        op = self._scatter_op
        P, H = self.store.shape[1:]
        try:
            while True:
                with self._cv:
                    while not self.pending and not self._closed:
                        self._cv.wait()
                    if not self.pending:
                        return
                    s = self.pending[0]
                self._await_copy(s)
                host, host_loc = self.host[s.buf]
                finisher = self.finisher
                if finisher is not None and s.gathers:  # gathers still reading slots this chunk overwrites
                    waited = finisher.wait_before_write(host_loc[: s.n], upto=s.gathers)
                    if waited:
                        self.stats["scatter_waits"] += 1
                        self.stats["scatter_wait_s"] += waited
                t0 = time.perf_counter()
                op(host[: s.n].view(s.n, P * H), None, host_loc[: s.n], self.store, self.scatter_threads)
                with self._cv:
                    self.stats["scatter_s"] += time.perf_counter() - t0
                    self.pending.popleft()
                    self.free.append(s.buf)
                    self._scattered = s.seq
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the scheduler at its next ship or drain
            with self._cv:
                self._error = e
                self._cv.notify_all()
