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
