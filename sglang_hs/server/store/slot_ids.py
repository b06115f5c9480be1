"""A finished request's KV slot ids (and the direct copy kernel's error counter) from the device to pinned
host memory, on CUDA, without waiting for the forward the overlap scheduler launched just before the
result processing that finishes the request. Both finish paths copy through it: the finish worker's
hand-over (finisher.py, submit) and the synchronous finish on the scheduler thread (writer.py, finish:
SGLANG_HS_SYNC_FINISH=1, and the KV allocators the worker is not checked with, the SWA ones DeepSeek-V4
runs on).

SGLang 0.5.23's overlap loop, one iteration: ingest_requests (the capture hook calls `mark_iteration`),
launch step N+1 on the forward stream, make the schedule stream wait for it (`_apply_war_barrier`: all of
it for a prefill step), then process step N's results on the schedule stream. A copy queued there, or a
`.cpu()` / stream synchronize there, would wait for forward N+1: the gather (and, on the synchronous path,
the scheduler thread) idles for a whole step. So the copy runs on a side stream that waits only for the
iteration's start mark: after the previous iteration's result processing (the radix cache's checkpoint of
an unfinished request rewrites its req_to_token row there) and before this iteration's launch. The current
stream then waits for the copy, so SGLang's later rewrite of the row stays after it. The request's own
forward is synchronised by the host already (the overlap loop: process_batch_result syncs copy_done; the
plain loop: its results' next_token_ids.tolist() on the same stream), so its rows and ids are final when
the copy is issued. The side stream comes from PyTorch's high-priority pool, never one of
SGLang's priority-0 streams, and is taken when the writer is made: the first high-priority stream of a
process creates that pool, which waited for the device to go idle (36 ms behind queued matmuls on an
H200, issue 49), so taking it at the first hand-over stalled that finish behind the forward. Before the
first mark the current stream is used.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


class SlotIdCopy:
    def __init__(self, device: Optional[torch.device] = None) -> None:
        """`device`: the writer's CUDA device, whose side stream is taken now (module docstring); None without
        CUDA (a SlotIdCopy made without it takes the stream at its first copy)."""
        self.side = torch.cuda.Stream(device, priority=-1) if device is not None else None
        self._mark = None  # an event at the start of the scheduler's current iteration

    def mark_iteration(self) -> None:
        """At the start of every scheduler iteration (ingest_requests' hook): an event on the current stream
        that the next copies wait for (a stream wait takes the event's latest record). Nothing without a side
        stream (without CUDA)."""
        if self.side is not None:
            if self._mark is None:
                self._mark = torch.cuda.Event()
            self._mark.record()

    def to_host(self, slots: torch.Tensor, errors: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], "torch.cuda.Event"]:
        """Copy device `slots` (a view of req_to_token is fine) and, if given, the copy kernel's device error
        counter to new pinned host tensors; returns them with a blocking-sync event that fires once both
        have landed (a thread that syncs it sleeps instead of spinning)."""
        if self.side is None:
            self.side = torch.cuda.Stream(slots.device, priority=-1)
        current = torch.cuda.current_stream(slots.device)
        stream = self.side if self._mark is not None else current
        host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
        host_errors = None
        ready = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(stream):
            if stream is not current:
                stream.wait_event(self._mark)
            host.copy_(slots, non_blocking=True)
            if errors is not None:
                host_errors = torch.empty(errors.shape, dtype=errors.dtype, pin_memory=True)
                host_errors.copy_(errors, non_blocking=True)
            ready.record(stream)
        if stream is not current:
            slots.record_stream(stream)  # a temporary's memory is not reused before the copy ran
            current.wait_event(ready)  # SGLang rewrites the request's req_to_token row only after this read
        return host, host_errors, ready
