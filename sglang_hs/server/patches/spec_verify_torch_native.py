"""CPU engine, speculative decoding: the target's verify pass (TARGET_VERIFY) on the torch_native backend.

A speculative worker (NGRAM, EAGLE) verifies its drafts with one forward of the target over
`draft_token_num` tokens per request, laid out as a tree: each draft token may see the request's whole
prefix (its KV slots before this step) and, among the drafts, only its own ancestors and itself
(`spec_info.custom_mask`). SGLang 0.5.23's TorchNativeAttnBackend has no such path: its `forward_extend`
reads `extend_prefix_lens`, which a verify batch does not have, and attends causally. This patch gives
`forward_extend` a TARGET_VERIFY branch that writes the step's KV, as upstream does, then attends each
request's drafts over req_to_token[req, :prefix + n] with the prefix visible and the tree mask among the
drafts, in plain torch (scaled_dot_product_attention, as the backend's own paths); every other mode
goes to the original. The mask comes in the two layouts SGLang's CPU workers produce: QLEN ([n, n] per
request, NGRAM and EAGLE's QLEN_ONLY) or FULL ([n, prefix + n] per request). See the ledger in
sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import torch

from sglang_hs.version import SGLANG_VERSION


def _tree_masks(spec_info, prefixes, n: int):
    """Per request: [n, prefix + n] bool, from the spec input's custom mask in either layout."""
    mask = spec_info.custom_mask.reshape(-1).bool()
    bs = len(prefixes)
    if mask.numel() == bs * n * n:  # QLEN: drafts x drafts; the prefix is always visible
        qlen = mask.view(bs, n, n)
        return [torch.cat([torch.ones((n, p), dtype=torch.bool), qlen[i]], dim=1) for i, p in enumerate(prefixes)]
    full = sum((p + n) * n for p in prefixes)
    if mask.numel() != full:
        raise RuntimeError(f"sglang-hs spec_verify_torch_native: a custom mask of {mask.numel()} entries for "
                           f"{bs} requests of {n} drafts (expected {bs * n * n} or {full})")
    out, start = [], 0
    for p in prefixes:
        out.append(mask[start:start + (p + n) * n].view(n, p + n))
        start += (p + n) * n
    return out


def verify_spans(forward_batch, rows: int, who: str = "spec_verify_torch_native"):
    """Per request of a verify batch: (request pool index, keys, query rows, visible(length) -> [n, length] bool),
    the keys req_to_token[req, :seq_len + n] and the mask the draft tree gives (prefix visible). DP attention pads a
    group's verify batch to the largest group's (ForwardBatch.prepare_mlp_sync_batch, which keeps the batch's own
    size in _original_batch_size): the requests past it are that padding, with no drafts in the tree mask, and get
    no span (their rows stay zeros; their KV goes to the padding slot 0 as upstream's)."""
    n = int(forward_batch.spec_info.draft_token_num)
    prefixes = [int(x) for x in forward_batch.seq_lens_cpu.tolist()]
    reqs = forward_batch.req_pool_indices.tolist()
    real = getattr(forward_batch, "_original_batch_size", None)
    # padded for DP attention, a group's tokens are also rounded up to a multiple of its attention TP size (rows past
    # the last request's: padding too); otherwise exactly n rows a request
    if not (len(reqs) * n <= rows < (len(reqs) + 1) * n if real is not None else rows == len(reqs) * n):
        raise RuntimeError(f"sglang-hs {who}: {rows} query rows for {len(reqs)} requests of {n} drafts")
    real = len(reqs) if real is None else min(int(real), len(reqs))
    masks = _tree_masks(forward_batch.spec_info, prefixes[:real], n)
    return [(req, prefix + n, slice(i * n, (i + 1) * n), lambda length, m=m: m)
            for i, (req, prefix, m) in enumerate(zip(reqs[:real], prefixes[:real], masks))]


def verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    from sglang_hs.server.ops.masked_attention import masked_attention

    rows = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim).shape[0]
    return masked_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, verify_spans(forward_batch, rows))


def _with_verify(original):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if kwargs.get("topk_indices") is not None:
            raise NotImplementedError("sglang-hs: speculative verify with DSA's sparse attention (DeepSeek-V3.2) "
                                      "has no CPU path without the dsa_spec_verify patch")
        return verify_attention(self, q, k, v, layer, forward_batch, save_kv_cache)

    forward_extend.__wrapped__ = original
    return forward_extend


def apply():
    """Wrap TorchNativeAttnBackend.forward_extend; returns the original. Idempotent through the registry."""
    import sglang
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch spec_verify_torch_native targets sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}")
    original = TorchNativeAttnBackend.forward_extend
    TorchNativeAttnBackend.forward_extend = _with_verify(original)
    return original
