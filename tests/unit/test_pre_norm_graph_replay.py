"""--hs-last pre-norm/both under SGLang's prefill CUDA graphs, replayed the way the runner replays them.

The breakable and full prefill graph backends capture the inner model's forward alone
(`prefill_cuda_graph_runner._resolve_transformer_layer_model`: the module with `layers`, here the overlay's
`_CapturingDeepseekModel`). At replay they set `layer_model.forward` to a function that replays the graph
and returns its output buffers, then run the outer `ForCausalLM.forward` eagerly: none of the inner
forward's Python runs. So the pre-norm final state must travel in what the inner forward returns; state
left on a module during capture is not refreshed by a replay (the first replay would take it, every later
one would find nothing and stop the server).

Here the inner forward is run once as the capture, its outputs become the static buffers, each replay
writes new values into them in place (as a graph replay does) and the outer forward runs with the inner
`forward` swapped out, as in `_execute_layer_graph`. Every replay's rows must reach the store.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec

H, LAYERS, N_LAYERS = 8, [1, 2], 4


class Norm(torch.nn.Module):
    """An RMSNorm with a weight that is not one, called as upstream's final norm is: norm(x, residual)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, H))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out if residual is None else (out, x)


def _batch(T):
    return SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), out_cache_loc=torch.arange(1, T + 1),
                           out_cache_loc_virtual=None, rids=None)


@pytest.mark.parametrize("last", ["pre-norm", "both"])
def test_every_replay_of_a_prefill_graph_carries_its_own_pre_norm_state(overlay_module, monkeypatch, last):
    m = overlay_module
    spec = CaptureSpec.resolve(LAYERS, last, N_LAYERS, H)
    T = 3
    state = {"x": torch.randn(T, H), "residual": torch.randn(T, H), "aux": torch.randn(T, len(LAYERS) * H)}

    def upstream_forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden, _ = self.norm(state["x"], state["residual"])  # the final norm, residual kept apart
        return hidden, state["aux"].clone()

    monkeypatch.setattr(m.OriginalDeepseekV2Model, "forward", upstream_forward)
    monkeypatch.setattr(m.upstream, "get_attn_tp_context", lambda: SimpleNamespace(
        maybe_input_scattered=lambda fb: contextlib.nullcontext()))

    inner = object.__new__(m._CapturingDeepseekModel)
    torch.nn.Module.__init__(inner)
    inner.norm = Norm()
    inner.hs_spec, inner.hs_captured = spec, tuple(spec.layers)  # as _hs_setup_capture sets them
    m._pre_norm_capturing(inner.norm)

    outer = object.__new__(m.DeepseekV3ForCausalLM)
    torch.nn.Module.__init__(outer)
    outer.model = inner
    outer.hs_spec, outer._hs_hang_in_warmup = spec, False
    outer.hs_status = SimpleNamespace(saw_aux=lambda *a: None)
    written = []
    outer.hs_writer = SimpleNamespace(copy=lambda rows, last_rows, loc: written.append((rows.clone(), None if
                                                                                       last_rows is None else
                                                                                       last_rows.clone())))
    outer.logits_processor = lambda ids, hidden, head, fb, aux: hidden
    outer.lm_head = None
    ids, pos = torch.zeros(T, dtype=torch.long), torch.arange(T)

    static = inner(ids, pos, _batch(T))  # the capture: its outputs are the graph's static buffers

    reference_norm = Norm()

    def replay(*args, **kwargs):  # what the runner puts in place of layer_model.forward: no module code runs
        pre = state["x"] + state["residual"]
        static[0].copy_(reference_norm(pre))  # the graph writes every output buffer of the capture in place
        static[1].copy_(torch.cat([state["aux"], pre], dim=1)[:, :static[1].shape[1]])
        return static

    inner.forward = replay
    for step in range(3):  # several replays, each with new values
        state.update(x=torch.randn(T, H), residual=torch.randn(T, H), aux=torch.randn(T, len(LAYERS) * H))
        outer.forward(ids, pos, _batch(T))
        rows, last_rows = written[-1]
        pre = state["x"] + state["residual"]
        post = Norm()(pre)
        want = [state["aux"]] + ([post] if last == "both" else [])
        torch.testing.assert_close(rows, torch.cat(want, dim=1), rtol=0, atol=1e-6, msg=f"step {step}: layers")
        torch.testing.assert_close(last_rows, pre, rtol=0, atol=1e-6, msg=f"step {step}: pre-norm state")
