"""What the V4 overlay's DeepseekV4ForCausalLM.forward (sglang_hs/server/models/deepseek_v4.py) hands a DSpark draft
and its own store when a draft's target layers sit beside ours (--speculative-algorithm DSPARK): the inner model
captures the union of both sides' SGLang dspark ids once each, ascending; forward splits that capture back into our
layers (written to the store with the final states) and the draft's, handed to the logits processor as its aux
hidden states: each of the draft's layers as the streams' mean, in ascending id order whatever order the draft's
config names them, and no pre-hc-head state beside them (upstream hands a V4 MTP draft that state, a DSpark draft
its layers). The inner model's forward is a stand-in returning known per-layer streams (upstream's constructor builds
V4's CUDA-only attention), so the expectation is plain torch over those streams. The end-to-end judge of the same
handoff (every row against HF float32) is tests/e2e/test_v4_cpu.py::test_dspark_verify_passes_keep_only_committed_rows.
Planted bugs (scratch copies of deepseek_v4.py; each fails): the union split swapped (the draft's places taken as
ours) -> all four split cases, at the store's rows; the draft's layers in its config's order, not ascending -> the
disjoint cases (ids named [5, 3]), at the draft's aux states; the first stream handed for the streams' mean -> the
full-streams cases, at the draft's aux states; the pre-hc-head state handed beside the draft's layers -> all four,
at `before_norm is None`.
"""
import contextlib
import types

import pytest
import torch

HIDDEN, HC_MULT, LAYERS, TOKENS = 4, 4, 6, 5


@pytest.fixture(scope="module")
def v4_overlay(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.models import deepseek_v4 as upstream

        from sglang_hs.server.models import deepseek_v4 as ours
        from sglang_hs.server.patches import hc_full_streams
    return types.SimpleNamespace(RMSNorm=RMSNorm, upstream=upstream, ours=ours, hc_full_streams=hc_full_streams)


class _Recorder:
    """Stands in for the store's writer (copy) and the logits processor (a call): keeps what each was handed."""

    def __init__(self):
        self.calls = []

    def copy(self, rows, last, loc):
        self.calls.append(types.SimpleNamespace(rows=rows, last=last, loc=loc))

    def __call__(self, input_ids, hidden, lm_head, forward_batch, aux, hidden_states_before_norm=None):
        self.calls.append(types.SimpleNamespace(hidden=hidden, aux=aux, before_norm=hidden_states_before_norm))
        return "logits"


def _overlay(v4, monkeypatch, hs_layers, streams):
    """A bare overlay (no upstream constructor) set up for --hs-layers `hs_layers`, --hs-last both, --hs-hc-streams
    `streams`, as its _hs_setup_capture does (the packer widening of hc_full_streams left out: the inner model here
    is a stand-in)."""
    monkeypatch.setenv("SGLANG_HS_LAYERS", hs_layers)
    monkeypatch.setenv("SGLANG_HS_LAST", "both")
    monkeypatch.setenv("SGLANG_HS_HC_STREAMS", streams)
    monkeypatch.setattr(v4.hc_full_streams, "apply", lambda hc_mult: None)
    cls = v4.ours.DeepseekV4ForCausalLM
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    m.model = v4.upstream.DeepseekV4Model.__new__(v4.upstream.DeepseekV4Model)
    torch.nn.Module.__init__(m.model)
    m.model.norm = v4.RMSNorm(HIDDEN)
    m.config = types.SimpleNamespace(architectures=["DeepseekV4ForCausalLM"], num_hidden_layers=LAYERS,
                                     hidden_size=HIDDEN, hc_mult=HC_MULT, hc_pre_from_prev_sublayer=False)
    m._hs_setup_capture(m.config)
    m.pp_group = types.SimpleNamespace(is_last_rank=True)
    return m


def _known_streams(dspark_ids):
    """Per SGLang dspark id, the [T, hc_mult, H] streams the inner model captures there (distinct random values)."""
    g = torch.Generator().manual_seed(7)
    return {i: torch.randn(TOKENS, HC_MULT, HIDDEN, generator=g) for i in dspark_ids}


def _inner_output(streams_by_id, captured, mode, final_post, final_pre, pre_hc_head):
    """What the capturing inner model returns: ((hidden, pre_hc_head), aux), aux the captured layers in capture order
    (each its streams [hc_mult * H] under full, their mean [H] under mean), then the pre-norm final state."""
    per_layer = [streams_by_id[i].flatten(1) if mode == "full" else streams_by_id[i].mean(1) for i in captured]
    return (final_post, pre_hc_head), torch.cat(per_layer + [final_pre], dim=1)


def _forward(v4, monkeypatch, m, streams_by_id, mode):
    """Runs the overlay's forward over the stand-in inner model: (store writes, logits processor calls, finals)."""
    g = torch.Generator().manual_seed(8)
    post, pre = torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)
    pre_hc_head = torch.randn(TOKENS, HC_MULT * HIDDEN, generator=g)
    out = _inner_output(streams_by_id, m.model.hs_captured, mode, post, pre, pre_hc_head)
    m.model.forward = lambda *args: out
    m.prepare_language_model_inputs = lambda input_ids, forward_batch, input_embeds: (input_ids, input_embeds)
    monkeypatch.setattr(v4.upstream, "get_attn_tp_context", lambda: types.SimpleNamespace(
        maybe_input_scattered=lambda forward_batch: contextlib.nullcontext()))
    m.hs_status = types.SimpleNamespace(saw_aux=lambda shape: None)
    m.hs_writer, m.logits_processor, m.lm_head = _Recorder(), _Recorder(), object()
    batch = types.SimpleNamespace(out_cache_loc=torch.arange(TOKENS))
    assert m.forward(torch.arange(TOKENS), torch.arange(TOKENS), batch) == "logits"
    return m.hs_writer.calls, m.logits_processor.calls, (post, pre, pre_hc_head)


def _expected_store_rows(streams_by_id, ours, mode, post):
    """Our layers (ascending) as the store keeps them: every stream under full, the mean under mean; then the
    post-norm final state (--hs-last both: the pre-norm one rides apart)."""
    per_layer = [streams_by_id[i].flatten(1) if mode == "full" else streams_by_id[i].mean(1) for i in ours]
    return torch.cat(per_layer + [post], dim=1)


def _expected_draft_aux(streams_by_id, draft_ids):
    """The draft's layers as upstream hands them: ascending ids, each the streams' mean."""
    return torch.cat([streams_by_id[i].mean(1) for i in sorted(draft_ids)], dim=1)


# (--hs-layers, our SGLang dspark ids, the draft's dspark_target_layer_ids as its config names them, the union):
# partly overlapping (dspark id 3 both ours and the draft's; ours not contiguous in the union) and disjoint (the
# draft's ids named in descending order, after ours in the union)
CASES = {"overlapping": ("1,4", [0, 3], [1, 3, 5], [0, 1, 3, 5]),
         "disjoint": ("1,2", [0, 1], [5, 3], [0, 1, 3, 5])}


@pytest.mark.parametrize("mode", ["full", "mean"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_draft_gets_its_layers_mean_ascending_and_the_store_ours(v4_overlay, monkeypatch, case, mode):
    hs_layers, our_ids, draft_ids, union = CASES[case]
    m = _overlay(v4_overlay, monkeypatch, hs_layers, mode)
    assert list(m.hs_ours) == our_ids
    m.set_dspark_layers_to_capture(draft_ids)
    assert list(m.model.dspark_layers_to_capture) == union and list(m.model.hs_captured) == union
    streams_by_id = _known_streams(union)
    writes, handed, (post, pre, _) = _forward(v4_overlay, monkeypatch, m, streams_by_id, mode)
    assert len(writes) == 1 and len(handed) == 1
    torch.testing.assert_close(writes[0].rows, _expected_store_rows(streams_by_id, our_ids, mode, post),
                               rtol=0, atol=0, msg="the store's rows: our layers, then the post-norm state")
    torch.testing.assert_close(writes[0].last, pre, rtol=0, atol=0, msg="the store's pre-norm state")
    torch.testing.assert_close(handed[0].aux, _expected_draft_aux(streams_by_id, draft_ids), rtol=1e-6, atol=1e-6,
                               msg="the draft's aux hidden states: its layers' stream means, ascending")
    assert handed[0].before_norm is None, "a pre-hc-head state handed beside the DSpark draft's layers"
    torch.testing.assert_close(handed[0].hidden, post, rtol=0, atol=0)


def test_without_a_draft_the_pre_hc_head_state_is_handed_and_no_aux(v4_overlay, monkeypatch):
    """No DSpark draft (an MTP draft or none): the logits processor gets no aux states and the streams leaving the
    last layer (hc_head's input), as upstream's forward hands a V4 MTP draft; the store gets our layers."""
    m = _overlay(v4_overlay, monkeypatch, "1,4", "full")
    streams_by_id = _known_streams([0, 3])
    writes, handed, (post, pre, pre_hc_head) = _forward(v4_overlay, monkeypatch, m, streams_by_id, "full")
    torch.testing.assert_close(writes[0].rows, _expected_store_rows(streams_by_id, [0, 3], "full", post),
                               rtol=0, atol=0)
    assert handed[0].aux is None and handed[0].before_norm is pre_hc_head
