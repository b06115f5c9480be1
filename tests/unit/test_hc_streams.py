"""DeepSeek-V4's hyper-connection streams, captured at SGLang's own DSpark capture sites, against HF float32.

A tiny DeepseekV4ForCausalLM (HF transformers 5.19, float32, random norm weights, hidden 88, 4 streams,
3 layers of each attention kind) is run on a 23-token prompt with output_hidden_states. Its streams
entering each layer are handed to what SGLang 0.5.23's DeepseekV4Model.forward runs at a capture site,
`mhc_stream_mean(x, out=packer.slot(x[:, 0]))` with upstream's AuxHiddenStatePacker (as the module global
the forward looks up), and the packed aux is judged row by row against tests/reference.hc_rows_ref:
the default (mean, upstream unpatched) and --hs-hc-streams full (patches/hc_full_streams.py applied).
End to end: tests/e2e/test_v4_cpu.py on the CPU engine (sliding-window layers, through sglang-hs's patches) and
tests/gpu/test_v4_capture_gpu.py on a GPU.
"""
import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from reference import hc_rows_ref

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def hf_streams():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from sglang_hs.tools.tiny_model import randomise_norms

    torch.manual_seed(0)
    cfg = DeepseekV4Config(vocab_size=300, hidden_size=88, moe_intermediate_size=40, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=24,
                           num_experts_per_tok=2, n_routed_experts=6, n_shared_experts=1, hc_mult=4, o_groups=2,
                           o_lora_rank=24, index_n_heads=2, index_head_dim=32, index_topk=4, sliding_window=8,
                           num_nextn_predict_layers=0, max_position_embeddings=512)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomise_norms(model, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (1, 23))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    states = [h[0] for h in hs]
    assert [tuple(s.shape) for s in states[:-1]] == [(23, 4, 88)] * 6 and tuple(states[-1].shape) == (23, 88)
    return states


@pytest.fixture
def v4_modules(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.kernels.ops.layernorm import mhc
        from sglang.srt.models import deepseek_v4

        from sglang_hs.server.patches import hc_full_streams
    yield mhc, deepseek_v4, hc_full_streams
    hc_full_streams.restore()


def _capture(deepseek_v4, mhc, states, layers):
    """What DeepseekV4Model.forward does at its capture sites, for one forward of these layers' inputs."""
    packer = deepseek_v4.AuxHiddenStatePacker(len(layers))
    for i in layers:
        x = states[i]
        mhc.mhc_stream_mean(x, out=packer.slot(x[:, 0]))
    return packer.finalize()


def _judge(aux, ref, spec):
    T, H = ref.shape[0], spec.hidden_size
    assert aux.shape == (T, spec.num_aux * H)
    rows = aux.view(T, spec.num_aux, H)
    diff = (rows - ref).abs()
    print(f"max {diff.max().item():.3g} mean {diff.mean().item():.3g}")
    for t in range(T):  # per row: a neighbour token's or layer's row is far off
        for r in range(spec.num_aux):
            torch.testing.assert_close(rows[t, r], ref[t, r], rtol=0, atol=1e-6,
                                       msg=f"token {t} row {r}")


def test_default_is_sglangs_stream_mean_of_hf_streams(hf_streams, v4_modules):
    mhc, deepseek_v4, _ = v4_modules
    spec = CaptureSpec.resolve(LAYERS, None, 6, 88, hc_mult=4)
    aux = _capture(deepseek_v4, mhc, hf_streams, LAYERS)
    _judge(aux, hc_rows_ref(hf_streams, LAYERS, "mean"), spec)


def test_full_streams_are_hf_streams_row_by_row(hf_streams, v4_modules):
    mhc, deepseek_v4, hc_full_streams = v4_modules
    spec = CaptureSpec.resolve(LAYERS, None, 6, 88, hc_mult=4, streams="full")
    hc_full_streams.apply(4)
    aux = _capture(deepseek_v4, mhc, hf_streams, LAYERS)
    ref = hc_rows_ref(hf_streams, LAYERS, "full")
    assert ref.shape == (23, 12, 88)
    _judge(aux, ref, spec)
    # the streams differ (hyper-connections mix them), so the mean alone would not pass this judge
    assert (ref[:, 0] - ref[:, 1]).abs().max() > 1e-3
    # a V4 mean capture of another layer on a patched process still gets its mean (an H-wide slot)
    out = torch.empty(23, 88)
    torch.testing.assert_close(mhc.mhc_stream_mean(hf_streams[2], out=out), hf_streams[2].mean(-2), rtol=0, atol=0)


def test_apply_is_idempotent_and_refuses_another_width(v4_modules):
    _, deepseek_v4, hc_full_streams = v4_modules
    hc_full_streams.apply(4)
    packer_cls = deepseek_v4.AuxHiddenStatePacker
    assert hc_full_streams.apply(4) == "already applied" and deepseek_v4.AuxHiddenStatePacker is packer_cls
    with pytest.raises(RuntimeError, match="hc_mult 4, asked for 8"):
        hc_full_streams.apply(8)
