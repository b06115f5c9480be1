"""The torch_native_extend patch (sglang_hs/server/patches/torch_native_extend.py): a chunk's queries attend
alone, with the causal mask aligned to their positions, and give the rows SGLang's padded whole-sequence
attention gives; the paths it does not take over go to SGLang's own."""
import pytest
import torch

pytest.importorskip("sglang")

from sglang_hs.server.patches.torch_native_extend import _with_chunk_queries, causal_tail_mask  # noqa: E402


def _original():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = TorchNativeAttnBackend._run_sdpa_forward_extend
    return getattr(fn, "__wrapped__", fn)


def test_tail_mask_is_the_causal_mask_shifted_by_the_prefix():
    m = causal_tail_mask(3, 2)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert torch.equal(causal_tail_mask(0, 4), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("heads,kv_heads,dim,v_dim", [(4, 1, 80, 64), (3, 3, 37, 37)])
def test_chunk_queries_give_the_padded_attention_rows(heads, kv_heads, dim, v_dim):
    torch.manual_seed(0)
    slots = 700
    k, v = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, v_dim)
    req_to_token = torch.randperm(slots).int().view(2, 350)
    # a chunk after a prefix, a request with no prefix, a one-token extend (a decode-like step)
    seq, prefix = torch.tensor([301, 45, 120]), torch.tensor([188, 0, 119])
    pools = torch.tensor([1, 0, 0])
    extend = seq - prefix
    q = torch.randn(int(extend.sum()), heads, dim)
    want, got = torch.zeros(q.shape[0], heads, v_dim), torch.full((q.shape[0], heads, v_dim), float("nan"))
    original = _original()
    args = (k, v, req_to_token, pools, seq, prefix, extend, None)
    original(None, q, want, *args, scaling=0.125, enable_gqa=heads != kv_heads, causal=True)
    _with_chunk_queries(original)(None, q, got, *args, scaling=0.125, enable_gqa=heads != kv_heads, causal=True)
    err = (got - want).abs().max().item()
    print(f"max abs difference {err:.3g}")
    assert err <= 1e-5 * want.abs().max().item()


def test_other_paths_go_to_the_original():
    calls = []
    patched = _with_chunk_queries(lambda self, *a, **kw: calls.append(kw) or "original")
    args = [None] * 9
    assert patched(None, *args, causal=False) == "original"
    assert patched(None, *args, causal=True, sliding_window_size=8) == "original"
    assert patched(None, *args, encoder_lens=torch.tensor([1]), causal=True) == "original"
    assert len(calls) == 3
