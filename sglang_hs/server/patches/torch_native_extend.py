"""CPU engine, long prompts: a prefill chunk attends with its own queries only, not the whole sequence's.

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` pads each request's new queries to the
request's whole length (an uninitialised tensor of `seq_len` rows, the chunk's queries at the end) and runs a
causal `seq_len x seq_len` attention, then keeps the chunk's rows: every chunk of a chunked prefill costs a
full attention over everything before it. A 8,192-token prompt in 512-token chunks took 250 s on this
project's 2-core machine (the last chunk 38 s); a 32K one would take hours. This patch attends the chunk's
`extend` queries over the request's `seq_len` keys under the same causal mask, bottom-right aligned (query i
sees keys up to prefix + i): the same rows, `extend x seq_len` work. Anything else the original handles
(encoder lengths, cross or encoder-only attention, a sliding window) goes to it unchanged.

Under DP attention SGLang pads a group's batch to the largest group's (ForwardBatch.prepare_mlp_sync_batch, the
batch's own size kept in `_original_batch_size`); a speculative draft's extend pads each dummy request with a
whole draft's tokens after no prefix but a padding seq len of 1, which no attention over its own keys could serve:
the requests past the batch's own are that padding, and their rows are zeros (the worker discards them). See the
ledger in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import contextvars

import torch

from sglang_hs.version import SGLANG_VERSION


def causal_tail_mask(prefix: int, extend: int, device=None) -> torch.Tensor:
    """[extend, prefix + extend] bool: query i (position prefix + i) sees keys 0 .. prefix + i."""
    keys = torch.arange(prefix + extend, device=device)
    return keys.unsqueeze(0) <= (prefix + torch.arange(extend, device=device)).unsqueeze(1)


# The forward batch's own requests (`_original_batch_size`) while TorchNativeAttnBackend.forward_extend runs; None:
# no DP padding, every request is the batch's
_REAL_REQUESTS = contextvars.ContextVar("sglang_hs_real_requests", default=None)


def extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                     extend_seq_lens, scaling=None, enable_gqa=False, real=None):
    """The causal extend attention of `_run_sdpa_forward_extend` (query/output [tokens, heads, dim]) with the
    chunk's queries only. Requests from index `real` on are DP padding: zeros."""
    from torch.nn.functional import scaled_dot_product_attention

    start = 0
    for i, (req, length, prefix, extend) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                                          extend_prefix_lens.tolist(), extend_seq_lens.tolist())):
        if real is not None and i >= real:
            output[start:start + extend] = 0
            start += extend
            continue
        if prefix + extend != length:
            raise RuntimeError(f"sglang-hs torch_native_extend: a request of {length} keys extends {extend} tokens "
                               f"after a prefix of {prefix}")
        tokens = req_to_token[req, :length]
        key, value = k_cache[tokens], v_cache[tokens]  # [length, kv heads, dim]
        q = query[start:start + extend]
        if not (q.dtype == key.dtype == value.dtype):
            key, value = key.to(q.dtype), value.to(q.dtype)
        mask = None if prefix == 0 else causal_tail_mask(prefix, extend, q.device)
        output[start:start + extend] = scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=enable_gqa,
        )[0].transpose(0, 1)
        start += extend
    return output


def _with_chunk_queries(original):
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        if encoder_lens is not None or not causal or is_cross_attn or \
                (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                            causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                extend_prefix_lens, extend_seq_lens, scaling=scaling, enable_gqa=enable_gqa,
                                real=_REAL_REQUESTS.get())

    _run_sdpa_forward_extend.__wrapped__ = original
    return _run_sdpa_forward_extend


def _with_batch_size(original):
    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        token = _REAL_REQUESTS.set(getattr(forward_batch, "_original_batch_size", None))
        try:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            _REAL_REQUESTS.reset(token)

    forward_extend.__wrapped__ = original
    return forward_extend


def apply():
    """Wrap TorchNativeAttnBackend._run_sdpa_forward_extend (and forward_extend, which hands it the batch's own
    size); returns the original _run_sdpa_forward_extend. Idempotent through the registry."""
    import sglang
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch torch_native_extend targets sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}")
    original = TorchNativeAttnBackend._run_sdpa_forward_extend
    TorchNativeAttnBackend._run_sdpa_forward_extend = _with_chunk_queries(original)
    TorchNativeAttnBackend.forward_extend = _with_batch_size(TorchNativeAttnBackend.forward_extend)
    return original
