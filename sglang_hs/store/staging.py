"""The staging strategy of the capture copy (`--hs-copy staging`): the forward writes its rows into a
fixed device buffer, a copy stream takes them to pinned host memory after the step, and a scatter
thread puts them into the store by KV slot before any finish reads them.

    in the forward (or its CUDA graph)   stage[t] = rows of t, stage_loc[t] = loc[t]      (copy kernel)
    shipped, once the rows are computed  copy stream: stage -> stage2 (device to device), event `freed`;
                                         stage2 -> pinned host buffer, event `copied`;
                                         the compute stream waits on `freed` before it writes stage again
    scattered, in step order             the scatter thread waits for `copied`, then host buffer rows ->
                                         store[loc] (C++ op, without the GIL), and frees the host buffer

Why two device buffers: the compute stream must not overwrite `stage` while it is read. Waiting for
the device-to-device copy costs the next step about a tenth of a millisecond per thousand DeepSeek-V3
rows; waiting for the PCIe copy would cost it ~50x more. Two pinned host buffers let the copy of one
step land while the thread scatters the one before. The scatter runs on its own thread so that the
scheduler loop does not spend host time proportional to the bytes captured; it waits only when it
needs rows that are not in the store yet (`drain`) or when both host buffers are still full (`_ship`),
and that waiting is counted (`stage_wait_s`).

Where shipping happens: an eager forward ships its rows itself, in chunks of `rows` when it has more
(each chunk waits on the previous one's `freed` on the GPU). A CUDA-graph replay runs no Python, so
the graph only writes `stage`, and `after_step` ships it; a graph that would not fit `stage` is
refused when it is captured. Rows reach the store in the order the steps ran, so a slot reused by a
later step is never overwritten with an older step's row.

`drain()` is what finish waits on: until every shipped chunk whose rows are computed (its `ready`
event has fired) is in the store. It does not wait for chunks still being computed: such a step is
later than every step whose results are being processed, so the request being finished needs none
of its rows.

On the CPU the same bookkeeping and thread run with synchronous copies and events that have always
fired; it is what the CPU tests exercise.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple, Optional

import torch

HOST_BUFFERS = 2


class _Fired:
    """An event of a synchronous (CPU) copy: it has always fired."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_FIRED = _Fired()


class _Shipped(NamedTuple):
    seq: int  # shipping order, from 1
    buf: int  # which pinned host buffer holds the rows
    n: int  # how many rows
    ready: object  # fired when the forward had computed the rows (compute stream)
    copied: object  # fired when the rows are in the host buffer (copy stream)


class StagedCopy:
    def __init__(self, store: torch.Tensor, rows: int, device) -> None:
        assert store.dim() == 3 and store.is_contiguous() and store.device.type == "cpu"
        assert rows > 0, "staging rows must be > 0"
        self.store, self.rows, self.device = store, rows, torch.device(device)
        self.cuda = self.device.type == "cuda"
        _, P, H = store.shape
        dt = store.dtype
        self.stage = torch.empty(rows, P, H, dtype=dt, device=self.device)
        self.stage_loc = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.ident = torch.arange(rows, dtype=torch.int32, device=self.device)
        if self.cuda:
            self.stage2 = torch.empty_like(self.stage)
            self.loc2 = torch.empty_like(self.stage_loc)
            self.copy_stream = torch.cuda.Stream(self.device)
        self.host = [(torch.empty(rows, P, H, dtype=dt, pin_memory=self.cuda),
                      torch.zeros(rows, dtype=torch.int64, pin_memory=self.cuda)) for _ in range(HOST_BUFFERS)]
        self.shipped_in_forward = False  # set by an eager forward; a graph replay leaves it False
        self.stats = {"staged_rows": 0, "scatter_s": 0.0, "stage_wait_s": 0.0}
        # Shared with the scatter thread, under _cv:
        self._cv = threading.Condition()
        self.free = deque(range(HOST_BUFFERS))
        self.pending: deque = deque()  # _Shipped not yet in the store, in step order
        self._shipped = self._scattered = 0  # seq of the last chunk shipped / in the store
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._scatter_loop, name="sglang-hs-scatter", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        """Bytes held: device (stage and its copy-out twin on CUDA) and pinned host."""
        one = self.stage.numel() * self.stage.element_size()
        return one * ((2 if self.cuda else 1) + HOST_BUFFERS)

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
            from sglang_hs.ops.copy_rows import copy_rows

            copy_rows(aux, last, self.ident[:n], self.stage)
        else:
            from sglang_hs._ext import ext

            ext().copy_rows_cpu(aux, last, self.ident[:n], self.stage)
        self.stage_loc[:n].copy_(loc)

    # --- around each step (ModelRunner.forward) ------------------------------------------------------
    def before_step(self) -> None:
        self.shipped_in_forward = False

    def after_step(self, n: int, graph_replayed: bool) -> None:
        """After a step of n real rows: ship what a graph replay left in stage."""
        if graph_replayed and not self.shipped_in_forward and n > 0:
            assert n <= self.rows, f"{n} rows of a graph replay in a {self.rows}-row staging buffer"
            self._ship(n)
        self.shipped_in_forward = False

    # --- the scheduler's side: ship, and wait for the store ------------------------------------------
    def _ship(self, n: int) -> None:
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
            compute = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(compute)
            self.copy_stream.wait_event(ready)
            with torch.cuda.stream(self.copy_stream):
                self.stage2[:n].copy_(self.stage[:n])
                self.loc2[:n].copy_(self.stage_loc[:n])
                freed = torch.cuda.Event()
                freed.record(self.copy_stream)
                host[:n].copy_(self.stage2[:n], non_blocking=True)
                host_loc[:n].copy_(self.loc2[:n], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            compute.wait_event(freed)  # the next write to stage waits for the device copy, on the GPU
        else:
            host[:n].copy_(self.stage[:n])
            host_loc[:n].copy_(self.stage_loc[:n])
            ready, copied = self._cpu_copy_events()
        with self._cv:
            self._shipped += 1
            self.pending.append(_Shipped(self._shipped, buf, n, ready, copied))
            self.stats["staged_rows"] += n
            self._cv.notify_all()

    def _cpu_copy_events(self):
        """(ready, copied) of a CPU step: its copies are synchronous. The tests hold some back."""
        return _FIRED, _FIRED

    def drain(self) -> None:
        """Return once every shipped chunk whose rows are computed is in the store (module docstring)."""
        with self._cv:
            target = self._scattered
            for s in self.pending:  # in step order: stop at the first one still being computed
                if not s.ready.query():
                    break
                target = s.seq
            if self._scattered < target:
                t0 = time.perf_counter()
                self._wait(lambda: self._scattered >= target)
                self.stats["stage_wait_s"] += time.perf_counter() - t0
            elif self._error is not None:
                self._raise()

    def _wait(self, done) -> None:
        """Wait on _cv (held) until done(); a failed scatter thread is raised here instead."""
        while not done():
            if self._error is not None:
                self._raise()
            self._cv.wait(timeout=1.0)

    def _raise(self):
        raise RuntimeError(f"sglang-hs: the staging scatter thread failed: {self._error!r}") from self._error

    def close(self) -> None:
        """Stop the scatter thread once what is shipped is in the store."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=60)

    # --- the scatter thread -----------------------------------------------------------------------
    def _scatter_loop(self) -> None:
        from sglang_hs._ext import ext

        op = ext().copy_rows_cpu
        P, H = self.store.shape[1:]
        try:
            while True:
                with self._cv:
                    while not self.pending and not self._closed:
                        self._cv.wait()
                    if not self.pending:
                        return
                    s = self.pending[0]
                s.copied.synchronize()
                t0 = time.perf_counter()
                host, host_loc = self.host[s.buf]
                op(host[: s.n].view(s.n, P * H), None, host_loc[: s.n], self.store)
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
