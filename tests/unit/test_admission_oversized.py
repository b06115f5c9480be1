"""A request whose record the output ring could never take (issue 47, item 1): twice its worst case exceeds the
ring's capacity. Under --hs-when-behind hold it is refused at admission, status 400, in one line naming its
tokens, the bytes it needs, the capacity, the most tokens that fit and --hs-ring-size (before: admitted, its
record refused after it had run, the client none the wiser); under skip it is served without capture, marker
reason "oversized". Real SGLang io_struct messages, a stand-in ring."""
import re

import pytest

pytest.importorskip("sglang.srt.managers.io_struct", reason="needs SGLang installed")
from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_hs.server.store.admission import AdmissionControl  # noqa: E402
from sglang_hs.server.store.ring import SKIP_REASONS, record_bytes  # noqa: E402
from ring_stand_in import Ring  # noqa: E402

P, H, ELEM = 4, 7168, 2  # DeepSeek-V3: 3 aux layers + the final state, bf16
RING = 1 << 30


def _req(rid, prompt, max_new):
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(prompt)), input_embeds=None, mm_inputs=None, token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=max_new), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False)


def _adm(**kw):
    return AdmissionControl(Ring(RING), P, H, ELEM, context_len=163840, **kw)


def test_the_most_tokens_that_fit_is_exact():
    adm = _adm()
    fit = adm.max_tokens(len("r"))
    assert 2 * record_bytes(fit - 1, P, H, ELEM, 1) <= RING < 2 * record_bytes(fit, P, H, ELEM, 1)
    assert adm.need(_req("r", fit - 8, 8)) <= RING < adm.need(_req("r", fit - 7, 8))


def test_an_oversized_request_is_refused_at_once_naming_the_limit():
    adm = _adm()
    fit = adm.max_tokens(len("long"))
    small = _req("small", 100, 10)
    out = adm.filter([_req("long", 120000, 8000), small])
    assert [type(m).__name__ for m in out] == ["TokenizedGenerateReqInput", "AbortReq", "TokenizedGenerateReqInput"]
    abort = out[1]
    assert isinstance(abort, AbortReq) and abort.rid == "long" and out[2] is small
    reason = abort.finished_reason
    assert reason["status_code"] == 400 and reason["message"] == abort.abort_message
    message = abort.abort_message
    print(message)
    assert "\n" not in message and "128000 tokens" in message and "--hs-ring-size" in message
    assert f"capacity of {RING} bytes" in message and f"at most {fit} tokens fit" in message
    need = int(re.search(r"need (\d+) bytes", message).group(1))
    assert need == 2 * record_bytes(128000 - 1, P, H, ELEM, 4) > RING
    assert adm.stats["oversized"] == 1 and adm.stats["failed"] == 1 and not adm.held
    assert "long" not in adm.reserved and adm.unaccounted() == 1  # the small one's ticket only


def test_refused_even_while_captured_requests_wait_for_room():
    adm = _adm()
    adm.ring.free = 0
    out = adm.filter([_req("waits", 100, 10), _req("long", 200000, 1)])
    assert [m.rid for m in out] == ["long", "long"] and [h.rid for h in adm.held] == ["waits"]


def test_served_when_the_abort_would_take_a_bystander():
    """SGLang aborts by rid prefix: a refusal of "long" would abort "long-2" too, so "long" is served (its
    record refused later, as before) rather than taking a bystander with it."""
    adm = _adm()
    out = adm.filter([_req("long", 200000, 1)], known_rids=lambda: {"long-2"})
    assert [m.rid for m in out] == ["long"] and adm.stats["oversized"] == 1 and adm.stats["failed"] == 0


def test_skip_serves_it_without_capture_with_an_oversized_marker():
    assert SKIP_REASONS[8] == "oversized"
    adm = _adm(when_behind="skip")
    out = adm.filter([_req("long", 200000, 1)])
    assert [m.rid for m in out] == ["long"]
    assert adm.decided["long"] == ("oversized", True) and adm.reserved["long"] == adm.marker_need("long")
    assert adm.stats["skipped_oversized"] == 1 and adm.stats["oversized"] == 1 and adm.stats["failed"] == 0


def test_with_records_in_parts_a_long_request_reserves_its_first_part_and_fits():
    """--hs-record-part-size: a request whose record will leave the ring in parts reserves twice its first part
    (all its token ids and part_rows rows), so a 128K-token request fits a ring far smaller than its record; one
    whose record is at most a part reserves it whole, as before; --hs-capture-max-bytes still charges the whole
    record."""
    part_rows = (256 << 20) // (P * H * ELEM)
    adm = _adm(part_rows=part_rows, max_bytes=1 << 40)
    long, short = _req("long", 120000, 8000), _req("short", part_rows // 4 - 10, 10)
    assert adm.need(long) == 2 * record_bytes(part_rows, P, H, ELEM, 4, n_ids=128000 - 1) < RING
    assert adm.need(short) == 2 * record_bytes(part_rows // 4 - 1, P, H, ELEM, 5)
    out = adm.filter([long, short])
    assert out == [long, short] and adm.reserved == {"long": adm.need(long), "short": adm.need(short)}
    assert adm.stats["capture_bytes"] == record_bytes(128000 - 1, P, H, ELEM, 4) + record_bytes(part_rows // 4 - 1, P, H, ELEM, 5)
    assert _adm().need(long) > RING  # without parts: oversized


def test_a_later_part_takes_only_room_no_other_request_was_admitted_on():
    """part_room (the finish worker, before each part after the first): room beyond every OTHER request's reservation
    (its own counts as free: it is what the first part was admitted on), and while a part's room is taken admission
    sees it as gone."""
    part_rows = (256 << 20) // (P * H * ELEM)
    adm = _adm(part_rows=part_rows)
    a, b = _req("a", 120000, 8000), _req("b", 1000, 10)
    assert adm.filter([a, b]) == [a, b]
    ticket_a = adm.finish("a", a)
    others = adm.need(b)
    part = 2 * record_bytes(part_rows, P, H, ELEM, 1, n_ids=0)
    adm.ring.free = others + part - 1  # one byte short of a part beyond b's reservation
    assert not adm.part_room(part, ticket_a)
    adm.ring.free = others + part
    assert adm.part_room(part, ticket_a)
    c = _req("c", 10, 2)  # the part's room is taken: admission sees none left beyond b's
    assert adm.filter([c]) == [] and adm.held
    adm.part_room_done()
    adm.ring.free -= part // 2  # the part published (a part's record is half the room taken: room to wrap)
    assert adm.filter([]) == []  # a's own reservation stands until its record is done
    adm.release_reservation("a", ticket_a)
    assert adm.filter([]) == [c]
    assert adm.reserved_bytes() == sum(adm.reserved.values())


def test_records_in_parts_charge_their_worst_case_tokens_to_the_kv_hold_budget():
    """With records in parts a finished captured request's KV may be held until its record is gathered: the worst-case
    tokens (prompt + max_new_tokens) of the captured requests in flight stay within the hold budget, so a stalled reader
    never holds the whole pool; a request over it waits like one the ring cannot take (skip: served without capture),
    unless it is alone; uncaptured requests are never charged; a finished record gives its tokens back."""
    part_rows = (256 << 20) // (P * H * ELEM)

    def _adm(**kw):  # a ring with room for all of them: only the budget holds a request back
        return AdmissionControl(Ring(8 << 30), P, H, ELEM, context_len=163840, **kw)

    adm = _adm(part_rows=part_rows, hold_budget=100000)
    a, b, c = _req("a", 60000, 8000), _req("b", 30000, 2001), _req("c", 1000, 10)
    assert adm.filter([a, b, c]) == [a] and [r.rid for r in adm.held] == ["b", "c"]  # b over the budget: c waits too
    assert adm.stats["hold_charged_tokens"] == 68000
    ticket = adm.finish("a", a)
    adm.release_reservation("a", ticket)  # a's record gathered: its KV released, its tokens back
    assert adm.filter([]) == [b, c] and adm.stats["hold_charged_tokens"] == 32001 + 1010
    alone = _adm(part_rows=part_rows, hold_budget=100000)
    big = _req("big", 120000, 8000)
    assert alone.filter([big]) == [big]  # over the budget alone: let in (one request can always run)
    skip = _adm(part_rows=part_rows, hold_budget=100000, when_behind="skip")
    assert skip.filter([a, b]) == [a, b] and skip.stats["skipped_reader_behind"] == 1  # b served without capture
    assert skip.stats["hold_charged_tokens"] == 68000


def test_with_records_in_parts_the_most_tokens_that_fit_counts_the_first_part():
    """The refusal's "at most N tokens fit" under --hs-record-part-size: the limit is the first part's (every token
    id and part_rows rows), far beyond a whole record's; before, it named the whole record's limit."""
    part_rows = (64 << 20) // (P * H * ELEM)
    ring = 1 << 28
    adm = AdmissionControl(Ring(ring), P, H, ELEM, context_len=1 << 26, part_rows=part_rows)
    fit = adm.max_tokens(len("r"))
    assert fit > 8 * (ring // (2 * P * H * ELEM))  # many times what a whole record allows
    assert adm.need(_req("r", fit - 8, 8)) <= ring < adm.need(_req("r", fit - 7, 8))
    out = adm.filter([_req("r", fit - 7, 8)])
    assert type(out[1]).__name__ == "AbortReq" and f"at most {fit} tokens fit" in out[1].abort_message
    assert "(twice its first part, which holds every token id)" in out[1].abort_message
