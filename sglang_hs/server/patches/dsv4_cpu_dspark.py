"""CPU engine, speculative decoding on DeepSeek-V4 with its DSpark draft (--speculative-algorithm DSPARK): the draft's
attention and the injection of the target's hidden states into the draft's KV, in plain torch.

See the ledger in sglang_hs/server/patches/__init__.py. SGLang 0.5.23's DSparkWorkerV2 (speculative/dspark_components/)
runs as upstream: the prefill's target forward (its aux states at the draft's dspark_target_layer_ids, the V4 overlay's
capture union), the injection of those states into the draft's KV, the draft's block forward (the anchor, i.e. the
last token, then gamma - 1 mask tokens, one query row per draft), the markov head's greedy steps, the target's verify
pass over [anchor, d1 .. d_gamma] (dsv4_cpu_spec's verify spans), the accept (greedy, sampled or both in one batch),
and the commit injection of the accepted rows. Its kernels take their torch reference on CPU tensors
(kernels/ops/speculative/dspark/dispatch.py `inputs_on_cuda`). What has no CPU path, and is given one here:

- The draft's attention backend: DSparkWorkerV2 builds the draft runner with the "dsv4" backend for a V4 (MoE) draft
  (dspark_config.DSV4_DRAFT_ATTENTION_BACKEND, FlashMLA over DeepSeekV4TokenToKVPool, asserting head_dim 512). On the
  CPU engine the draft gets torch_native (its metadata only) and SGLang's plain MHA pool, as the target does
  (dsv4_torch_native), indexed by the same KV slots as the target's.
- `DSparkAttention.forward` (upstream: the FlashMLA sparse decode over the draft's SWA pool, indices from
  kernels/ops/speculative/dspark/dspark_attn_metadata.py): each block row of a request whose prefix has `prefix`
  tokens attends, with the layer's sink, over the keys at positions max(0, prefix - SWA_WINDOW) .. prefix - 1 (the
  injected context, read through req_to_token) and over every row of its own block (not causal inside the block, as
  upstream's page indices give each row the whole block); the block's keys are written at its slots
  (out_cache_loc, the verify window's first query_token_num slots) first, as upstream's _store_block_kv does. The
  projections are upstream's slow path (q = wq_b(q_norm(wq_a x)), kv_norm and RoPE on the key, inverse RoPE on the
  output, the grouped wo_a then wo_b).
- `torch.Tensor.record_stream` (DSparkWorkerV2._forward_decode records `batch.seq_lens` on the device's current
  stream; a CPU tensor with torch.cpu's stream raises "unknown parameter type"): a no-op for a CPU tensor (CPU
  work is synchronous), the original for any other.
- `DeepseekV4ForCausalLMDSpark.write_target_hidden_kv` (upstream: the DeepSeekV4TokenToKVPool's fused norm+RoPE SWA
  write, `set_swa_key_buffer_radix_fused_norm_rope`; TargetHiddenKvInjector calls the dense drafts' signature for a
  pool without it): main_norm(main_proj(target states)), each stage's wkv, kv_norm and RoPE at the token's position,
  written at the token's slot in the stage's layer; with `cache_loc_2d` and `commit_lens` (the commit after a verify
  pass) only the first commit_lens rows of each request (the anchor and its accepted drafts), as upstream's commit
  gate (committed_swa_loc: -1 for uncommitted rows), so a rejected draft's target state never reaches the draft's KV.
- `dspark_accept.chain_speculative_sampling_triton` (a sampled request's verify: AcceptSampling's torch reference
  still launches reject_sampling's Triton kernel, "0 active drivers" on the CPU engine, and the scheduler dies at the
  first pass with a request of temperature > 0; the blockwise-rejection path is CUDA-only upstream):
  chain_speculative_sampling_cpu, the kernel's chain rule token by token on CPU tensors (draft j accepted while
  coin_j * q(d) < p(d), the bonus drawn by inverse CDF from the target's row after the last accepted draft, or from
  max(p - q, 0) there when a draft was rejected), the same outputs from the same coins; the original for CUDA
  tensors. Block verification is refused (SGLang refuses it off CUDA already).

Capture is unaffected by the draft: the draft runs on its own runner and pool, never through the target overlay's
forward, and the target's verify pass writes rows at the verify window's slots as under EAGLE (a rejected draft's
row sits at a position past the request's committed length and is overwritten by the next pass before any record
reads it). Not served: several ranks (the launcher refuses --tp/--dp), a draft bundled in the target's checkpoint,
the compact (ragged) verify mode (SGLANG_RAGGED_VERIFY_MODE=compact), block verification. cap-accept (the draft's
confidence head, its schedule capping the accept of a whole static window) needs nothing more here.
"""
from __future__ import annotations

import torch

from sglang_hs.server.patches.dsv4_torch_native import (_linear, key_rows, local_heads, output_rows, query_rows,
                                                        sink_attention)
from sglang_hs.version import SGLANG_VERSION

DRAFT_BACKEND = "torch_native"


def _swa_window() -> int:
    from sglang.srt.layers.attention.deepseek_v4_backend import SWA_WINDOW

    return int(SWA_WINDOW)


def _key(attn, x, positions):
    """The stage's key of x at `positions`: kv_norm(wkv x) with RoPE (upstream's fused norm+rope SWA write)."""
    return key_rows(attn, _linear(attn.wkv, x), positions)


def dspark_attention_forward(self, positions, hidden_states, forward_batch, *, defer_all_reduce=False):
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    x = hidden_states
    if forward_batch.forward_mode.is_idle() or x.shape[0] == 0:
        return torch.zeros_like(x)
    T, H, D = x.shape[0], self.n_local_heads, self.head_dim
    q = query_rows(self, _linear(self.wq_a, x), positions)
    kv = _key(self, x, positions)
    pool = get_token_to_kv_pool()
    pool.set_kv_buffer(self.attn, forward_batch.out_cache_loc, kv.unsqueeze(1), kv.unsqueeze(1))
    cache = pool.get_key_buffer(self.attn.layer_id)
    req_to_token = get_req_to_token_pool().req_to_token
    reqs = forward_batch.req_pool_indices.tolist()
    prefixes = [int(p) for p in forward_batch.seq_lens.tolist()]
    if T % len(reqs):
        raise NotImplementedError(f"sglang-hs DeepSeek-V4 DSpark draft on the CPU engine: a block forward of {T} rows "
                                  f"for {len(reqs)} requests (blocks of one size expected)")
    n = T // len(reqs)
    window = _swa_window()
    sink = local_heads(self.attn_sink, self.attn_tp_rank, H)
    o = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    for b, (req, prefix) in enumerate(zip(reqs, prefixes)):
        first = max(0, prefix - window)
        context = cache[req_to_token[req, first:prefix].long()].view(prefix - first, D).to(x.dtype)
        keys = torch.cat([context, kv[b * n:(b + 1) * n]])
        mask = torch.ones((n, keys.shape[0]), dtype=torch.bool, device=x.device)
        o[b * n:(b + 1) * n] = sink_attention(q[b * n:(b + 1) * n], keys, mask, sink, self.softmax_scale)
    out, _ = self.wo_b(output_rows(self, o, positions, x.dtype))
    return out


def write_target_hidden_kv(self, *, pool, positions, main_hidden=None, target_hidden=None, cache_loc=None,
                           cache_loc_2d=None, commit_lens=None, swa_loc=None, target_hidden_is_projected=False):
    """The context rows' keys from the target's states, into each stage's layer of the draft's pool."""
    if target_hidden_is_projected:
        raise NotImplementedError("sglang-hs DeepSeek-V4 DSpark draft on the CPU engine: pre-projected target states")
    states = target_hidden if main_hidden is None else main_hidden
    if cache_loc is None:
        raise NotImplementedError("sglang-hs DeepSeek-V4 DSpark draft on the CPU engine: an injection without KV slots "
                                  "(a DeepSeekV4TokenToKVPool SWA location)")
    positions = positions.long()
    loc = cache_loc.long()
    if cache_loc_2d is not None and commit_lens is not None:  # a verify pass's commit: each request's first rows
        width = cache_loc_2d.shape[1]
        keep = (torch.arange(width, device=loc.device).unsqueeze(0) < commit_lens.long().view(-1, 1)).reshape(-1)
        states, positions, loc = states[keep], positions[keep], cache_loc_2d.reshape(-1).long()[keep]
    main_x = self.project_target_hidden(states)
    for stage in self.stages:
        attn = stage.self_attn
        kv = _key(attn, main_x, positions)
        pool.set_kv_buffer(attn.attn, loc, kv.unsqueeze(1), kv.unsqueeze(1))


def _record_stream_on_cpu(original):
    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None  # CPU work is synchronous: nothing to order against a stream
        return original(self, stream)

    record_stream.__wrapped__ = original
    return record_stream


def _residual(target_row, draft_row):
    """Where a rejected chain samples its bonus: max(p - q, 0) (a draft probability outside [0, 1] taken as 0, as
    upstream's guard)."""
    draft_row = torch.where((draft_row >= 0) & (draft_row <= 1), draft_row, torch.zeros_like(draft_row))
    return (target_row - draft_row).clamp(min=0)


def _inverse_cdf(weights, coin):
    """The first token whose cumulative weight exceeds coin * total (the last token if none: upstream's fallback)."""
    above = torch.nonzero(weights.cumsum(0) > coin * weights.sum())
    return int(above[0]) if len(above) else weights.shape[0] - 1


def _accepted_chain(target_probs, draft_probs, candidates, coins):
    """How many of a chain's drafts pass: draft j (candidates[j + 1]) while coin_j * q(d) < p(d), with q(d) a
    probability."""
    accepted = 0
    for step in range(1, candidates.shape[0]):
        token = int(candidates[step])
        p, q = float(target_probs[accepted, token]), float(draft_probs[accepted, token])
        if not (0.0 < q <= 1.0 and float(coins[step - 1]) * q < p):
            break
        accepted += 1
    return accepted


def chain_speculative_sampling_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                   retrive_next_token, retrive_next_sibling, uniform_samples,
                                   uniform_samples_for_final_sampling, target_probs, draft_probs, threshold_single,
                                   threshold_acc, deterministic, *, block_verification=False):
    """Upstream's chain rejection sampling (reject_sampling.speculative_sampling_classic_kernel, token by token) on CPU
    tensors: each request's drafts accepted while coin * q(d) < p(d), then its bonus drawn from the target's row
    after the last accepted draft (all accepted) or from max(p - q, 0) there; predicts at the accepted rows' indices,
    accept_index and accept_token_num as the kernel writes them."""
    if block_verification:
        raise NotImplementedError("sglang-hs DeepSeek-V4 DSpark on the CPU engine: block verification "
                                  "(--speculative-use-block-verification)")
    drafts = candidates.shape[1] - 1
    for b in range(candidates.shape[0]):
        accepted = _accepted_chain(target_probs[b], draft_probs[b], candidates[b], uniform_samples[b])
        for step in range(accepted + 1):
            accept_index[b, step] = retrive_index[b, step]
            if step:
                predicts[retrive_index[b, step - 1]] = candidates[b, step]
        accept_token_num[b] = accepted
        weights = target_probs[b, accepted]
        if accepted < drafts:
            weights = _residual(weights, draft_probs[b, accepted])
        predicts[retrive_index[b, accepted]] = _inverse_cdf(weights, float(uniform_samples_for_final_sampling[b]))


def _on_cpu_tensors(torch_version, original):
    def dispatch(*args, **kwargs):
        if inputs_on_cuda(*args, **kwargs):
            return original(*args, **kwargs)
        return torch_version(*args, **kwargs)

    dispatch.__wrapped__ = original
    return dispatch


def inputs_on_cuda(*args, **kwargs):
    from sglang.kernels.ops.speculative.dspark.dispatch import inputs_on_cuda as upstream

    return upstream(*args, **kwargs)


def apply() -> dict:
    import sglang
    from sglang.kernels.ops.speculative.dspark import dspark_accept
    from sglang.srt.models import deepseek_v4_dspark
    from sglang.srt.speculative.dspark_components import dspark_worker_v2

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch dsv4_cpu_dspark targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    originals = {"dspark_worker_v2.DSV4_DRAFT_ATTENTION_BACKEND": dspark_worker_v2.DSV4_DRAFT_ATTENTION_BACKEND,
                 "DSparkAttention.forward": deepseek_v4_dspark.DSparkAttention.forward,
                 "DeepseekV4ForCausalLMDSpark.write_target_hidden_kv":
                     deepseek_v4_dspark.DeepseekV4ForCausalLMDSpark.write_target_hidden_kv,
                 "torch.Tensor.record_stream": torch.Tensor.record_stream,
                 "dspark_accept.chain_speculative_sampling_triton": dspark_accept.chain_speculative_sampling_triton}
    dspark_accept.chain_speculative_sampling_triton = _on_cpu_tensors(
        chain_speculative_sampling_cpu, dspark_accept.chain_speculative_sampling_triton)
    torch.Tensor.record_stream = _record_stream_on_cpu(torch.Tensor.record_stream)
    dspark_worker_v2.DSV4_DRAFT_ATTENTION_BACKEND = DRAFT_BACKEND
    deepseek_v4_dspark.DSparkAttention.forward = dspark_attention_forward
    deepseek_v4_dspark.DeepseekV4ForCausalLMDSpark.write_target_hidden_kv = write_target_hidden_kv
    return originals
