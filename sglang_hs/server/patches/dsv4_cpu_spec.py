"""CPU engine, speculative decoding on DeepSeek-V4 with its MTP draft (EAGLE/NEXTN): the target's verify pass
(TARGET_VERIFY) of a chain draft, and the draft's embedding and head without CUDA calls.

See the ledger in sglang_hs/server/patches/__init__.py. sglang_hs/server/patches/dsv4_torch_native.py computes V4's
attention itself (MQALayer.forward: the sliding window, the CSA/HCA compressed blocks and the indexer over per-token
sources kept at the KV slots), from each request's (prefix, new tokens) span of the batch (`requests_of`), which
knows prefill chunks and decode steps but not a verify pass. This patch gives it that: a verify batch of
`draft_token_num` tokens per request whose drafts form a chain (--speculative-eagle-topk 1: draft i at position
seq_len + i, written at req_to_token[req, seq_len + i], each seeing the prefix and the drafts before it, as SGLang's
chain mask says) is the span (seq_len, draft_token_num) of each request, attended causally as a prefill chunk. The
MTP draft's own decode steps (--speculative-num-steps > 1; its layer is sliding-window only) are likewise spans of
one token at their positions (draft_decode_spans); its extend pass after a verify is an ordinary extend.

Why nothing is undone for rejected drafts: the patch keeps no compressor state. A verify pass writes each draft's
key and compressor/indexer sources at the draft's KV slot (as it writes its hidden-state row); a compressed block
that a draft closes is computed for that draft's query only, from the sources then at req_to_token[req, :position],
and is never stored. After the verify SGLang frees the rejected drafts' slots and the next pass (or draft extend)
writes new tokens at positions >= the accepted length, so no later query reads a rejected draft's key or source: a
block is always recomputed from the tokens the request has. (SGLang's CUDA path keeps compressor states in
DeepSeekV4TokenToKVPool's compress-state pools and must roll them back; here there is nothing to roll back.)

`DeepseekV4ForCausalLM.set_embed_and_head` (the MTP draft takes the target's embedding and LM head,
eagle_worker_v2.init_lm_head) ends with `torch.get_device_module().empty_cache()` and `.synchronize()`, which raise on
a machine without a CUDA driver: on a CPU device the same rebinding runs without them (as eagle_cpu_draft does for
DeepseekV2ForCausalLM's).

Tree drafts (top-k > 1: a draft's ancestors are not the drafts before it, positions repeat) raise
NotImplementedError at the first verify pass; the launcher refuses them for V4 first
(sglang_hs/server/speculative_capture.py refusal).
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION


def verify_spans(forward_batch):
    """(req, seq_len, draft_token_num) per request of a chain verify pass; raises for a tree."""
    import torch

    from sglang_hs.server.patches.spec_verify_torch_native import _tree_masks

    spec = forward_batch.spec_info
    n = int(spec.draft_token_num)
    reqs = forward_batch.req_pool_indices.tolist()
    seq_lens = [int(x) for x in forward_batch.seq_lens_cpu.tolist()]
    if getattr(spec, "custom_mask", None) is not None:
        chain = torch.ones((n, n), dtype=torch.bool).tril()
        for req, mask in zip(reqs, _tree_masks(spec, seq_lens, n)):
            if not (bool(mask[:, :-n].all()) and torch.equal(mask[:, -n:].cpu(), chain)):
                raise NotImplementedError("sglang-hs DeepSeek-V4 on the CPU engine: a speculative verify pass of a "
                                          "draft tree (a draft that does not see exactly the drafts before it); only "
                                          "chains (--speculative-eagle-topk 1) are served")
    if type(spec).__name__ == "DFlashVerifyInput":  # DSpark's verify (patches/dsv4_cpu_dspark.py), see dspark_prefixes
        seq_lens = dspark_prefixes(forward_batch, n, seq_lens)
    return [(req, prefix, n) for req, prefix in zip(reqs, seq_lens)]


def dspark_prefixes(forward_batch, n, seq_lens_cpu):
    """Each request's prefix in a DSpark verify pass (DSparkWorkerV2, TargetVerifyExecutor.run_non_compact): the
    window of n = gamma + 1 tokens (the anchor and its drafts) at positions prefix .. prefix + n - 1. For a backend
    without make_forward_metadata_from_raw_verify (torch_native) the worker hands the batch seq_lens_cpu with the n
    verify tokens already added, so the prefix is that minus n; checked against the window's positions."""
    spec = getattr(forward_batch, "spec_info", None)
    ragged = getattr(spec, "ragged_verify_layout", None) is not None
    if ragged or forward_batch.positions.numel() != len(seq_lens_cpu) * n:
        raise NotImplementedError("sglang-hs DeepSeek-V4 on the CPU engine: a DSpark verify pass of ragged (compact) "
                                  "windows; only static windows (SGLANG_RAGGED_VERIFY_MODE=static) are served")
    positions = forward_batch.positions.view(-1, n).tolist()
    prefixes = [s - n for s in seq_lens_cpu]
    for prefix, row in zip(prefixes, positions, strict=True):
        if row != list(range(prefix, prefix + n)):
            raise NotImplementedError(f"sglang-hs DeepSeek-V4 on the CPU engine: a DSpark verify window at positions "
                                      f"{row}, expected {prefix} .. {prefix + n - 1} (seq_lens_cpu less the window)")
    return prefixes


def draft_decode_spans(forward_batch):
    """(req, position, 1) per request of an MTP draft's decode step (--speculative-num-steps > 1, top-k 1): step i's
    token of request b sits at position seq_len + i (EagleWorkerV2.draft_forward advances `positions` after each step)
    and is written at req_to_token[b, seq_len + i] (its draft slots, page size 1), so its query sees the keys at
    req_to_token[b, :position + 1]: the prefix, the earlier steps' tokens and its own."""
    reqs = forward_batch.req_pool_indices.tolist()
    positions = [int(p) for p in forward_batch.positions.tolist()]
    if len(positions) != len(reqs):
        raise NotImplementedError(f"sglang-hs DeepSeek-V4 on the CPU engine: a draft decode step of {len(positions)} "
                                  f"tokens for {len(reqs)} requests (a draft tree); only chains (top-k 1) are served")
    return [(req, pos, 1) for req, pos in zip(reqs, positions)]


def _with_verify(original):
    def requests_of(forward_batch):
        if forward_batch.forward_mode.is_target_verify():
            return verify_spans(forward_batch)
        if forward_batch.forward_mode.is_decode() and getattr(forward_batch, "spec_info", None) is not None:
            return draft_decode_spans(forward_batch)  # a target's decode has none: its steps are verify passes
        return original(forward_batch)

    requests_of.__wrapped__ = original
    return requests_of


def apply() -> dict:
    """Rebind dsv4_torch_native.requests_of and wrap DeepseekV4ForCausalLM.set_embed_and_head; returns the
    originals."""
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch dsv4_cpu_spec targets sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}")
    from sglang.srt.models import deepseek_v4

    from sglang_hs.server.patches import dsv4_torch_native
    from sglang_hs.server.patches.eagle_cpu_draft import _cpu_safe

    cls = deepseek_v4.DeepseekV4ForCausalLM
    originals = {"dsv4_torch_native.requests_of": dsv4_torch_native.requests_of,
                 "DeepseekV4ForCausalLM.set_embed_and_head": cls.set_embed_and_head}
    dsv4_torch_native.requests_of = _with_verify(dsv4_torch_native.requests_of)
    cls.set_embed_and_head = _cpu_safe(cls.set_embed_and_head)
    return originals
