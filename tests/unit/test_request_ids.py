"""Request ids as clients send them: longer than a record can name (refused at admission with a 400 naming
the limit, single requests and batch members alike), and used again while an older request with that rid
is still in flight or still being published (a retry, a duplicate): each request keeps its own
reservation and decision, released by its own finish, and the reader answers each request of a rid with
its own outcome (record or marker), oldest first. Real SGLang io_struct messages and AdmissionControl, a
stand-in ring; the reader reads a real ring written by CaptureWriter."""
import copy
import gc

import pytest
import torch

pytest.importorskip("sglang.srt.managers.io_struct", reason="needs SGLang installed")
from sglang.srt.managers.io_struct import (  # noqa: E402
    AbortReq,
    BatchTokenizedGenerateReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_hs.server.store.admission import AdmissionControl  # noqa: E402
from sglang_hs.server.store.ring import MAX_RID_BYTES  # noqa: E402
from ring_stand_in import Ring  # noqa: E402

P, H, ELEM = 2, 64, 2


def _req(rid, prompt=30, new=5, custom_params=None):
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(5, 5 + prompt)), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=new, custom_params=custom_params),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


class Finished:
    """What the finish hook hands admission: the scheduler's Req, which holds the message's sampling params."""

    def __init__(self, msg):
        self.rid, self.sampling_params = msg.rid, msg.sampling_params


def _adm(capacity=1 << 30, **kw):
    return AdmissionControl(Ring(capacity), P, H, ELEM, context_len=4096, **kw)


# --- item 3: a rid longer than a record header can hold ------------------------------------------------
def _members(out):
    return [r for m in out for r in (m.batch if isinstance(m, BatchTokenizedGenerateReqInput) else [m])
            if isinstance(r, TokenizedGenerateReqInput)]


def _check_aborts(out, rids, message):
    """Each of `rids` goes in right before its own AbortReq, status 400, a message naming the limit."""
    aborts = [(i, m) for i, m in enumerate(out) if isinstance(m, AbortReq)]
    assert [m.rid for _, m in aborts] == rids
    for i, abort in aborts:
        prev = out[i - 1]
        assert (prev.batch[-1] if isinstance(prev, BatchTokenizedGenerateReqInput) else prev).rid == abort.rid
        assert abort.finished_reason["status_code"] == 400 and abort.finished_reason["message"] == abort.abort_message
        assert message in abort.abort_message and "at most 65535 bytes" in abort.abort_message
        assert len(abort.abort_message) < 300  # names the length, does not echo the rid


def test_a_rid_longer_than_a_record_can_name_is_refused_with_a_400_naming_the_limit():
    adm = _adm()
    longest, too_long = "a" * MAX_RID_BYTES, "b" * (MAX_RID_BYTES + 1)
    wide = "é" * (MAX_RID_BYTES // 2 + 1)  # 65,536 bytes of utf-8 in 32,768 characters
    reqs = [_req("before"), _req(too_long), _req(longest), _req(wide), _req("after")]
    out = adm.filter(reqs)
    assert sorted(r.rid for r in _members(out)) == sorted(r.rid for r in reqs)  # every one goes in, none is held
    _check_aborts(out, [too_long, wide], "request id of 65536 bytes")
    assert set(adm.reserved) == {"before", longest, "after"} and adm.stats["failed"] == 2 and not adm.held


def test_a_batch_holding_a_too_long_rid_is_refused_whole_and_one_without_goes_in():
    """The client gets one answer for a batched /generate: a member's rid too long refuses every member (no
    record is made for a request whose client got a 400), except one whose abort would take a bystander
    (its rid prefixes a live request's: SGLang aborts by prefix). A batch of rids at the limit goes in whole."""
    adm = _adm()
    ok = BatchTokenizedGenerateReqInput(batch=[_req("ok-0"), _req("a" * MAX_RID_BYTES)])
    out = adm.filter([ok])
    assert out == [ok] and not adm.stats["failed"]
    batch = BatchTokenizedGenerateReqInput(batch=[_req("m-0"), _req("b" * (MAX_RID_BYTES + 1)), _req("m-2"),
                                                  _req("ok")])  # "ok" prefixes the live "ok-0"
    out = adm.filter([batch], known_rids=lambda: {"ok-0"})
    assert sorted(r.rid for r in _members(out)) == sorted(r.rid for r in batch.batch)
    _check_aborts(out, ["m-0", "b" * (MAX_RID_BYTES + 1), "m-2"], "request id of 65536 bytes")
    assert "in its batch" in next(m for m in out if isinstance(m, AbortReq)).abort_message
    assert "ok" in adm.reserved and "m-0" not in adm.reserved and not adm.held


def test_a_member_whose_abort_would_take_a_live_duplicate_of_its_rid_is_not_refused():
    """SGLang aborts by rid prefix, and a rid is a prefix of itself: refusing the batch member "dup" while
    another request "dup" is live (or held) would abort that one too. Only the member itself is left out of
    the bystander check, by identity (before: by equal rid, so live duplicates were not seen)."""
    long_rid = "b" * (MAX_RID_BYTES + 1)
    for live, held_first in (({"dup"}, False), (set(), True)):
        adm = _adm()
        before = []
        if held_first:  # a "dup" waits in admission (the ring is full for it) when the batch arrives
            adm.ring.free = 0
            before = [_req("dup")]
            assert adm.filter(before) == [] and [h.rid for h in adm.held] == ["dup"]
            adm.ring.free = adm.ring.capacity
        batch = BatchTokenizedGenerateReqInput(batch=[_req("m-0"), _req(long_rid), _req("dup")])
        out = adm.filter([batch], known_rids=lambda: live)
        _check_aborts(out, ["m-0", long_rid], "request id of 65536 bytes")
        assert sorted(r.rid for r in _members(out)) == sorted(["m-0", long_rid, "dup"] + ["dup"] * held_first)
        assert adm.reserved == {"dup": (1 + held_first) * adm.need(_req("dup"))} and not adm.held


def test_a_held_request_past_the_time_limit_is_not_failed_into_a_live_duplicate(monkeypatch):
    import types

    import sglang_hs.server.store.admission as admission_mod

    t = [1000.0]
    monkeypatch.setattr(admission_mod, "time", types.SimpleNamespace(monotonic=lambda: t[0]))
    adm = _adm(timeout=30)
    adm.ring.free = 0
    assert adm.filter([_req("dup")]) == []
    t[0] += 31
    assert adm.filter([], known_rids=lambda: {"dup"}) == []  # its abort would take the live "dup"
    assert [h.rid for h in adm.held] == ["dup"]
    out = adm.filter([], known_rids=set)  # that one is gone: now it fails
    assert [getattr(m, "rid", None) for m in out] == ["dup", "dup"] and isinstance(out[1], AbortReq)


def test_a_refused_batch_aborted_in_the_same_pull_leaves_nothing_that_refuses_a_later_request():
    """A batch holding a too long rid and an abort of everything arrive in one pull. Before, each member was
    flagged by id() to be refused later and the abort took the held members in without clearing the flags:
    a later, unrelated request allocated at a freed member's address got a 400 (CPython reuses addresses)."""
    import gc

    adm = _adm()
    rids = [f"m-{i}" for i in range(8)] + ["b" * (MAX_RID_BYTES + 1)]
    out = adm.filter([BatchTokenizedGenerateReqInput(batch=[_req(r) for r in rids]), AbortReq(abort_all=True)])
    assert sorted(r.rid for r in _members(out)) == sorted(rids)
    assert all(isinstance(m, AbortReq) for m in out[1::2])  # each member goes in before its own abort
    del out
    gc.collect()
    for i in range(200):  # fresh requests: some are allocated where the batch's members were
        innocent = _req(f"innocent-{i}")
        out = adm.filter([innocent])
        assert out == [innocent], f"innocent-{i} refused: {[getattr(m, 'abort_message', m) for m in out]}"
        adm.release(innocent.rid, Finished(innocent))
        del out, innocent
    assert adm.reserved_bytes() == 0 and adm.stats["failed"] == len(rids)


# --- item 6: rids used again -------------------------------------------------------------------------
def test_a_retry_while_the_old_record_is_being_published_keeps_its_own_reservation():
    """A finishes and is handed to the finish worker; its client retries with the same rid (B, larger)
    before the worker published A. A's publish releases A's reservation, not B's (before: B's
    reservation replaced A's, and A's release dropped it, so B ran with nothing reserved)."""
    adm = _adm()
    a, b = _req("x", prompt=30), _req("x", prompt=300)
    adm.filter([a])
    ticket_a = adm.finish("x", Finished(a))  # captured; handed to the worker with its ticket
    assert ticket_a.decision is None
    adm.filter([b])
    assert adm.reserved_bytes() == adm.need(a) + adm.need(b)
    adm.release_reservation("x", ticket_a)  # the worker published A's record
    assert adm.reserved == {"x": adm.need(b)}
    ticket_b = adm.finish("x", Finished(b))
    assert ticket_b is not ticket_a and ticket_b.decision is None
    adm.release_reservation("x", ticket_b)
    assert adm.reserved == {} and adm.reserved_bytes() == 0


def test_duplicates_in_flight_find_their_own_decision_and_reservation_in_any_finish_order():
    """Two requests with one rid in flight, one captured (opted in), one not: whichever finishes first gets
    its own decision (a record, or a marker), and the worker's releases drop the tickets it was handed."""
    for first in ("plain", "opted"):
        adm = _adm(mode="opt-in")
        plain, opted = _req("d"), _req("d", prompt=200, custom_params={"hs_capture": True})
        adm.filter([plain, opted])
        marker, need = adm.marker_need("d"), adm.need(opted)
        assert adm.reserved_bytes() == marker + need
        order = [plain, opted] if first == "plain" else [opted, plain]
        want = {id(plain): ("not_opted_in", True), id(opted): None}
        handed = []
        for msg in order:  # both finish and are handed to the worker before it publishes either
            handed.append(adm.finish("d", Finished(msg)))
            assert handed[-1].decision == want[id(msg)]
        adm.release_reservation("d", handed[0])  # the first handed over is published first
        assert adm.reserved_bytes() == (need if first == "plain" else marker)
        adm.release_reservation("d", handed[1])
        assert adm.reserved_bytes() == 0 and not adm.reserved and not adm.decided


def test_a_ticketless_request_never_releases_a_ticket_the_finish_worker_still_needs():
    """A is handed to the finish worker; B, a request of the same rid with no ticket left (reconciled away, or
    one a finish could not match), is aborted, then another finishes and is handed over ticketless. Neither
    may take A's reservation while A's record is still to be published (before: release() and the worker's
    release by rid order dropped A's ticket: reserved == {} while A was pending, and admission over-committed)."""
    adm = _adm()
    a, b = _req("x", prompt=30), _req("x", prompt=300)
    adm.filter([a])
    ticket_a = adm.finish("x", Finished(a))  # handed to the worker
    adm.release("x", Finished(b))  # B aborted: it has no ticket of its own
    assert adm.reserved == {"x": adm.need(a)}
    c = _req("x", prompt=40)
    ticket_c = adm.finish("x", Finished(c))  # C (never admitted here) finishes: nothing of its own either
    assert ticket_c is None
    adm.release_reservation("x", ticket_c)  # the worker published C's record first
    assert adm.reserved == {"x": adm.need(a)}
    adm.release_reservation("x", ticket_a)
    assert adm.reserved_bytes() == 0


class CopiedReq:
    """The scheduler's Req as SGLang 0.5.23 makes it for a request with a custom logit processor and a dict
    custom_params (Req.__init__, schedule_batch.py): a shallow copy of the message's sampling params,
    custom_params extended with "__req__". The message, and with it the params admission saw, then die."""

    def __init__(self, msg):
        params = copy.copy(msg.sampling_params)
        params.custom_params = params.custom_params | {"__req__": None}
        self.rid, self.sampling_params = msg.rid, params


def test_a_finish_never_takes_another_requests_ticket_through_a_reused_params_address():
    """A (opted in: captured) and B (not: a marker) share a rid; the scheduler's Reqs hold copies of their
    params. A finishes first (no identity match: its rid's oldest ticket, A's own). B's copy is then made at
    the address of A's freed params: before, the ticket table keyed by id() matched it to A's ticket, so B
    took A's decision (a record where a marker had room reserved) and B's own ticket leaked."""
    adm = _adm(mode="opt-in")
    a = _req("d", custom_params={"hs_capture": True})
    b = _req("d", custom_params={"other": 1})
    adm.filter([a, b])
    addr = id(a.sampling_params)
    req_a = CopiedReq(a)
    del a
    gc.collect()
    ticket_a = adm.finish("d", req_a)
    assert ticket_a.decision is None  # captured: A's own
    kept = []  # a copy of B's params where A's were, if that address is free (CPython reuses it)
    for _ in range(1000):
        req_b = CopiedReq(b)
        if id(req_b.sampling_params) == addr:
            break
        kept.append(req_b)
    ticket_b = adm.finish("d", req_b)
    assert ticket_b is not ticket_a and ticket_b.decision == ("not_opted_in", True)
    adm.release_reservation("d", ticket_a)
    adm.release_reservation("d", ticket_b)
    assert adm.reserved_bytes() == 0 and not adm.decided


def test_an_aborted_duplicate_releases_its_own_ticket_and_a_reconcile_keeps_a_live_rid():
    adm = _adm()
    a, b = _req("y", prompt=30), _req("y", prompt=400)
    adm.filter([a, b])
    adm.release("y", Finished(b))  # B aborted (the finish hook's abort path): A's reservation stays
    assert adm.reserved == {"y": adm.need(a)}
    adm.filter([], known_rids=lambda: {"y"})
    assert adm.reserved == {"y": adm.need(a)}
    adm.release("y", Finished(a))
    assert adm.reserved_bytes() == 0


def test_reader_answers_each_request_of_a_reused_rid_with_its_own_outcome(tmp_path):
    """Request A of rid "z" is served without capture (its marker), then B with the same rid is captured.
    take("z") answers A (NotCaptured) and then B (its record); once A was answered, a take for B waits for
    B's record instead of repeating A's marker (before: it raised NotCaptured at once, forever)."""
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.reader import HiddenStateReader, NotCaptured
    from sglang_hs.server.store.writer import CaptureWriter

    spec = CaptureSpec.resolve([1], False, 4, 8)
    w = CaptureWriter(str(tmp_path), spec, 16, torch.float32, 1 << 16)
    w.store.copy_(torch.randn(w.store.shape))
    with HiddenStateReader(str(tmp_path)) as reader:
        w.publish_marker("z", "reader_behind")
        reader.poll()
        assert reader.not_captured("z") == "reader_behind" and reader.pop_ready("z") is None
        with pytest.raises(NotCaptured, match="reader_behind"):
            reader.take("z", timeout=5)
        assert reader.not_captured("z") is None
        with pytest.raises(TimeoutError):  # B's record is not published yet: wait for it, no stale marker
            reader.take("z", timeout=0.05)
        w.publish_gathered("z", torch.arange(3, dtype=torch.int32), torch.tensor([4, 5, 6]))
        rec = reader.take("z", timeout=5)
        assert torch.equal(rec.aux_hidden_states, w.store[torch.tensor([4, 5, 6])])
        # a record, then a marker, then a record, all of one rid: answered in that order
        w.publish_gathered("z", torch.arange(2, dtype=torch.int32), torch.tensor([1, 2]))
        w.publish_marker("z", "not_sampled")
        w.publish_gathered("z", torch.arange(1, dtype=torch.int32), torch.tensor([7]))
        assert reader.take("z", timeout=5).num_tokens == 2
        with pytest.raises(NotCaptured, match="not_sampled"):
            reader.take("z", timeout=5)
        assert reader.take("z", timeout=5).num_tokens == 1
        with pytest.raises(TimeoutError):
            reader.take("z", timeout=0.05)
