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


def test_dp_padding_requests_are_zeros_and_the_batch_rows_unchanged():
    """Under DP attention a speculative draft's extend pads the batch to a larger group's with requests of a whole
    draft's tokens after no prefix but the padding seq len 1 (ForwardBatch._pad_inputs_to_size); forward_extend
    hands the batch's own size (_original_batch_size) to the attention: those requests' rows are zeros, the real
    ones unchanged. Before, the padded request raised ("a request of 1 keys extends 4 tokens after a prefix of 0")
    and the scheduler died."""
    from types import SimpleNamespace

    from sglang_hs.server.patches.torch_native_extend import _with_batch_size

    torch.manual_seed(1)
    heads, dim, slots, n = 3, 24, 200, 4
    k, v = torch.randn(slots, heads, dim), torch.randn(slots, heads, dim)
    req_to_token = torch.randperm(slots).int().view(4, 50)
    seq, prefix = torch.tensor([30, 9, 1]), torch.tensor([26, 5, 0])  # two drafts' extends, then the padding
    extend = torch.tensor([n, n, n])
    pools = torch.tensor([2, 1, 0])
    q = torch.randn(3 * n, heads, dim)
    original = _original()
    chunked = _with_chunk_queries(original)
    args = (k, v, req_to_token, pools, seq, prefix, extend, None)
    with pytest.raises(RuntimeError, match="a request of 1 keys extends 4 tokens after a prefix of 0"):
        chunked(None, q, torch.empty(3 * n, heads, dim), *args, scaling=0.2, causal=True)

    class Backend:  # forward_extend as SGLang's calls _run_sdpa_forward_extend with the batch's fields
        _run_sdpa_forward_extend = chunked

        def forward_extend(self, q, k_, v_, layer, batch, save_kv_cache=True):
            out = torch.full_like(q, float("nan"))
            self._run_sdpa_forward_extend(q, out, k, v, req_to_token, batch.req_pool_indices, batch.seq_lens,
                                          batch.extend_prefix_lens, batch.extend_seq_lens, None, scaling=0.2,
                                          causal=True)
            return out

    batch = SimpleNamespace(req_pool_indices=pools, seq_lens=seq, extend_prefix_lens=prefix, extend_seq_lens=extend,
                            _original_batch_size=2)
    got = _with_batch_size(Backend.forward_extend)(Backend(), q, None, None, None, batch)
    want = torch.zeros(2 * n, heads, dim)
    chunked(None, q[:2 * n], want, k, v, req_to_token, pools[:2], seq[:2], prefix[:2], extend[:2], None,
            scaling=0.2, causal=True)
    assert torch.equal(got[:2 * n], want) and not got[2 * n:].any()
