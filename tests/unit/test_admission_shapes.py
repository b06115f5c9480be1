"""Request shapes admission decides at the door (sglang_hs/server/store/admission.py), with real SGLang io_struct
messages and a stand-in ring: a beam-search request and one sent as input_embeds are served without
capture, their marker reserved like a record (held while the ring has no room for it under
--hs-when-behind hold), and the prefix request SGLang sends before the choices of an n > 1 request
(tagged by sglang_hs/server/patches/parallel_sampling.py) gets no record and no marker. Before: all three were
captured (the beam one with zeros as token ids, the prefix one as a record nobody asked for)."""
import types

import pytest

pytest.importorskip("sglang.srt.managers.io_struct", reason="needs SGLang installed")
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_hs.server.patches import parallel_sampling  # noqa: E402
from sglang_hs.server.store.admission import PARALLEL_SAMPLING_PREFIX, AdmissionControl, unrecordable  # noqa: E402
from sglang_hs.server.store.ring import SKIP_REASONS  # noqa: E402
from ring_stand_in import Ring  # noqa: E402

P, H, ELEM = 2, 64, 2


def _req(rid, embeds=None, **params):
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(5, 35)), input_embeds=embeds, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=5, **params),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


def _adm(capacity, **kw):
    return AdmissionControl(Ring(capacity), P, H, ELEM, context_len=4096, **kw)


def test_reasons_are_ring_marker_codes():
    assert {"beam_search", "input_embeds"} <= set(SKIP_REASONS.values())
    assert unrecordable(_req("b", beam_width=2)) == "beam_search"
    assert unrecordable(_req("b1", beam_width=1)) is None and unrecordable(_req("p")) is None
    assert unrecordable(_req("e", embeds=[[0.0] * 4] * 30)) == "input_embeds"


@pytest.mark.parametrize("mode", ["all", "opt-in"])
def test_beam_and_embeds_are_served_uncaptured_with_their_marker_reserved(mode):
    adm = _adm(1 << 20, mode=mode)
    out = adm.filter([_req("beam", beam_width=3, custom_params={"hs_capture": True}),
                      _req("emb", embeds=[[0.0] * 4] * 30), _req("plain", custom_params={"hs_capture": True})])
    assert [m.rid for m in out] == ["beam", "emb", "plain"]
    assert adm.decided["beam"] == ("beam_search", True) and adm.decided["emb"] == ("input_embeds", True)
    assert adm.reserved["beam"] == adm.marker_need("beam") and adm.reserved["emb"] == adm.marker_need("emb")
    assert "plain" not in adm.decided and adm.reserved["plain"] == adm.need(_req("plain"))
    assert adm.stats["skipped_beam_search"] == 1 and adm.stats["skipped_input_embeds"] == 1
    assert adm.take_decision("beam") == ("beam_search", True)


def test_a_beam_request_waits_for_room_for_its_marker_or_goes_unmarked_when_skipping():
    adm = _adm(1 << 20)
    adm.ring.free = 0
    assert adm.filter([_req("beam", beam_width=2)]) == [] and [h.rid for h in adm.held] == ["beam"]
    adm.ring.free = 1 << 20
    assert [m.rid for m in adm.filter([])] == ["beam"] and adm.decided["beam"] == ("beam_search", True)
    skip = _adm(1 << 20, when_behind="skip")
    skip.ring.free = 0
    assert [m.rid for m in skip.filter([_req("beam", beam_width=2)])] == ["beam"]
    assert skip.decided["beam"] == ("beam_search", False) and skip.stats["markers_dropped"] == 1


def test_the_parallel_sampling_prefix_request_gets_no_record_and_no_marker():
    adm = _adm(1 << 20)
    adm.ring.free = 0  # never held either: it reserves nothing
    prefix = _req("uuid-prefix", custom_params={"hs_capture": True})
    prefix.sampling_params.max_new_tokens = 0
    shared = prefix.sampling_params.custom_params
    parallel_sampling.tag(prefix.sampling_params)
    assert shared == {"hs_capture": True}  # the choices' dict (shared by SGLang's shallow copy) untouched
    out = adm.filter([prefix])
    assert [m.rid for m in out] == ["uuid-prefix"] and not adm.held and "uuid-prefix" not in adm.reserved
    assert adm.take_decision("uuid-prefix") == (PARALLEL_SAMPLING_PREFIX, False)  # no marker published


def test_prefix_tagging_in_the_tokenizer_manager_tags_only_the_prefix_sends():
    """The patch's two wrappers on a stand-in manager: an n > 1 batch of 2 prompts sends 2 prefix requests
    (max_new_tokens 0) then 2 x n choices; only the first two are tagged. An n = 1 request is left alone,
    also one that asks for max_new_tokens 0 itself."""
    import asyncio

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    originals = (TokenizerManager._handle_batch_request, TokenizerManager._send_one_request)
    sent = []

    async def send(self, obj):
        sent.append(obj)

    async def handle(self, obj, request, request_states):
        for i in range(obj.batch_size):
            sp = SamplingParams(max_new_tokens=0)
            await self._send_one_request(types.SimpleNamespace(sampling_params=sp))
        for i in range(obj.batch_size * obj.parallel_sample_num):
            await self._send_one_request(types.SimpleNamespace(sampling_params=SamplingParams(max_new_tokens=0)))
        yield "done"

    TokenizerManager._handle_batch_request, TokenizerManager._send_one_request = handle, send
    try:
        parallel_sampling.apply()

        async def run(obj):
            return [x async for x in TokenizerManager._handle_batch_request(object.__new__(TokenizerManager), obj,
                                                                            None, {})]

        asyncio.run(run(types.SimpleNamespace(batch_size=2, parallel_sample_num=3)))
        asyncio.run(run(types.SimpleNamespace(batch_size=2, parallel_sample_num=1)))
    finally:
        TokenizerManager._handle_batch_request, TokenizerManager._send_one_request = originals
    tagged = [bool((o.sampling_params.custom_params or {}).get("sglang_hs_internal")) for o in sent]
    assert tagged == [True, True] + [False] * 6 + [False] * 4
