"""CPU engine: DeepSeek Sparse Attention (DeepSeek-V3.2's DSA) in plain torch, as HF's `deepseek_v32` computes it.

See the ledger in sglang_hs/server/patches/__init__.py. Two pieces, both applied in CPU mode only:

- `Indexer.forward_native` (upstream raises "Indexer has no native (pure-torch) path"; the CPU engine's
  `forward_cpu` falls back to it): the indexer's key of every new token is stored per layer at its KV slot,
  and each query gets the `index_topk` keys of its own request with the highest index score
  sum_h w_h * relu(q_h . k * head_dim^-0.5), w = weights_proj(x) * n_heads^-0.5, among the keys at or
  before its position (HF DeepseekV32Indexer.forward). Returned as [tokens, index_topk] int32 positions
  within the request, -1 where a query has fewer keys than index_topk.
- `TorchNativeAttnBackend.forward_extend/forward_decode` take the `topk_indices` SGLang's absorbed MLA passes
  for DSA models and attend over those keys only (HF masks every unselected key); without it they run
  unchanged.

- The KV pool: SGLang's DSATokenToKVPool asserts 64-token pages (and 128-dim FP8 index keys); on the CPU
  engine a DSA model gets the plain MLA pool SGLang builds for V3 (kv_cache_configurator's view of
  `is_deepseek_dsa` says no), with one-token pages (sglang_hs/server/patches/dsa_cpu_server_args.py) so prefix-cache
  hits are token-exact as for V3; the index keys live in this patch's own per-layer store.

DP attention (`--enable-dp-attention`): a group with no requests runs IDLE batches padded to the other group's size
(no prefix or extend lengths): no request, so every padded row's selection stays -1 and its attention output zero;
a padded decode batch's extra requests (request 0, length 1) read and write slot 0 only, which SGLang reserves, and
are never captured.

Not done here: Hadamard rotation and FP8 quantisation of the index keys (the CUDA path's; the rotation is
orthogonal, HF skips both), the index-cache variant (IndexerKPool) and RMS-normed index keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_hs.version import SGLANG_VERSION

_INDEX_K = "_hs_dsa_index_k"  # per-layer index-key store, kept on the KV pool object


def _index_k_store(pool, layer_id: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """[KV slots, dim] float32 index keys of one layer (slots as in the MLA KV buffer)."""
    stores = pool.__dict__.setdefault(_INDEX_K, {})
    store = stores.get(layer_id)
    if store is None:
        rows = pool.get_key_buffer(layer_id).shape[0]
        store = stores[layer_id] = torch.zeros((rows, dim), dtype=torch.float32, device=like.device)
    return store


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, heads, rot]; cos/sin [T, rot/2]. Half-split (HF rotate_half) or interleaved pairs."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _requests(forward_batch):
    """Per request of the batch: (request pool index, keys before this step, new tokens). None in an IDLE batch
    (DP attention: this group has no requests while the other runs; its rows only pad the batch)."""
    if forward_batch.forward_mode.is_idle():
        return []
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    reqs = forward_batch.req_pool_indices.tolist()
    if forward_batch.forward_mode.is_decode():
        return [(r, L - 1, 1) for r, L in zip(reqs, seq_lens)]
    return list(zip(reqs, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu))


def _causal(prefix: int, n: int, length: int, device) -> torch.Tensor:
    """[n, length] bool: query t (position prefix + t) may see key j <= prefix + t."""
    q_pos = torch.arange(prefix, prefix + n, device=device).unsqueeze(1)
    return torch.arange(length, device=device).unsqueeze(0) <= q_pos


def _causal_spans(forward_batch):
    """Per request: (request pool index, keys, query rows, visible(length) -> [rows, length] bool): causal."""
    start, spans = 0, []
    for req, prefix, n in _requests(forward_batch):
        spans.append((req, prefix + n, slice(start, start + n),
                      lambda length, prefix=prefix, n=n: _causal(prefix, n, length, None)))
        start += n
    return spans


def indexer_forward_native(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True, spans=None,
                           **_):
    """`spans` (default: each request's new tokens, causal) says which keys each query row may select among:
    a speculative verify's draft tree (sglang_hs/server/patches/dsa_spec_verify.py) passes its own."""
    from sglang.srt.layers.layernorm import LayerNorm
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    if not isinstance(self.k_norm, LayerNorm):
        raise NotImplementedError("sglang-hs DSA CPU indexer: only LayerNorm-normed index keys (DeepSeek-V3.2)")
    T, H, D, R = x.shape[0], self.n_heads, self.head_dim, self.rope_head_dim
    out = torch.full((T, self.index_topk), -1, dtype=torch.int32, device=x.device)
    if T == 0:
        return out if return_indices else None
    q = self.wq_b(q_lora)[0].float().view(T, H, D)
    k = self.wk(x)[0].float()
    k = F.layer_norm(k, (D,), self.k_norm.weight.float(), self.k_norm.bias.float(), self.k_norm.variance_epsilon)
    cos, sin = self.rotary_emb.cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    q = torch.cat((_rope(q[..., :R], cos, sin, self.is_neox_style), q[..., R:]), dim=-1)
    k = torch.cat((_rope(k[:, None, :R], cos, sin, self.is_neox_style)[:, 0], k[:, R:]), dim=-1)
    weights = F.linear(x.float(), self.weights_proj.weight.float()) * H ** -0.5  # [T, H]

    store = _index_k_store(get_token_to_kv_pool(), layer_id, D, x)
    store[forward_batch.out_cache_loc] = k
    req_to_token = get_req_to_token_pool().req_to_token
    for req, length, rows, visible in (_causal_spans(forward_batch) if spans is None else spans):
        keys = store[req_to_token[req, :length].long()]  # [length, D]
        scores = F.relu(torch.matmul(q[rows], keys.T) * self.softmax_scale)  # [n, H, length]
        index = torch.matmul(weights[rows].unsqueeze(-2), scores).squeeze(-2)  # [n, length]
        index = index.masked_fill(~visible(length).to(x.device), float("-inf"))
        top = index.topk(min(self.index_topk, length), dim=-1)
        out[rows, : top.indices.shape[1]] = torch.where(top.values == float("-inf"), -1, top.indices).to(torch.int32)
    return out if return_indices else None


def selected(sel: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, length] bool: the keys of `sel` ([rows, index_topk] positions, -1 for none) chosen per row."""
    sel = sel.long()
    chosen = torch.zeros((sel.shape[0], length + 1), dtype=torch.bool, device=sel.device)  # last column: the -1s
    chosen.scatter_(1, torch.where(sel < 0, length, sel), True)
    return chosen[:, :length]


def sparse_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, topk_indices, spans=None):
    """MLA (absorbed) attention of each query over its request's selected keys, among those `spans` lets it see
    (default: causal over its request's new tokens; a verify's draft tree passes its own)."""
    from sglang_hs.server.ops.masked_attention import masked_attention

    def masked():
        for req, length, rows, visible in (_causal_spans(forward_batch) if spans is None else spans):
            def mask(length, rows=rows, visible=visible):
                sel = topk_indices[rows]
                return selected(sel, length) & visible(length).to(sel.device)

            yield req, length, rows, mask

    return masked_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, masked())


def _with_topk(original):
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, topk_indices=None, **kwargs):
        if topk_indices is None:
            return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return sparse_attention(self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices)

    forward.__wrapped__ = original
    return forward


def apply() -> dict:
    """Install both; returns {qualified name: original} for tests."""
    import sglang
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch dsa_torch_native targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    from sglang.srt.mem_cache import kv_cache_configurator

    originals = {"kv_cache_configurator.is_deepseek_dsa": kv_cache_configurator.is_deepseek_dsa,
                 "Indexer.forward_native": Indexer.forward_native,
                 "TorchNativeAttnBackend.forward_extend": TorchNativeAttnBackend.forward_extend,
                 "TorchNativeAttnBackend.forward_decode": TorchNativeAttnBackend.forward_decode}
    kv_cache_configurator.is_deepseek_dsa = lambda hf_config: False  # the MLA pool, token pages
    Indexer.forward_native = indexer_forward_native
    TorchNativeAttnBackend.forward_extend = _with_topk(TorchNativeAttnBackend.forward_extend)
    TorchNativeAttnBackend.forward_decode = _with_topk(TorchNativeAttnBackend.forward_decode)
    return originals
