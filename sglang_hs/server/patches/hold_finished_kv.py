"""Hold a finished request's KV slots until its record is gathered (records in parts, --hs-record-part-size).

What: wraps the name `release_kv_cache` in SGLang's `scheduler_components/batch_result_processor` module (its
only sites that release a request handed to the finish worker: a request finishing at prefill, and at decode,
each right after `_maybe_collect_routed_experts`, where capture_hooks hands the record over), plus
`Scheduler.is_fully_idle` (not idle while anything is held) and `SchedulerInvariantChecker._requests_owning_rows`
(the held requests own their rows). A request the finish worker says must be held (FinishWorker.holds: a record
in parts, or any record handed over behind one not yet published) gets `hs_hold_seq`; its `release_kv_cache`
call, whole (the radix insert, the frees, the unlock, its req_to_token row), is kept and made on the scheduler
thread once the worker is done with that job (`release_done`, at every iteration's intake and idle turn).

Why: a record in parts waits for ring room as the reader consumes it, and the next write into a slot its gather
reads waits for that gather (finisher.py). SGLang frees a finished request's slots at once, so a forward step
reusing one would wait for the reader. Held, the slots stay allocated: SGLang counts them as used
(`available_size() + evictable_size()`), schedules around them and queues new requests instead, and no step
ever waits for the reader. The idle leak check (available + evictable == total) would count held slots as
leaked, so the scheduler is not idle while any are held; SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY's check
counts them through `_requests_owning_rows`. The health check's idle test (for_health_check) is SGLang's own.

Only with attention TP 1 (the launcher refuses --hs-record-part-size otherwise): every attention-TP rank must
free the same slots at the same iteration or their allocators diverge, which needs the writer rank to tell the
others (not built). Refused too with --enable-streaming-session (SGLang keeps such a request's KV row for the next
turn: it could not be held, and its gather behind a record in parts would make writes wait) and with
--enable-memory-saver (release_memory_occupation asserts the scheduler idle). A held request's radix insert is
delayed with its frees: a later request sharing its prefix hits the cache only once it is released.

Upstream status: none; SGLang frees a finished request's KV at once (its own deferred release is disaggregation's,
decode.py). Removal plan: if SGLang grows a hook to delay a finished request's release, use it; or drop records
in parts.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Tuple

logger = logging.getLogger(__name__)
ORIGINALS: Dict[str, Callable] = {}
# (job seq, req, tree_cache, checkpoint) of the releases held, in hand-over order (scheduler thread only)
_held: List[Tuple[int, object, object, bool]] = []
_finisher = None  # the FinishWorker whose jobs the holds wait for (hold())
_stats = None  # the writer's stats dict: held_requests, held_tokens


def hold(req, seq: int, finisher, stats: dict) -> None:
    """Hold `req`'s KV release until job `seq` of `finisher` is done (capture_hooks, at the hand-over)."""
    global _finisher, _stats
    _finisher, _stats = finisher, stats
    req.hs_hold_seq = seq


def held() -> int:
    """Requests whose release is held now."""
    return len(_held)


def _tokens(req) -> int:
    kv = getattr(req, "kv", None)
    return int(getattr(kv, "kv_allocated_len", 0) or 0)


def _publish_stats() -> None:
    if _stats is not None:
        _stats["held_requests"] = len(_held)
        _stats["held_tokens"] = sum(_tokens(r) for _, r, _, _ in _held)


def _release_kv_cache(req, tree_cache, *, checkpoint: bool):
    seq = getattr(req, "hs_hold_seq", 0)
    if seq and _finisher is not None and not _finisher.done(seq):
        _held.append((seq, req, tree_cache, checkpoint))
        _publish_stats()
        return None
    return ORIGINALS["release_kv_cache"](req, tree_cache, checkpoint=checkpoint)


def release_done() -> int:
    """Make the held releases whose jobs are done, in hand-over order (scheduler thread: SGLang's allocator and
    radix tree are not thread-safe). Returns how many are still held."""
    if not _held:
        return 0
    due = [item for item in _held if _finisher.done(item[0])]
    if due:
        _held[:] = [item for item in _held if not any(item is d for d in due)]  # first: a release that raises
        _publish_stats()  # (it stops the scheduler) is not made twice
        for _, req, tree_cache, checkpoint in due:
            ORIGINALS["release_kv_cache"](req, tree_cache, checkpoint=checkpoint)
    return len(_held)


def _is_fully_idle(self, for_health_check=False, ignore_waiting=False) -> bool:
    if _held and not for_health_check:
        return False
    return ORIGINALS["is_fully_idle"](self, for_health_check=for_health_check, ignore_waiting=ignore_waiting)


def _requests_owning_rows(self):
    owners = ORIGINALS["_requests_owning_rows"](self)
    seen = {id(r) for r in owners}
    return owners + [r for _, r, _, _ in _held if id(r) not in seen and r.kv.holds_kv]


def apply():
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    ORIGINALS["release_kv_cache"] = brp.release_kv_cache
    ORIGINALS["is_fully_idle"] = Scheduler.is_fully_idle
    ORIGINALS["_requests_owning_rows"] = SchedulerInvariantChecker._requests_owning_rows
    brp.release_kv_cache = _release_kv_cache
    Scheduler.is_fully_idle = _is_fully_idle
    SchedulerInvariantChecker._requests_owning_rows = _requests_owning_rows
    return dict(ORIGINALS)
