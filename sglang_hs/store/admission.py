"""Admission control: a request enters SGLang only when the output ring is sure to have room for its
record, so nothing waits inside a forward step and nothing is overwritten or dropped.

Where: on the writer rank (attention-TP rank 0), where SGLang pulls new requests from the tokenizer,
BEFORE it broadcasts them to the other ranks: every rank sees the same request stream, so their
scheduling stays identical. Requests that do not fit are held here, in arrival order, and pulled again
on the next scheduler iteration; other messages (aborts, control) pass at once, and an abort releases
the held requests it names with it (by rid prefix, as SGLang's `Scheduler.abort_request` matches), so
SGLang answers both as usual.

Batches: a `/generate` with a list of prompts reaches the scheduler as ONE
`BatchTokenizedGenerateReqInput` (pre-tokenized prompts always, text with
--enable-tokenizer-batch-encode), whose handler only loops `handle_generate_request` over its `batch`.
Each member is admitted or held like a single request, in arrival order; the members that go in
together are handed on re-wrapped in a batch of the same type (the original object when all go in at
once), so SGLang sees the same kinds of message as without sglang-hs. Embedding batches never
publish a record and pass, like single embedding requests.

Accounting: each admitted request reserves twice its worst-case record (prompt + max_new_tokens - 1
rows; twice, since a record that does not fit before the end of the ring wastes up to its own size
there). A reservation is released when the request finishes (published or not), and reconciled
against the scheduler's queues every half second, so a request that leaves any other way (rejected,
aborted while waiting) frees its share too. Invariant: reserved bytes <= free ring bytes at admission,
and free bytes only grow as the reader consumes, so `publish` never has to wait.

Time limit: a request held longer than `timeout` seconds (--hs-admission-timeout; 0 = no limit) is
failed: it goes in together with an AbortReq carrying a clear message (status 503), which SGLang
answers from its waiting queue before the request ever runs. SGLang aborts by rid PREFIX, so a held
request whose rid prefixes another live request's is held on rather than failed with a bystander.
Forward steps never wait, so SGLang's watchdog never fires.

Selection (--hs-capture all|opt-in, --hs-capture-sample P) and --hs-when-behind skip: each request is
decided here, once, as it is admitted. A request opted in (sampling params `custom_params`
{"hs_capture": true}; OpenAI chat: the request's top-level `custom_params`) is captured; else with
--hs-capture-sample P one is captured when `sample_point(rid, key)` (a hash of its rid in [0, 1), keyed
with a secret the server draws at start, or --hs-capture-sample-key: a client cannot pick a rid that is
sampled) is below P; else it is captured only with --hs-capture all. With --hs-capture-max-bytes N the
captured requests' worst-case records (charged as each is admitted: prompt + max_new_tokens - 1 rows)
add up to at most N bytes: a request whose worst case does not fit in what is left is served without
capture, reason "over_budget" (`capture_bytes` counts what was charged). A request not captured reserves no record:
it is admitted at once and only reserves room for a SKIP marker record (rid + reason, no rows) when
that room is free, so the reader can tell why it has no record. With --hs-when-behind skip, a request
that would be held (its reservation exceeds the free ring) is admitted the same way, not captured,
reason "reader_behind". The decision is in `decided[rid]` = (reason, marked) until the request
finishes; the stats count each reason.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from typing import Callable, Dict, List, Optional

from sglang_hs.store.ring import SKIP_REASONS, record_bytes

logger = logging.getLogger(__name__)
RECONCILE_EVERY_S = 0.5
LOG_EVERY_S = 10.0
OPT_IN_KEY = "hs_capture"  # sampling_params.custom_params[OPT_IN_KEY] = true: capture this request
REASON_CODE = {name: code for code, name in SKIP_REASONS.items()}
_NEVER_SELECTED = ("HEALTH_CHECK", "HS_WARMUP-")  # never recorded anyway (capture_hooks, patches/warmup_rid.py)


def sample_point(rid: str, key: bytes = b"") -> float:
    """A point in [0, 1) for a request id: blake2b of its utf-8 bytes keyed with `key` (the server's sampling
    key, which clients do not know), so the same rid is sampled the same way under one key only."""
    return int.from_bytes(hashlib.blake2b(str(rid).encode(), digest_size=8, key=key).digest(), "big") / 2.0 ** 64


def opted_in(req) -> bool:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(params, dict):
        return False
    v = params.get(OPT_IN_KEY)
    return v is True or (isinstance(v, (int, str)) and str(v).strip().lower() in ("1", "true", "yes", "on"))


def select(req, mode: str = "all", sample: Optional[float] = None, key: bytes = b"") -> Optional[str]:
    """None when `req` is to be captured, else the reason it is not (a key of REASON_CODE)."""
    if opted_in(req):
        return None
    if sample is not None:
        return None if sample_point(req.rid, key) < sample else "not_sampled"
    return None if mode == "all" else "not_opted_in"


class AdmissionControl:
    def __init__(self, ring, rows_per_token: int, hidden: int, elem: int, context_len: int,
                 timeout: float = 0.0, mode: str = "all", sample: Optional[float] = None,
                 when_behind: str = "hold", sample_key: bytes = b"", max_bytes: Optional[int] = None) -> None:
        self.ring, self.P, self.H, self.elem, self.context_len = ring, rows_per_token, hidden, elem, context_len
        self.timeout = timeout
        self.mode, self.sample, self.when_behind = mode, sample, when_behind
        self.sample_key, self.max_bytes = sample_key, max_bytes
        self.decided: Dict[str, tuple] = {}  # rid -> (reason, marker reserved): admitted without capture
        region = getattr(ring, "r", None)  # a SharedRegion; unit tests may pass a stand-in ring
        self.ring_name = os.path.join(region.dir_path, region.name) if region is not None else "the output ring"
        self.reserved: Dict[str, int] = {}
        self.held: "collections.deque" = collections.deque()  # requests waiting, in arrival order
        self.held_since: Dict[str, float] = {}
        self._batch_of: Dict[int, object] = {}  # id(held member of a batch) -> its batch message
        self.stats = {"admission_waits": 0, "held_now": 0, "oversized": 0, "failed": 0, "markers_dropped": 0,
                      "capture_bytes": 0}  # worst-case record bytes of the requests admitted with capture
        self.stats.update({f"skipped_{r}": 0 for r in REASON_CODE})
        self._last_reconcile = self._last_log = self._last_skip_log = 0.0

    def need(self, req) -> int:
        n_in = len(req.input_ids) if req.input_ids is not None else 0
        max_new = getattr(req.sampling_params, "max_new_tokens", None)
        if max_new is None:
            max_new = max(1, self.context_len - n_in)
        rows = max(0, n_in + max_new - 1)
        return 2 * record_bytes(rows, self.P, self.H, self.elem, len(str(req.rid).encode()))

    def filter(self, pulled: Optional[List], known_rids: Optional[Callable[[], Optional[set]]] = None) -> Optional[List]:
        """Called with what the writer rank pulled this iteration; returns what may enter now.
        `known_rids()` (the scheduler's request ids) is only called when a reconcile is due."""
        if pulled is None:
            return None
        from sglang.srt.managers import io_struct

        AbortReq, TokenizedGenerateReqInput = io_struct.AbortReq, io_struct.TokenizedGenerateReqInput
        Batch = getattr(io_struct, "BatchTokenizedGenerateReqInput", ())  # () : stand-ins without batches

        now = time.monotonic()
        if known_rids is not None and (self.reserved or self.decided) and now - self._last_reconcile > RECONCILE_EVERY_S:
            self._last_reconcile = now
            known = known_rids()
            if known is not None:
                for rid in [r for r in set(self.reserved) | set(self.decided) if r not in known]:
                    self.release(rid)
        out = []
        for msg in pulled:
            if isinstance(msg, Batch) and len(msg.batch) > 0:
                for req in msg.batch:  # each member like a single request; re-wrapped on the way out
                    self._batch_of[id(req)] = msg
                    self.held.append(req)
                    self.held_since.setdefault(str(req.rid), now)
            elif isinstance(msg, TokenizedGenerateReqInput):
                self.held.append(msg)
                self.held_since.setdefault(str(msg.rid), now)
            elif isinstance(msg, AbortReq) and self.held:
                keep = collections.deque()
                for h in self.held:  # an aborted held request goes in with its abort
                    if msg.abort_all or str(h.rid).startswith(msg.rid or ""):
                        out.append(h)
                        self.held_since.pop(str(h.rid), None)
                    else:
                        keep.append(h)
                self.held = keep
                out.append(msg)
            else:
                out.append(msg)
        free = self.ring.free_bytes() - sum(self.reserved.values())
        keep: "collections.deque" = collections.deque()
        blocked = False  # a captured request is waiting for room: captured ones behind it wait too (FIFO)
        for req in self.held:
            rid = str(req.rid)
            if rid.startswith(_NEVER_SELECTED):  # health checks, the warm-up: never recorded, never held
                out.append(self._admit(req))
                continue
            reason = select(req, self.mode, self.sample, self.sample_key)
            if reason is None and self.max_bytes is not None \
                    and self.stats["capture_bytes"] + self.need(req) // 2 > self.max_bytes:
                reason = "over_budget"  # --hs-capture-max-bytes is spent
            if reason is not None:  # not captured: goes in at once, whatever waits ahead of it
                free = self._skip(req, reason, free, now)
                out.append(self._admit(req))
                continue
            if blocked:
                keep.append(req)
                continue
            need = self.need(req)
            if need > self.ring.capacity:  # could never fit: let SGLang run it; its record is refused
                self.stats["oversized"] += 1
                logger.error("sglang-hs: request %s may need %d bytes of output ring, more than its %d: "
                             "raise --hs-ring-size", req.rid, need, self.ring.capacity)
                out.append(self._admit(req))
                continue
            if need > free:
                if self.when_behind == "skip":  # serve it now, without capture
                    free = self._skip(req, "reader_behind", free, now)
                    out.append(self._admit(req))
                    continue
                blocked = True
                keep.append(req)
                continue
            self.decided.pop(rid, None)  # a reused rid: this request is captured, whatever an earlier one was
            self.reserved[rid] = need
            free -= need
            self.stats["capture_bytes"] += need // 2  # its worst-case record (need reserves it twice)
            out.append(self._admit(req))
        self.held = keep
        if self.held and self.timeout > 0:
            out = self._fail_expired(now, known_rids) + out
        if self.held:
            self.stats["admission_waits"] += 1
            if now - self._last_log > LOG_EVERY_S:
                self._last_log = now
                logger.warning("sglang-hs: admission waiting: %d request(s) held until the reader frees the output "
                               "ring (%d bytes free, %d reserved)", len(self.held), self.ring.free_bytes(),
                               sum(self.reserved.values()))
        self.stats["held_now"] = len(self.held)
        return self._rewrap(out) if self._batch_of else out

    def marker_need(self, rid: str) -> int:
        return 2 * record_bytes(0, self.P, self.H, self.elem, len(str(rid).encode()))

    def _skip(self, req, reason: str, free: int, now: float) -> int:
        """Admit `req` without capture; reserve its SKIP marker if there is room for it
        (else it goes unmarked, counted). Returns the free bytes left."""
        rid = str(req.rid)
        marker = self.marker_need(rid)
        marked = marker <= free
        if marked:
            self.reserved[rid] = marker
            free -= marker
        else:
            self.stats["markers_dropped"] += 1
        self.decided[rid] = (reason, marked)
        self.stats[f"skipped_{reason}"] += 1
        if reason == "reader_behind" and now - self._last_skip_log > LOG_EVERY_S:
            self._last_skip_log = now
            logger.warning("sglang-hs: the output ring is too full for new records (%d bytes free, %d reserved; is "
                           "the reader of %s keeping up?): requests are served without capture "
                           "(--hs-when-behind skip); %d so far", self.ring.free_bytes(),
                           sum(self.reserved.values()), self.ring_name, self.stats["skipped_reader_behind"])
        return free

    def take_decision(self, rid: str) -> Optional[tuple]:
        """(reason, marker reserved) of a request admitted without capture, once; None: captured."""
        return self.decided.pop(str(rid), None)

    def _rewrap(self, out: List) -> List:
        """Members of one batch that go in next to each other go in as a batch of the same type again
        (the original when it goes in whole); members still held keep their batch for later."""
        groups: List = []  # [batch or None, [messages]]
        for msg in out:
            src = self._batch_of.pop(id(msg), None)
            if src is not None and groups and groups[-1][0] is src:
                groups[-1][1].append(msg)
            else:
                groups.append([src, [msg]])
        result = []
        for src, msgs in groups:
            if src is None:
                result += msgs
            elif len(msgs) == len(src.batch) and all(a is b for a, b in zip(msgs, src.batch)):
                result.append(src)
            else:
                import msgspec

                index = {id(r): i for i, r in enumerate(src.batch)}
                pick = [index[id(r)] for r in msgs]
                fields = {"batch": msgs}
                for name in ("rids", "http_worker_ipcs"):  # per-member lists, when a sender filled them
                    values = getattr(src, name, None)
                    if values is not None and len(values) == len(src.batch):
                        fields[name] = [values[i] for i in pick]
                result.append(msgspec.structs.replace(src, **fields))
        return result

    def _admit(self, req):
        self.held_since.pop(str(req.rid), None)
        return req

    def _fail_expired(self, now: float, known_rids) -> List:
        """Requests held past the timeout go in with an abort naming the reason (SGLang answers them
        from its waiting queue); first in the list, so the abort meets only its own request there."""
        expired = [h for h in self.held if now - self.held_since.get(str(h.rid), now) > self.timeout]
        if not expired:
            return []
        from sglang.srt.managers.io_struct import AbortReq

        live = set(known_rids() or ()) if known_rids is not None else set()
        live.update(str(h.rid) for h in self.held)
        out = []
        for req in expired:
            rid = str(req.rid)
            if any(r != rid and str(r).startswith(rid) for r in live if r is not None):
                continue  # SGLang's abort matches by prefix: it would take a bystander with it
            message = (f"sglang-hs: request {rid} held {now - self.held_since[rid]:.0f}s by admission control: the "
                       f"hidden-state output ring stayed full (is the reader of {self.ring_name} running?); "
                       "raise --hs-ring-size or --hs-admission-timeout")
            logger.error("%s", message)
            self.held.remove(req)
            del self.held_since[rid]
            self.stats["failed"] += 1
            out += [req, AbortReq(rid=rid, abort_message=message,
                                  finished_reason={"type": "abort", "message": message, "status_code": 503})]
        return out

    def release(self, rid: str) -> None:
        self.reserved.pop(str(rid), None)
        self.decided.pop(str(rid), None)

    def release_reservation(self, rid: str) -> None:
        """The finish worker published `rid`'s record or marker: its ring room goes; a decision made for a
        newer request with the same rid stays."""
        self.reserved.pop(str(rid), None)
