"""Harvesting from live traffic, without a server: which requests are captured (--hs-capture all|opt-in,
--hs-capture-sample P, by a stable hash of the rid), admission control serving requests without capture
(--hs-when-behind skip) instead of holding them, and the marker record a reader gets for a request that
has no record. Real SGLang io_struct messages and AdmissionControl, a stand-in ring."""
import math

import pytest
import torch

pytest.importorskip("sglang.srt.managers.io_struct", reason="needs SGLang installed")
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.admission import AdmissionControl, opted_in, sample_point, select  # noqa: E402
from sglang_hs.server.store.ring import record_bytes  # noqa: E402
from ring_stand_in import Ring  # noqa: E402

P, H, ELEM, PROMPT, NEW = 2, 64, 2, 30, 5


def _req(rid, custom_params=None):
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(5, 5 + PROMPT)), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=NEW, custom_params=custom_params),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.3, 0.5, 0.9])
def test_sampling_takes_the_fraction_within_binomial_bounds_and_is_reproducible(p):
    n = 20000
    rids = [f"req-{i}" for i in range(n)] + [f"chatcmpl-{i:032x}" for i in range(n)]
    for group in (rids[:n], rids[n:]):  # sequential ids and uuid-like ids alike
        taken = [r for r in group if select(_req(r), "opt-in", p) is None]
        sd = math.sqrt(n * p * (1 - p))
        assert abs(len(taken) - n * p) < 5 * sd, (p, len(taken))
        assert taken == [r for r in group if select(_req(r), "all", p) is None]  # same choice, any mode
    assert [sample_point(r) for r in rids[:100]] == [sample_point(r) for r in list(rids[:100])]
    # pinned: the choice must not change between versions, processes or machines (blake2b, not hash())
    assert sample_point("req-0") == int.from_bytes(__import__("hashlib").blake2b(b"req-0", digest_size=8).digest(),
                                                   "big") / 2.0 ** 64
    assert select(_req("x"), "all", 1.0) is None


@pytest.mark.parametrize("params, want", [
    ({"hs_capture": True}, True), ({"hs_capture": "true"}, True), ({"hs_capture": 1}, True),
    ({"hs_capture": "yes"}, True), ({"hs_capture": False}, False), ({"hs_capture": "0"}, False),
    ({"hs_capture": None}, False), ({"other": True}, False), (None, False), ({}, False)])
def test_opt_in_is_read_from_custom_params(params, want):
    assert opted_in(_req("a", params)) is want


def test_selection_matrix():
    yes, no = _req("r1", {"hs_capture": True}), _req("r1")
    assert select(no, "all", None) is None and select(yes, "all", None) is None
    assert select(no, "opt-in", None) == "not_opted_in" and select(yes, "opt-in", None) is None
    unsampled = next(r for r in (f"u{i}" for i in range(1000)) if sample_point(r) >= 0.3)
    sampled = next(r for r in (f"s{i}" for i in range(1000)) if sample_point(r) < 0.3)
    for mode in ("all", "opt-in"):
        assert select(_req(unsampled), mode, 0.3) == "not_sampled"
        assert select(_req(unsampled, {"hs_capture": True}), mode, 0.3) is None  # opted in: always
        assert select(_req(sampled), mode, 0.3) is None


def _adm(capacity, **kw):
    return AdmissionControl(Ring(capacity), P, H, ELEM, context_len=4096, **kw)


def _rids(out):
    return [m.rid for m in out]


def test_not_selected_requests_reserve_only_a_marker_and_are_never_held():
    adm = _adm(1 << 20, mode="opt-in")
    adm.ring.free = 0  # a full ring: nothing captured could enter
    out = adm.filter([_req("plain-1"), _req("plain-2")])
    assert _rids(out) == ["plain-1", "plain-2"] and not adm.held  # served at once
    assert adm.take_decision("plain-1") == ("not_opted_in", False)  # no room even for its marker
    assert adm.stats["skipped_not_opted_in"] == 2 and adm.stats["markers_dropped"] == 2
    adm.ring.free = 1 << 20
    out = adm.filter([_req("plain-3"), _req("in-1", {"hs_capture": True})])
    assert _rids(out) == ["plain-3", "in-1"]
    assert adm.reserved["plain-3"] == adm.marker_need("plain-3") == 2 * record_bytes(0, P, H, ELEM, 7)
    assert adm.reserved["in-1"] == adm.need(_req("in-1")) and "in-1" not in adm.decided
    ticket = adm.finish("plain-3")  # its marker is handed to the finish worker with its ticket
    assert ticket.decision == ("not_opted_in", True) and adm.take_decision("plain-3") is None
    adm.release_reservation("plain-3", ticket)  # published
    assert "plain-3" not in adm.reserved


@pytest.mark.parametrize("when_behind", ["hold", "skip"])
def test_a_full_ring_holds_or_skips(when_behind):
    need = 2 * record_bytes(PROMPT + NEW - 1, P, H, ELEM, 3)
    adm = _adm(10 * need, when_behind=when_behind)
    adm.ring.free = 2 * need + 1000  # two records (and a few markers) fit
    out = adm.filter([_req(f"r-{i}") for i in range(5)])
    assert _rids(out)[:2] == ["r-0", "r-1"] and adm.reserved["r-0"] == need == adm.reserved["r-1"]
    if when_behind == "hold":
        assert _rids(out) == ["r-0", "r-1"] and [h.rid for h in adm.held] == ["r-2", "r-3", "r-4"]
        assert adm.stats["skipped_reader_behind"] == 0 and not adm.decided
        return
    assert _rids(out) == [f"r-{i}" for i in range(5)] and not adm.held and adm.stats["admission_waits"] == 0
    assert adm.stats["skipped_reader_behind"] == 3
    marker = adm.marker_need("r-2")
    marked = [adm.decided[f"r-{i}"][1] for i in (2, 3, 4)]
    assert marked == [True] * (1000 // marker) + [False] * (3 - 1000 // marker)
    assert adm.stats["markers_dropped"] == marked.count(False)
    assert sum(adm.reserved.values()) <= 2 * need + 1000  # reservations never exceed the free ring
    # a captured request is never turned into a skipped one later: its reservation stays until it finishes
    adm.ring.free = 0
    adm.filter([])
    assert adm.reserved["r-0"] == need and "r-0" not in adm.decided
    # the reader catches up: new requests are captured again
    adm.ring.free = 10 * need
    adm.release("r-0"), adm.release("r-1")
    adm.filter([_req("r-5")])
    assert adm.reserved["r-5"] == need and "r-5" not in adm.decided


def test_decisions_of_requests_that_left_are_reconciled():
    adm = _adm(1 << 20, mode="opt-in")
    adm.filter([_req("gone"), _req("here")])
    adm.ring.free = 0
    adm.filter([_req("gone-unmarked"), _req("here-unmarked")])  # no room for their markers: no reservation
    assert adm.decided["gone-unmarked"] == ("not_opted_in", False)
    adm.filter([], known_rids=lambda: {"here", "here-unmarked"})
    assert not {"gone", "gone-unmarked"} & (set(adm.decided) | set(adm.reserved))
    assert {"here", "here-unmarked"} <= set(adm.decided)


def test_requests_not_captured_pass_a_captured_one_waiting_for_room():
    """Opt-in with hold: an opted-in request waiting for the reader holds back opted-in requests behind
    it (in order), never the requests that will not be captured."""
    need = 2 * record_bytes(PROMPT + NEW - 1, P, H, ELEM, 4)
    adm = _adm(10 * need, mode="opt-in")
    adm.ring.free = need // 2
    out = adm.filter([_req("in-1", {"hs_capture": True}), _req("plain-1"), _req("in-2", {"hs_capture": True}),
                      _req("plain-2"), _req("HEALTH_CHECK_9")])
    assert _rids(out) == ["plain-1", "plain-2", "HEALTH_CHECK_9"]
    assert [h.rid for h in adm.held] == ["in-1", "in-2"] and set(adm.held_since) == {"in-1", "in-2"}
    out = adm.filter([_req("plain-3")])
    assert _rids(out) == ["plain-3"] and [h.rid for h in adm.held] == ["in-1", "in-2"]
    adm.ring.free = 10 * need
    assert _rids(adm.filter([])) == ["in-1", "in-2"] and not adm.held


def test_a_reused_rid_is_captured_when_its_new_request_is():
    import types

    adm = _adm(1 << 20, mode="opt-in")
    adm.filter([_req("x")])  # not captured; say it was aborted while queued (no finish, no take_decision)
    new = _req("x", {"hs_capture": True})
    adm.filter([new])  # a new request with the same rid opts in
    finished = types.SimpleNamespace(rid="x", sampling_params=new.sampling_params)  # the scheduler's Req of it
    assert adm.take_decision("x", finished) is None
    assert adm.reserved["x"] == adm.need(_req("x")) + adm.marker_need("x")  # the old one's until the reconcile
    adm.filter([], known_rids=set)
    assert "x" not in adm.reserved
    adm.filter([_req("y")])
    adm.release_reservation("y", None)  # a "y" with no ticket left published before this one finished: no effect
    assert adm.take_decision("y") == ("not_opted_in", True)


def test_unmarked_decisions_are_reconciled_with_nothing_reserved():
    adm = _adm(1 << 20, mode="opt-in")
    adm.ring.free = 0
    adm.filter([_req("gone")])
    assert not adm.reserved and adm.decided["gone"] == ("not_opted_in", False)
    adm._last_reconcile = -1e9
    adm.filter([], known_rids=lambda: set())
    assert not adm.decided


def test_health_checks_are_never_held():
    adm = _adm(1 << 20)
    adm.ring.free = 0
    assert _rids(adm.filter([_req("HEALTH_CHECK_2")])) == ["HEALTH_CHECK_2"] and not adm.held


def test_health_checks_and_warmup_are_never_counted_as_skipped():
    adm = _adm(1 << 20, mode="opt-in")
    adm.filter([_req("HEALTH_CHECK_1"), _req("HS_WARMUP-abc")])
    assert not adm.decided and adm.stats["skipped_not_opted_in"] == 0


def test_marker_records_round_trip_and_reader_take_says_not_captured(tmp_path):
    from sglang_hs.reader import NotCaptured
    from sglang_hs.server.store.writer import CaptureWriter
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs import HiddenStateReader

    spec = CaptureSpec.resolve([1, 2], False, 4, 16)
    w = CaptureWriter(str(tmp_path), spec, 64, torch.float32, 1 << 16)
    w.store.copy_(torch.randn(w.store.shape))
    w.publish_marker("skipped-1", "not_sampled")
    w.publish_gathered("kept", torch.arange(3, dtype=torch.int32), torch.tensor([5, 6, 7]))
    w.publish_marker("skipped-2", "reader_behind")
    assert w.stats["markers"] == 2 and w.stats["records"] == 1
    recs = ring.RingReader.open(str(tmp_path), "ring-w0.bin").drain()
    assert [(r.rid, r.skipped, r.num_tokens) for r in recs] == [("skipped-1", 2, 0), ("kept", 0, 3), ("skipped-2", 3, 0)]
    w.publish_marker("skipped-3", "not_opted_in")
    w.publish_gathered("kept-2", torch.arange(2, dtype=torch.int32), torch.tensor([1, 2]))
    for ack in (False, True):
        reader = HiddenStateReader(str(tmp_path), ack=ack)
        if ack:
            w.publish_marker("skipped-4", "not_sampled")
        with pytest.raises(NotCaptured, match="not_opted_in") if not ack else pytest.raises(NotCaptured) as e:
            reader.take("skipped-3" if not ack else "skipped-4", timeout=5)
        if ack:
            assert e.value.reason == "not_sampled" and e.value.rid == "skipped-4"
            assert reader.unacked() == 0  # a marker holds no ring space
        else:
            rec = reader.take("kept-2", timeout=5)
            assert torch.equal(rec.aux_hidden_states, w.store[torch.tensor([1, 2])])
            # the marker answered that take: a later request of rid skipped-3 would get its own outcome
            assert reader.not_captured("skipped-3") is None and reader.markers == 1
        reader.close()
    assert w.ring.free_bytes() == w.ring.capacity


def test_a_marker_with_rows_or_an_unknown_reason_is_refused(tmp_path):
    w = ring.RingWriter.create(str(tmp_path), "r", 1 << 14)
    with pytest.raises(AssertionError):
        w.publish("x", torch.arange(2, dtype=torch.int32), torch.zeros(2, 1, 4), skipped=2)
    w.publish("x", torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, 4), skipped=2)
    # flip the flags to an unknown reason (and fix the CRC): the reader calls it corrupt, never a record
    import struct
    import zlib
    base = ring.HEADER_BYTES
    hdr = bytearray(bytes(w.r.buf[base:base + ring._REC.size].tolist()))
    struct.pack_into("<I", hdr, 4, 9)
    w._write(0, bytes(hdr))
    total = struct.unpack_from("<Q", hdr, 8)[0]
    trail = ring._TRAIL.pack(ring.REC_MAGIC, zlib.crc32(bytes(hdr) + b"x"), 1, total)
    w._write(total - ring.ALIGN, trail)
    with pytest.raises(ring.TornRecord, match="corrupt record header"):
        ring.RingReader.open(str(tmp_path), "r").drain()


def test_a_reused_rid_gets_its_new_record_and_markers_do_not_stop_the_timeout(tmp_path, monkeypatch):
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.reader import HiddenStateReader, NotCaptured
    from sglang_hs.server.store.writer import CaptureWriter

    spec = CaptureSpec.resolve([1], False, 4, 8)
    w = CaptureWriter(str(tmp_path), spec, 16, torch.float32, 1 << 16)
    w.publish_marker("again", "not_sampled")
    with HiddenStateReader(str(tmp_path)) as reader:
        reader.poll()
        assert reader.not_captured("again") == "not_sampled"
        w.publish_gathered("again", torch.arange(2, dtype=torch.int32), torch.tensor([3, 4]))
        reader.poll()
        # one outcome per request, oldest first: the first request's marker, then the second's record
        assert reader.not_captured("again") == "not_sampled" and reader.pop_ready("again") is None
        with pytest.raises(NotCaptured):
            reader.take("again", timeout=5)
        assert reader.not_captured("again") is None and reader.take("again", timeout=5).num_tokens == 2
        # markers arriving on every poll (a busy opt-in server) must not keep next() from timing out
        calls = []

        def busy_poll():  # a marker arrives on every poll
            calls.append(1)
            if len(calls) > 200000:
                raise AssertionError("the wait never checked its deadline while markers kept arriving")
            return 1

        monkeypatch.setattr(reader, "poll", busy_poll)
        with pytest.raises(TimeoutError):
            reader.next(timeout=0.01)
        with pytest.raises(TimeoutError):
            reader.take("never", timeout=0.01)
