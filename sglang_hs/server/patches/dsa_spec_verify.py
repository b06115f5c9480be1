"""CPU engine, speculative decoding of a DSA model (DeepSeek-V3.2): the target's verify pass (TARGET_VERIFY) with the
DSA indexer and sparse attention.

See the ledger in sglang_hs/server/patches/__init__.py. A verify forward carries `draft_token_num` rows per request
(the last accepted token and its drafts) at KV slots req_to_token[req, seq_len : seq_len + n], and no extend
lengths: dsa_torch_native's indexer would read `extend_prefix_lens_cpu` (None) and spec_verify_torch_native refuses a
`topk_indices`. Here, in TARGET_VERIFY only:

- the indexer (dsa_torch_native.indexer_forward_native) stores every row's index key at its slot as always, and each
  draft row selects its `index_topk` keys among req_to_token[req, :seq_len + n] that the draft tree lets it see
  (spec_info.custom_mask: the prefix, its ancestors and itself; spec_verify_torch_native._tree_masks);
- the attention (TorchNativeAttnBackend.forward_extend) attends each draft row over its selected keys within that
  same tree mask (dsa_torch_native.sparse_attention).

SGLang's GPU DSA backend (layers/attention/dsa_backend.py init_forward_metadata, TARGET_VERIFY) gives draft row j of
a request `seq_len + j + 1` keys (seqlens_expanded: causal by row), the indexer's top-k and the sparse attention
both within them. For a chain (--speculative-eagle-topk 1) the tree mask is exactly that, and each row selects and
attends as a plain forward of its sequence does (HF's DeepseekV32 rows). Trees (top-k > 1: GPU rows would see their
siblings) are refused at launch (sglang_hs/server/speculative_capture.py dsa_speculative_served).

The MTP draft (V3.2's layer has its own indexer) runs its indexer in its draft-extend pass, an ordinary extend under
dsa_torch_native, and, with --speculative-num-steps N > 1, in each of its N - 1 draft decode steps: there the
forward context's attention backend is eagle_cpu_draft's step backend (marked `hs_draft_step`), and the indexer
selects each draft row's keys among that backend's spans (the request's prefix req_to_token[req, :seq_len] and its own
branch's drafts so far, at seq_len + t * N + 0..i), which the step backend's sparse attention then reads. That is
the dense backends' multi-step layout; SGLang's GPU DSA multi-step backend (DeepseekSparseAttnMultiStepBackend)
builds one set of metadata from the committed seq_lens for every draft step, so a GPU's drafts (not its captured
rows: the verify pass is exact whatever was drafted) can differ from these.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION


def verify_spans(forward_batch, rows: int):
    """spec_verify_torch_native.verify_spans: per request of the verify batch, its keys and the draft tree's mask."""
    from sglang_hs.server.patches.spec_verify_torch_native import verify_spans as spans

    return spans(forward_batch, rows, "dsa_spec_verify")


def draft_step_spans(forward_batch, rows: int):
    """The spans of a multi-step draft's decode step (eagle_cpu_draft's step backend, the forward context's attention
    backend while EagleWorkerV2.draft_forward runs step i), or None outside one."""
    from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

    if not forward_batch.forward_mode.is_decode() or not has_forward_context():
        return None
    backend = get_attn_backend()
    if not getattr(backend, "hs_draft_step", False):
        return None
    if backend.spans is None or rows < len(backend.spans):  # rows past the spans: DP attention's padding
        raise RuntimeError(f"sglang-hs dsa_spec_verify: a draft decode step's indexer got {rows} rows for "
                           f"{'no' if backend.spans is None else len(backend.spans)} branches")
    return backend.spans


def _indexer_with_verify(original):
    def forward_native(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True, **kwargs):
        spans = draft_step_spans(forward_batch, x.shape[0])
        if spans is not None:  # the draft's step: its prefix and its own branch's drafts so far
            from sglang_hs.server.patches.dsa_torch_native import indexer_forward_native

            return indexer_forward_native(self, x, q_lora, positions, forward_batch, layer_id,
                                          return_indices=return_indices, spans=spans)
        if not forward_batch.forward_mode.is_target_verify():
            return original(self, x, q_lora, positions, forward_batch, layer_id, return_indices=return_indices,
                            **kwargs)
        from sglang_hs.server.patches.dsa_torch_native import indexer_forward_native

        return indexer_forward_native(self, x, q_lora, positions, forward_batch, layer_id,
                                      return_indices=return_indices, spans=verify_spans(forward_batch, x.shape[0]))

    forward_native.__wrapped__ = original
    return forward_native


def _attention_with_verify(original):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, topk_indices=None, **kwargs):
        if topk_indices is None or not forward_batch.forward_mode.is_target_verify():
            return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache,
                            topk_indices=topk_indices, **kwargs)
        from sglang_hs.server.patches.dsa_torch_native import sparse_attention

        rows = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim).shape[0]
        return sparse_attention(self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices,
                                spans=verify_spans(forward_batch, rows))

    forward_extend.__wrapped__ = original
    return forward_extend


def apply() -> dict:
    """Wrap dsa_torch_native's Indexer.forward_native and spec_verify_torch_native's forward_extend (both applied
    before this one); returns the originals."""
    import sglang
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch dsa_spec_verify targets sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}")
    originals = {"Indexer.forward_native": Indexer.forward_native,
                 "TorchNativeAttnBackend.forward_extend": TorchNativeAttnBackend.forward_extend}
    Indexer.forward_native = _indexer_with_verify(Indexer.forward_native)
    TorchNativeAttnBackend.forward_extend = _attention_with_verify(TorchNativeAttnBackend.forward_extend)
    return originals
