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

Oversized: a request whose share (twice its worst-case record) exceeds the ring's capacity could never be
admitted, however long it waited. With --hs-when-behind hold it is refused at once, the same way, status 400,
in one line naming its tokens, the bytes it needs, the capacity and the most tokens that fit (unless its abort
would take a bystander: then it is served and its record refused, logged); with skip it is served without
capture, reason "oversized". The launcher sizes the ring for one record at the maximal context length, or of
--hs-max-record-tokens when that is fewer (a long-context server capturing shorter samples): this takes a
request longer than that, or a ring smaller than the context the server resolves.

Time limit: a request held longer than `timeout` seconds (--hs-admission-timeout; 0 = no limit) is
failed: it goes in together with an AbortReq carrying a clear message (status 503), which SGLang
answers from its waiting queue before the request ever runs. SGLang aborts by rid PREFIX, so a held
request whose rid prefixes another live request's is held on rather than failed with a bystander.
Forward steps never wait, so SGLang's watchdog never fires.

Request ids: a record names its request in a header field of 16 bits (ring.MAX_RID_BYTES), so a request
whose rid is longer (utf-8; /generate, its batch members and the OpenAI endpoints all take the client's
rid) is refused the same way, status 400, before it runs; so is every member of a batch holding one (the
client gets one answer for the batch), unless its abort would take a bystander. A too long rid cannot
prefix a shorter one, so its own abort takes none.

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
reason "reader_behind". The decision is the request's ticket's (reason, marked) until the request
finishes; the stats count each reason.

Request shapes (issue 29): a request that can never have an exact record (`unrecordable`: beam search,
input_embeds) is served without capture whatever the selection, its marker reserved like a record (held
in arrival order while the ring lacks room for it; with --hs-when-behind skip it goes unmarked instead).
The prefix request SGLang sends before the choices of an n > 1 request (tagged in the tokenizer manager
by sglang_hs/server/patches/parallel_sampling.py) gets neither record nor marker. A session turn reserves for the
session's whole context, which is what its record holds (`recorded_prompt_len`, session_turns.py).
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional

from sglang_hs.server.store.layout import MAX_RID_BYTES, SKIP_REASONS, record_bytes

logger = logging.getLogger(__name__)
RECONCILE_EVERY_S = 0.5
LOG_EVERY_S = 10.0
OPT_IN_KEY = "hs_capture"  # sampling_params.custom_params[OPT_IN_KEY] = true: capture this request
# custom_params[INTERNAL_KEY] = PARALLEL_SAMPLING_PREFIX: SGLang's own prefix request of an n > 1 request
# (patches/parallel_sampling.py tags it in the tokenizer manager): no record, no marker
INTERNAL_KEY, PARALLEL_SAMPLING_PREFIX = "sglang_hs_internal", "parallel_sampling_prefix"
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


def parallel_sampling_prefix(req) -> bool:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and params.get(INTERNAL_KEY) == PARALLEL_SAMPLING_PREFIX


def unrecordable(req) -> Optional[str]:
    """Why `req` can never have an exact record, whatever the selection (a key of REASON_CODE), or None.
    "beam_search": SGLang keeps a beam request's history in its beam DAG (the leader's output_ids are
    placeholder zeros, its req_to_token row holds whichever beam sits in row 0, its decode slots are freed
    before the finish hook); "input_embeds": the rows are of the embeddings sent, the token ids
    placeholders (SGLang fills input_ids with 1s)."""
    if (getattr(getattr(req, "sampling_params", None), "beam_width", None) or 1) > 1:
        return "beam_search"
    if getattr(req, "input_embeds", None) is not None:
        return "input_embeds"
    return None


def select(req, mode: str = "all", sample: Optional[float] = None, key: bytes = b"") -> Optional[str]:
    """None when `req` is to be captured, else the reason it is not (a key of REASON_CODE)."""
    if opted_in(req):
        return None
    if sample is not None:
        return None if sample_point(req.rid, key) < sample else "not_sampled"
    return None if mode == "all" else "not_opted_in"


def meta_bound(max_new: int) -> int:
    """The most metadata bytes a speculative request's record holds (capture_hooks.record_meta): a verify step
    emits at least one token, so at most max_new steps, each at most 6 bytes of JSON ("65535,") and, with a
    DSpark confidence head, 7 more (its mean draft confidence to 4 decimals, "0.1234,"), plus the object around
    them."""
    return 96 + 13 * max(0, max_new)


SIZED_RID_BYTES = 256  # the request id a ring is sized for (the launcher's floor, the planner): longer ones fit if room


def part_rows_of(part_bytes: int, row_bytes: int) -> int:
    """Rows of one part of a record in parts (--hs-record-part-size `part_bytes`, rows of `row_bytes` each): at least
    one; 0 without parts (every record whole)."""
    return max(1, part_bytes // row_bytes) if part_bytes else 0


def in_parts(rows: int, part_rows: int) -> bool:
    """Whether a record of `rows` rows leaves the ring in parts of `part_rows` rows (0: every record whole)."""
    return bool(part_rows) and rows > part_rows


def share(rows: int, P: int, H: int, elem: int, rid_len: int, meta_len: int = 0, part_rows: int = 0) -> int:
    """The ring bytes admission reserves for a record of `rows` rows: twice the record (room to wrap), or for one
    that leaves in parts of `part_rows` rows, twice its first part (which holds all its token ids)."""
    if in_parts(rows, part_rows):
        return 2 * record_bytes(part_rows, P, H, elem, rid_len, meta_len, n_ids=rows)
    return 2 * record_bytes(rows, P, H, elem, rid_len, meta_len)


def ring_floor(tokens: int, P: int, H: int, elem: int, speculative: bool = False, part_bytes: int = 0) -> int:
    """The smallest output ring that admits a record of `tokens` tokens (a request id of SIZED_RID_BYTES and, on a
    speculative server, every verify step's accepted drafts): its share (twice the record, since admission reserves
    room to wrap; with records in parts of `part_bytes` row bytes, --hs-record-part-size, twice its first part). The
    launcher grows a default ring to it (or refuses a given one) and the planner sizes with it."""
    meta = meta_bound(tokens) if speculative else 0
    return share(tokens, P, H, elem, SIZED_RID_BYTES, meta, part_rows_of(part_bytes, P * H * elem))


@dataclass(eq=False)
class Ticket:
    """One admitted request's share: the ring bytes reserved for its record or marker, and its decision."""
    rid: str
    nbytes: int  # 0: nothing reserved (an unmarked skip, an oversized request)
    decision: Optional[tuple] = None  # (reason, marker reserved) when served without capture; None: captured
    # The sampling params object of its message, held: SGLang's scheduler usually hands that very object on
    # to the Req it finishes (Scheduler.handle_generate_request), and while the ticket holds it no other
    # object can be made at its address. Compared by identity only.
    params: Any = None
    tokens: int = 0  # its worst-case tokens charged to the KV hold budget (records in parts; 0: none)


def _rid_message(why: str) -> str:
    return (f"sglang-hs: request refused: {why}; hidden-state records hold request ids of at most {MAX_RID_BYTES} "
            "bytes (utf-8)")


class AdmissionControl:
    def __init__(self, ring, rows_per_token: int, hidden: int, elem: int, context_len: int,
                 timeout: float = 0.0, mode: str = "all", sample: Optional[float] = None,
                 when_behind: str = "hold", recorded_prompt_len: Optional[Callable[[object], Optional[int]]] = None,
                 sample_key: bytes = b"", max_bytes: Optional[int] = None, speculative: bool = False,
                 part_rows: int = 0, hold_budget: int = 0) -> None:
        self.ring, self.P, self.H, self.elem, self.context_len = ring, rows_per_token, hidden, elem, context_len
        # the prompt length a request's record will have when it is not len(input_ids) (a session turn's
        # record holds the session's context: sglang_hs/server/store/session_turns.py); None: len(input_ids)
        self.recorded_prompt_len = recorded_prompt_len
        self.timeout = timeout
        self.mode, self.sample, self.when_behind = mode, sample, when_behind
        self.sample_key, self.max_bytes = sample_key, max_bytes
        self.speculative = speculative  # records carry each verify step's accepted drafts (meta_bound)
        # --hs-record-part-size: a record of more rows leaves the ring in parts of this many (0: whole records);
        # such a request reserves room for its first part (all its token ids and part_rows rows): the finish worker
        # publishes each later part as the reader makes room, the request's KV slots held meanwhile (finisher.py)
        self.part_rows = part_rows
        # With records in parts a captured request's KV may be held after it finishes (until its record is gathered,
        # as the reader makes room): the worst-case tokens of the captured requests in flight are charged to
        # `hold_budget` (the KV pool less one full-context request), so a stalled reader can never hold the whole
        # pool (SGLang would retract, then abort the last request, and its health check would find no slot). A
        # request over the budget waits here like one the ring has no room for (skip: served without capture);
        # one alone is always let in.
        self.hold_budget = hold_budget
        self._hold_charged = 0  # tokens charged (scheduler thread)
        # Every admitted request has a ticket until it finishes and its record or marker is published. A rid
        # used again (a retry while the old request's record is still being published, a duplicate) has one
        # ticket per request: a finish finds its own (_find) and hands it to the finish worker with the
        # record, which releases that very ticket once published (_finishing: finished, not released yet).
        self._tickets: Dict[str, List[Ticket]] = {}  # rid -> tickets, in admission order
        self._finishing: Dict[str, Deque[Ticket]] = {}  # rid -> tickets finished and not released, in that order
        self._n_tickets = 0  # tickets alive (one int: the status thread reads it, unaccounted())
        self._reserved = 0  # ring bytes the tickets reserve (one int: the finish worker reads it, part_room)
        # Records in parts: a later part's room is taken by the finish worker (part_room) beyond every other
        # request's reservation; the lock orders that against admission's decisions (filter)
        self._room_lock = threading.RLock()
        self._in_flight = 0  # a part's room taken and not yet published
        region = getattr(ring, "r", None)  # a SharedRegion; unit tests may pass a stand-in ring
        self.ring_name = os.path.join(region.dir_path, region.name) if region is not None else "the output ring"
        self.held: "collections.deque" = collections.deque()  # requests waiting, in arrival order
        self.held_since: Dict[str, float] = {}
        self._batch_of: Dict[int, object] = {}  # id(held member of a batch) -> its batch message
        self.stats = {"admission_waits": 0, "held_now": 0, "oversized": 0, "failed": 0, "markers_dropped": 0,
                      "capture_bytes": 0,  # worst-case record bytes of the requests admitted with capture
                      "hold_charged_tokens": 0}  # records in parts: worst-case tokens charged to the hold budget
        self.stats.update({f"skipped_{r}": 0 for r in REASON_CODE})
        self._last_reconcile = self._last_log = self._last_skip_log = 0.0

    def worst_record(self, req) -> int:
        """Bytes of `req`'s worst-case record, whole (what --hs-capture-max-bytes charges)."""
        n_in, max_new = self.worst_tokens(req)
        meta = meta_bound(max_new) if self.speculative else 0
        return record_bytes(max(0, n_in + max_new - 1), self.P, self.H, self.elem, len(str(req.rid).encode()), meta)

    def need(self, req) -> int:
        """The ring bytes `req` reserves: twice its worst-case record (room to wrap), or for a record that will
        leave in parts, twice its first part (every token id, part_rows rows)."""
        n_in, max_new = self.worst_tokens(req)
        rows = max(0, n_in + max_new - 1)
        meta = meta_bound(max_new) if self.speculative else 0
        return share(rows, self.P, self.H, self.elem, len(str(req.rid).encode()), meta, self.part_rows)

    def part_room(self, nbytes: int, ticket: Optional[Ticket]) -> bool:
        """The finish worker, before a later part of a record in parts (its first has the request's reservation):
        True, the room taken (until part_room_done), when the ring has `nbytes` free beyond every OTHER request's
        reservation, so parts never take room a request was admitted on; else False (the worker asks again as the
        reader frees room; once it has caught up, the part's own reservation, twice a first part, is free)."""
        own = ticket.nbytes if ticket is not None else 0
        with self._room_lock:
            if self.ring.free_bytes() - (self._reserved - own) - self._in_flight < nbytes:
                return False
            self._in_flight = nbytes
            return True

    def part_room_done(self) -> None:
        """The part taken with part_room is published (the ring's free bytes count it now)."""
        with self._room_lock:
            self._in_flight = 0

    def filter(self, pulled: Optional[List], known_rids: Optional[Callable[[], Optional[set]]] = None) -> Optional[List]:
        """Called with what the writer rank pulled this iteration; returns what may enter now.
        `known_rids()` (the scheduler's request ids) is only called when a reconcile is due. Under the room lock:
        a record in parts takes room (part_room) before or after, never between a decision and its reservation."""
        with self._room_lock:
            return self._filter(pulled, known_rids)

    def _filter(self, pulled: Optional[List], known_rids: Optional[Callable[[], Optional[set]]]) -> Optional[List]:
        if pulled is None:
            return None
        from sglang.srt.managers import io_struct

        AbortReq, TokenizedGenerateReqInput = io_struct.AbortReq, io_struct.TokenizedGenerateReqInput
        Batch = getattr(io_struct, "BatchTokenizedGenerateReqInput", ())  # () : stand-ins without batches

        now = time.monotonic()
        if known_rids is not None and self._tickets and now - self._last_reconcile > RECONCILE_EVERY_S:
            self._last_reconcile = now
            known = known_rids()
            if known is not None:
                for rid in [r for r in self._tickets if r not in known]:
                    for ticket in list(self._tickets.get(rid, ())):
                        self.drop(ticket)
        out = []
        for msg in pulled:
            if isinstance(msg, Batch) and len(msg.batch) > 0:
                longest = max(len(str(r.rid).encode()) for r in msg.batch)
                if longest > MAX_RID_BYTES and known_rids is not None:
                    known = known_rids()  # asked once for the whole batch
                    live = lambda: known  # noqa: E731
                else:
                    live = known_rids
                for req in msg.batch:  # each member like a single request; re-wrapped on the way out
                    self._batch_of[id(req)] = msg
                    # the client gets one answer for the batch: a refusal, decided here (no state kept for later)
                    why = self._batch_refusal(req, msg, longest, live) if longest > MAX_RID_BYTES else None
                    if why is not None:
                        out += self._refuse(req, _rid_message(why), 400)
                        continue
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
        free = self.ring.free_bytes() - self.reserved_bytes() - self._in_flight
        keep: "collections.deque" = collections.deque()
        blocked = False  # a captured request is waiting for room: captured ones behind it wait too (FIFO)
        for req in self.held:
            rid = str(req.rid)
            n = len(rid.encode())
            if n > MAX_RID_BYTES:  # no record could name it: refused before it runs
                out += self._refuse(req, _rid_message(f"request id of {n} bytes"), 400)
                continue
            if rid.startswith(_NEVER_SELECTED):  # health checks, the warm-up: never recorded, never held
                out.append(self._admit(req))
                continue
            if parallel_sampling_prefix(req):  # its choices have their records: this one none, not even a marker
                self._add(req, 0, (PARALLEL_SAMPLING_PREFIX, False))
                out.append(self._admit(req))
                continue
            never = unrecordable(req)  # served without capture, its marker reserved like a record (FIFO)
            reason = None if never else select(req, self.mode, self.sample, self.sample_key)
            if reason is None and not never and self.max_bytes is not None \
                    and self.stats["capture_bytes"] + self.worst_record(req) > self.max_bytes:
                reason = "over_budget"  # --hs-capture-max-bytes is spent
            if reason is not None:  # not captured: goes in at once, whatever waits ahead of it
                free = self._skip(req, reason, free, now)
                out.append(self._admit(req))
                continue
            need = self.marker_need(rid) if never else self.need(req)
            if need > self.ring.capacity:  # could never fit, however long it waited
                self.stats["oversized"] += 1
                if self.when_behind == "skip":  # served now without capture, like a request the reader is behind on
                    free = self._skip(req, never or "oversized", free, now)
                    out.append(self._admit(req))
                elif self._abort_takes_another(req, known_rids):  # SGLang's abort by prefix would take a bystander
                    logger.error("%s; served, its record will be refused", self.oversized_message(req, need))
                    self._add(req, 0, None)
                    out.append(self._admit(req))
                else:
                    out += self._refuse(req, self.oversized_message(req, need), 400)
                continue
            if blocked:
                keep.append(req)
                continue
            tokens = sum(self.worst_tokens(req)) if self.hold_budget and not never else 0
            if need > free or (tokens and self._hold_charged and self._hold_charged + tokens > self.hold_budget):
                if self.when_behind == "skip":  # serve it now, without capture
                    free = self._skip(req, never or "reader_behind", free, now)
                    out.append(self._admit(req))
                    continue
                blocked = True
                keep.append(req)
                continue
            if never:
                self.stats[f"skipped_{never}"] += 1
            self._add(req, need, (never, True) if never else None, tokens)
            free -= need
            if not never:
                self.stats["capture_bytes"] += self.worst_record(req)
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
                               self.reserved_bytes())
        self.stats["held_now"] = len(self.held)
        return self._rewrap(out) if self._batch_of else out

    def _batch_refusal(self, req, batch, longest: int, known_rids) -> Optional[str]:
        """Why member `req` of `batch`, which holds a request id of `longest` bytes (too long for a record),
        is refused with it: the client gets one answer for the batch. None: its rid prefixes another live
        request's (an abort by prefix would take that one too), so it goes in like a single request."""
        n = len(str(req.rid).encode())
        if n > MAX_RID_BYTES:
            return f"request id of {n} bytes"
        if self._abort_takes_another(req, known_rids, batch.batch):
            return None
        return f"a request id of {longest} bytes in its batch"

    def _abort_takes_another(self, req, known_rids, also=()) -> bool:
        """SGLang's abort of `req` (by rid prefix) would take another request with it: a live one (the
        scheduler's, a duplicate of its rid included), one held here, or one of `also`; `req` itself is
        told apart by identity, never by its rid."""
        rid = str(req.rid)
        live = list(known_rids() or ()) if known_rids is not None else []
        live += [h.rid for h in list(self.held) + list(also) if h is not req]
        return any(r is not None and str(r).startswith(rid) for r in live)

    def worst_tokens(self, req):
        """(prompt tokens its record holds, max_new_tokens as admission counts them) of `req`."""
        n_in = self.recorded_prompt_len(req) if self.recorded_prompt_len is not None else None
        if n_in is None:
            n_in = len(req.input_ids) if req.input_ids is not None else 0
        max_new = getattr(req.sampling_params, "max_new_tokens", None)
        return n_in, max(1, self.context_len - n_in) if max_new is None else max_new

    def max_tokens(self, rid_len: int, meta_len: int = 0) -> int:
        """The most tokens (prompt + max_new_tokens) a request's record may hold for this ring to take it: its
        share (twice the record, or with records in parts twice its first part, which holds every token id)
        fits the capacity. A record holds prompt + max_new_tokens - 1 rows."""
        def fits(rows):
            return share(rows, self.P, self.H, self.elem, rid_len, meta_len, self.part_rows) <= self.ring.capacity

        lo, hi = 0, self.ring.capacity // 4 + 1  # each row of a record holds at least its 4-byte token id
        if not fits(lo):
            return 0
        while lo < hi:  # the share grows with the rows: the largest that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo + 1 if lo else 0

    def oversized_message(self, req, need: int) -> str:
        """One line: why `req` (whose ring share `need` exceeds the ring) is refused, and what would take it."""
        n_in, max_new = self.worst_tokens(req)
        meta = meta_bound(max_new) if self.speculative else 0
        fit = self.max_tokens(len(str(req.rid).encode()), meta)
        share_of = ("twice its first part, which holds every token id" if in_parts(n_in + max_new - 1, self.part_rows)
                    else "twice the record's worst case")
        return (f"sglang-hs: request refused: {n_in} prompt + {max_new} max_new_tokens = {n_in + max_new} tokens "
                f"need {need} bytes of hidden-state output ring ({share_of}), more than its "
                f"capacity of {self.ring.capacity} bytes; at most {fit} tokens fit: send fewer tokens or raise "
                "--hs-ring-size on the server")

    def marker_need(self, rid: str) -> int:
        return 2 * record_bytes(0, self.P, self.H, self.elem, len(str(rid).encode()))

    def _skip(self, req, reason: str, free: int, now: float) -> int:
        """Admit `req` without capture; reserve its SKIP marker if there is room for it
        (else it goes unmarked, counted). Returns the free bytes left."""
        rid = str(req.rid)
        marker = self.marker_need(rid)
        marked = marker <= free
        if marked:
            free -= marker
        else:
            self.stats["markers_dropped"] += 1
        self._add(req, marker if marked else 0, (reason, marked))
        self.stats[f"skipped_{reason}"] += 1
        if reason == "reader_behind" and now - self._last_skip_log > LOG_EVERY_S:
            self._last_skip_log = now
            logger.warning("sglang-hs: the output ring is too full for new records (%d bytes free, %d reserved; is "
                           "the reader of %s keeping up?): requests are served without capture "
                           "(--hs-when-behind skip); %d so far", self.ring.free_bytes(),
                           self.reserved_bytes(), self.ring_name, self.stats["skipped_reader_behind"])
        return free

    def unaccounted(self) -> int:
        """Requests held or admitted whose outcome is not yet counted (any thread; the status file's
        `unaccounted`): a ticket goes only after its record, marker or drop was counted, a held request
        leaves `held` only once admitted (a ticket first) or refused (`failed` first). A moment's
        over-count while a request moves from one to the other, never an under-count."""
        return self._n_tickets + len(self.held)

    # --- tickets -------------------------------------------------------------------------------------
    def _add(self, req, nbytes: int, decision: Optional[tuple], tokens: int = 0) -> None:
        ticket = Ticket(str(req.rid), nbytes, decision, getattr(req, "sampling_params", None), tokens)
        self._tickets.setdefault(ticket.rid, []).append(ticket)
        self._n_tickets += 1
        self._reserved += nbytes
        self._hold_charged += tokens
        self.stats["hold_charged_tokens"] = self._hold_charged

    def _find(self, rid: str, req=None, finishing_too: bool = True) -> Optional[Ticket]:
        """The ticket of `req` (rid `rid`): the one holding its very sampling params object; else its rid's
        oldest ticket not finishing yet, else (`finishing_too`) its oldest. The fallback is exact for a rid
        in flight once; for a rid used again it assumes first in, first out. It applies where SGLang's Req
        holds another params object than the message did: Req.__init__ copies them for a request with a
        custom logit processor and a dict custom_params (schedule_batch.py); beam search replaces them."""
        tickets = self._tickets.get(rid)
        if not tickets:
            return None
        params = getattr(req, "sampling_params", None) if req is not None else None
        if params is not None:
            ticket = next((t for t in tickets if t.params is params), None)
            if ticket is not None:
                return ticket
        finishing = self._finishing.get(rid, ())
        return next((t for t in tickets if not any(t is f for f in finishing)),
                    tickets[0] if finishing_too else None)

    def finish(self, rid: str, req=None) -> Optional[Ticket]:
        """The request finished: its ticket (None: it has none, e.g. a health check), now finishing; its ring
        room stays reserved until `drop(ticket)` or, for a record or marker handed to the finish worker (with
        its ticket), `release_reservation(rid, ticket)`."""
        rid = str(rid)
        ticket = self._find(rid, req, finishing_too=False)
        if ticket is not None and not any(ticket is f for f in self._finishing.get(rid, ())):
            self._finishing.setdefault(rid, collections.deque()).append(ticket)
        return ticket

    def take_decision(self, rid: str, req=None) -> Optional[tuple]:
        """(reason, marker reserved) of a finishing request admitted without capture; None: captured."""
        ticket = self.finish(rid, req)
        return None if ticket is None else ticket.decision

    def drop(self, ticket: Optional[Ticket]) -> None:
        """Give back a ticket's ring room (and forget its decision)."""
        if ticket is None:
            return
        for table in (self._tickets, self._finishing):
            entries = table.get(ticket.rid)
            if entries is not None:
                kept = [t for t in entries if t is not ticket]
                if table is self._tickets:
                    self._n_tickets -= len(entries) - len(kept)
                    self._reserved -= sum(t.nbytes for t in entries if t is ticket)
                    self._hold_charged -= sum(t.tokens for t in entries if t is ticket)
                    self.stats["hold_charged_tokens"] = self._hold_charged
                if not kept:
                    del table[ticket.rid]
                elif len(kept) != len(entries):
                    table[ticket.rid] = kept if table is self._tickets else collections.deque(kept)

    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def reserved(self) -> Dict[str, int]:
        """rid -> ring bytes reserved for its requests in flight (a snapshot)."""
        out = {rid: sum(t.nbytes for t in tickets) for rid, tickets in self._tickets.items()}
        return {rid: n for rid, n in out.items() if n}

    @property
    def decided(self) -> Dict[str, tuple]:
        """rid -> decision of its oldest request in flight admitted without capture (a snapshot)."""
        out = {}
        for rid, tickets in self._tickets.items():
            finishing = self._finishing.get(rid, ())
            for t in tickets:
                if t.decision is not None and not any(t is f for f in finishing):
                    out[rid] = t.decision
                    break
        return out

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
        known, held = (known_rids() if known_rids is not None else None), list(self.held)
        out = []
        for req in expired:
            rid = str(req.rid)
            if self._abort_takes_another(req, lambda: known, held):
                continue  # SGLang's abort matches by prefix: it would take a bystander with it
            message = (f"sglang-hs: request {rid} held {now - self.held_since[rid]:.0f}s by admission control: the "
                       f"hidden-state output ring stayed full (is the reader of {self.ring_name} running?); "
                       "raise --hs-ring-size or --hs-admission-timeout")
            out += self._refuse(req, message, 503)  # counted (failed) before it leaves `held`: unaccounted()
            self.held.remove(req)
        return out

    def _refuse(self, req, message: str, status_code: int) -> List:
        """`req` goes in followed by an AbortReq naming the reason: SGLang answers it from its waiting queue
        (HTTP `status_code`) before it ever runs. SGLang aborts by rid prefix: callers make sure no other
        live request's rid starts with this one."""
        from sglang.srt.managers.io_struct import AbortReq

        rid = str(req.rid)
        logger.error("%s", message)
        self.held_since.pop(rid, None)
        self.stats["failed"] += 1
        return [req, AbortReq(rid=rid, abort_message=message,
                              finished_reason={"type": "abort", "message": message, "status_code": status_code})]

    def release(self, rid: str, req=None) -> None:
        """Request `req` (rid `rid`) is done without a record handed to the finish worker (aborted, nothing
        to publish, published on the scheduler thread): its ticket goes. Never one already finishing: that
        one belongs to a request of the same rid whose record the finish worker still publishes."""
        self.drop(self._find(str(rid), req, finishing_too=False))

    def release_reservation(self, rid: str, ticket: Optional[Ticket]) -> None:
        """The finish worker published (or failed to publish) a record or marker of `rid`, handed over with
        `ticket`: that very ticket goes (None: the request had none left, e.g. reconciled away; then nothing
        goes: another request of that rid keeps its own)."""
        self.drop(ticket)
