"""The CPU engine's multi-step EAGLE draft decode backend (sglang_hs/server/patches/eagle_cpu_draft.py,
TorchNativeMultiStepDraftBackend) against a plain-torch reference, on SGLang's own pools: the draft's slots
laid out by the CPU cache-location op SGLang calls there and split per step by its per_step_draft_out_cache_loc,
as eagle_worker_common.prepare_for_draft and EagleWorkerV2.draft_forward do; then each step's queries attended
over the request's prefix and, of the drafts, only their own branch's steps 0..i (its own token last). The
reference keeps each branch's keys in a list of its own, never reading the pool's layout. Every other slot of
the pool holds garbage, so a query that reads one draft too many, a sibling branch's draft or another
request's slot differs. Odd sizes: head dims 24/20 (GQA 5 query heads over 1 KV head; 3 over 3), prefixes
1..13, top-k 1..3, steps 2..5. Planted: a step that reads one draft too many, or misses its own, fails all
four cases (0.75 to 9.5 off); a branch that sees its siblings' drafts fails the two trees (7.2, 7.6)."""
import types

import pytest
import torch

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def sgl(cpu_engine_imports):
    with cpu_engine_imports():
        from sgl_kernel import assign_draft_cache_locs_contiguous_cpu  # the CPU op SGLang's func calls there
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

        from sglang_hs.server.patches import eagle_cpu_draft
    return types.SimpleNamespace(**locals())


def _reference(q, keys, values, scale):
    """q [heads, d]; keys/values [n, kv heads, d]: softmax(q k^T * scale) v, KV heads repeated over groups."""
    groups = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, n, d]
    v = values.repeat_interleave(groups, dim=1).transpose(0, 1)
    w = torch.softmax((q.unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)  # [heads, n]
    return (w.unsqueeze(1) @ v).squeeze(1)


@pytest.mark.parametrize("heads,kv_heads,topk,steps,prefixes,pad", [
    (5, 1, 1, 3, [7, 1, 13], 0),  # DeepSeek's MTP chain
    (3, 3, 3, 4, [5, 11], 0),  # a tree draft: three branches per request
    (5, 1, 2, 5, [1, 9, 4, 2], 0),
    (3, 3, 1, 2, [6], 0),  # one step backend
    # DP attention: the group's draft batch padded (after the spans were built) to a larger group's, rows at the
    # end writing the padding slot 0
    (3, 1, 2, 3, [4, 9], 3),
])
def test_each_step_attends_the_prefix_and_its_own_branch(sgl, heads, kv_heads, topk, steps, prefixes, pad):
    torch.manual_seed(steps * 10 + topk)
    dim, v_dim, scale = 24, 20, 0.21
    bs, width = len(prefixes), 40
    slots = 1 + sum(p + topk * steps for p in prefixes) + 17
    r2t = sgl.ReqToTokenPool(bs + 2, width, "cpu", False)
    pool = sgl.MHATokenToKVPool(slots, 1, torch.float32, kv_heads, dim, 1, "cpu", False, v_head_dim=v_dim)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]) * 3)  # garbage wherever no one wrote
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]) * 3)
    layer = sgl.RadixAttention(heads, dim, scale, kv_heads, 0, v_head_dim=v_dim)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool,
                                   sliding_window_size=None,
                                   server_args=types.SimpleNamespace(speculative_draft_window_size=None))

    # requests in pool rows out of order, each its prefix + topk * steps draft slots at shuffled KV slots
    req_pool_indices = torch.tensor([bs + 1 - b for b in range(bs)], dtype=torch.int64)
    seq_lens = torch.tensor(prefixes, dtype=torch.int64)
    free = (torch.randperm(slots - 1) + 1).tolist()
    prefix_kv = []
    for b, p in enumerate(prefixes):
        row = [free.pop() for _ in range(p + topk * steps)]
        r2t.req_to_token[req_pool_indices[b], :len(row)] = torch.tensor(row, dtype=torch.int32)
        k, v = torch.randn(p, kv_heads, dim), torch.randn(p, kv_heads, v_dim)
        pool.k_buffer[0][row[:p]], pool.v_buffer[0][row[:p]] = k, v
        prefix_kv.append((k, v))
    out_cache_loc = torch.empty(bs * topk * steps, dtype=torch.int64)
    sgl.assign_draft_cache_locs_contiguous_cpu(req_pool_indices, r2t.req_to_token, seq_lens, out_cache_loc,
                                               width, topk, steps)
    per_step = sgl.per_step_draft_out_cache_loc(out_cache_loc, bs, topk, steps)

    backend = sgl.eagle_cpu_draft.TorchNativeMultiStepDraftBackend(runner, topk, steps)
    assert len(backend.attn_backends) == steps - 1
    batch = types.SimpleNamespace(seq_lens=seq_lens, req_pool_indices=req_pool_indices, out_cache_loc=None)
    backend.init_forward_metadata(batch)  # once per draft, as EagleWorkerV2.draft does
    drafts = [([], []) for _ in range(bs * topk)]  # the reference: each branch's own draft keys, in step order
    worst = 0.0
    for i in range(steps - 1):
        batch.out_cache_loc = torch.cat([per_step[i], torch.zeros(pad, dtype=torch.int64)])
        rows = bs * topk
        q = torch.randn(rows + pad, heads * dim)
        k, v = torch.randn(rows + pad, kv_heads, dim), torch.randn(rows + pad, kv_heads, v_dim)
        got = backend.attn_backends[i].forward_decode(q, k, v, layer, batch).view(rows + pad, heads, v_dim)
        assert not got[rows:].any()  # the padding's rows: zeros
        for r in range(rows):
            drafts[r][0].append(k[r])
            drafts[r][1].append(v[r])
            pk, pv = prefix_kv[r // topk]
            keys = torch.cat([pk, torch.stack(drafts[r][0])])
            values = torch.cat([pv, torch.stack(drafts[r][1])])
            want = _reference(q[r].view(heads, dim), keys, values, scale)
            worst = max(worst, (got[r] - want).abs().max().item())
    print(f"topk {topk} steps {steps}: max abs difference {worst:.3g}")
    assert worst < 1e-5


def test_refusals(sgl):
    pool = sgl.MHATokenToKVPool(64, 4, torch.float32, 1, 8, 1, "cpu", False)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=sgl.ReqToTokenPool(2, 16, "cpu", False),
                                   token_to_kv_pool=pool, sliding_window_size=None,
                                   server_args=types.SimpleNamespace(speculative_draft_window_size=None))
    with pytest.raises(NotImplementedError, match="--page-size 1"):
        sgl.eagle_cpu_draft.TorchNativeMultiStepDraftBackend(runner, 1, 3)
    runner.token_to_kv_pool = sgl.MHATokenToKVPool(64, 1, torch.float32, 1, 8, 1, "cpu", False)
    runner.sliding_window_size = 8
    with pytest.raises(NotImplementedError, match="sliding-window"):
        sgl.eagle_cpu_draft.TorchNativeMultiStepDraftBackend(runner, 1, 3)
    runner.sliding_window_size = None
    step = sgl.eagle_cpu_draft.TorchNativeMultiStepDraftBackend(runner, 1, 3).attn_backends[0]
    step.init_forward_metadata(types.SimpleNamespace(seq_lens=torch.tensor([2]), req_pool_indices=torch.tensor([1])))
    q, k = torch.randn(1, 8), torch.randn(1, 1, 8)
    batch = types.SimpleNamespace(out_cache_loc=torch.tensor([5]))
    with pytest.raises(NotImplementedError, match="q_rope has no CPU path"):  # a keyword it would ignore
        step.forward_decode(q, k, k, sgl.RadixAttention(1, 8, 0.3, 1, 0), batch, q_rope=q)
    with pytest.raises(NotImplementedError, match="sliding-window"):  # a layer of its own window
        step.forward_decode(q, k, k, sgl.RadixAttention(1, 8, 0.3, 1, 0, sliding_window_size=4), batch)
    with pytest.raises(RuntimeError, match="got 0 query rows for 1 branches"):
        step.forward_decode(q[:0], k[:0], k[:0], sgl.RadixAttention(1, 8, 0.3, 1, 0), batch)
