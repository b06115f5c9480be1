"""DeepSeek-V3.2's verify pass on the CPU engine (sglang_hs/server/patches/dsa_spec_verify.py) against a plain-torch
reference, on SGLang's own pools: each draft row's DSA indexer selects its index_topk keys among the request's prefix
and the drafts the tree lets it see (its ancestors and itself), and its attention reads only those. The reference keeps
each request's keys in lists of its own (prefix, then drafts), never reading the pool's layout. Every slot of the KV
pool and the index-key store that no one wrote holds garbage, and requests sit in pool rows out of order at shuffled
slots, so a row that sees a sibling's or a later draft, another request's slot or one key too few differs. Odd sizes:
3 index heads of 24 dims (8 rotary), index_topk 5 below most rows' visible keys, prefixes 1..13, chains of 2 and 3
(the served MTP setting verifies a chain of 4: the last token and 3 drafts) and a tree of 5, both custom-mask layouts SGLang's CPU workers produce.
Measured: worst attention row 7.2e-07 off the reference. Planted: the verify's indexer ignoring the tree mask (a draft
row may select a later or sibling draft's key) fails all four cases (e.g. row 0 selecting position 8 of 7 + 2 keys);
its top-k one short fails all four (4 keys of 5).

Then the MTP draft's own decode steps (--speculative-num-steps > 1; served: 3): eagle_cpu_draft's step backend in the
forward context, each step's indexer and sparse attention over the request's prefix and its branch's drafts so far, at
the slots SGLang's CPU cache-location op assigns. Measured: worst attention row 6.0e-07. Planted in the step spans: one
draft slot too many visible fails all four cases (a row selecting a garbage slot's index key); the step's attention
ignoring the selection (dense over its spans) fails all four (1.1 to 2.5 off)."""
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def sgl(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.srt.layers.layernorm import LayerNorm
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context

        from sglang_hs.server.patches import dsa_spec_verify, dsa_torch_native
    return types.SimpleNamespace(**locals())


H, D, R, TOPK, HIDDEN, Q_LORA = 3, 24, 8, 5, 20, 12


def _indexer(sgl):
    """An Indexer's attributes as dsa_torch_native.indexer_forward_native reads them, random weights."""
    wq, wk, wp = torch.randn(H * D, Q_LORA) * 0.5, torch.randn(D, HIDDEN) * 0.5, torch.randn(H, HIDDEN)
    k_norm = sgl.LayerNorm(D, eps=1e-6)
    with torch.no_grad():
        k_norm.weight.copy_(torch.rand(D) + 0.5)
        k_norm.bias.copy_(torch.randn(D) * 0.1)
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
    ang = torch.arange(64).float()[:, None] * inv[None]
    return types.SimpleNamespace(
        n_heads=H, head_dim=D, rope_head_dim=R, index_topk=TOPK, softmax_scale=D ** -0.5, is_neox_style=True,
        wq_b=lambda x: (F.linear(x, wq), None), wk=lambda x: (F.linear(x, wk), None), k_norm=k_norm,
        weights_proj=types.SimpleNamespace(weight=wp),
        rotary_emb=types.SimpleNamespace(cos_sin_cache=torch.cat([ang.cos(), ang.sin()], dim=-1)),
        ref=dict(wq=wq, wk=wk, wp=wp, k_norm=k_norm, cos=ang.cos(), sin=ang.sin()))


def _ref_rope(x, pos, ref):  # x [..., R] half-split (HF rotate_half)
    cos, sin = ref["cos"][pos], ref["sin"][pos]
    x1, x2 = x[..., :R // 2], x[..., R // 2:]
    while cos.dim() < x1.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _ref_keys(ix, x, pos):
    ref = ix.ref
    k = F.layer_norm(x @ ref["wk"].T, (D,), ref["k_norm"].weight.detach(), ref["k_norm"].bias.detach(), 1e-6)
    return torch.cat((_ref_rope(k[:, :R], pos, ref), k[:, R:]), dim=-1)


def _ref_select(ix, x, q_lora, pos, keys, visible):
    """One query row: the index_topk visible keys with the highest sum_h w_h relu(q_h . k * scale) (HF)."""
    ref = ix.ref
    q = (q_lora @ ref["wq"].T).view(H, D)
    q = torch.cat((_ref_rope(q[:, :R], pos, ref), q[:, R:]), dim=-1)
    w = (x @ ref["wp"].T) * H ** -0.5
    score = (w[:, None] * F.relu(q @ keys.T * D ** -0.5)).sum(0)
    idx = torch.tensor(visible)
    return set(idx[score[idx].topk(min(TOPK, len(visible))).indices].tolist())


def _ancestors(parents, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return sorted(out)


@pytest.mark.parametrize("parents,prefixes,layout", [
    ([-1, 0], [7, 1, 13, 4], "qlen"),  # DeepSeek-V3.2's MTP as served: the last token and one draft
    ([-1, 0, 1], [9, 3], "full"),  # a chain of 2 drafts
    ([-1, 0, 0, 1, 2], [11, 6, 2], "qlen"),  # a tree: rows 1 and 2 siblings, 3 and 4 their children
    ([-1, 0, 0, 1, 2], [5, 12], "full"),
])
def test_each_draft_row_selects_and_attends_among_what_its_tree_lets_it_see(sgl, parents, prefixes, layout):
    torch.manual_seed(len(parents) * 100 + sum(prefixes))
    n, bs, width = len(parents), len(prefixes), 48
    heads, kv_heads, dim, v_dim, scale = 5, 1, 16, 12, 0.3
    slots = 1 + sum(p + n for p in prefixes) + 23
    r2t = sgl.ReqToTokenPool(bs + 2, width, "cpu", False)
    r2t.req_to_token.copy_(torch.randint(1, slots, r2t.req_to_token.shape))  # garbage past each request's row
    pool = sgl.MHATokenToKVPool(slots, 1, torch.float32, kv_heads, dim, 1, "cpu", False, v_head_dim=v_dim)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]) * 3)
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]) * 3)
    store = sgl.dsa_torch_native._index_k_store(pool, 0, D, pool.k_buffer[0])
    store.copy_(torch.randn_like(store) * 3)
    backend = types.SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=r2t, swa_out_cache_loc=None)
    ix = _indexer(sgl)

    req_pool_indices = torch.tensor([bs + 1 - b for b in range(bs)], dtype=torch.int64)
    free = (torch.randperm(slots - 1) + 1).tolist()
    depth = [len(_ancestors(parents, j)) - 1 for j in range(n)]
    out_cache_loc, positions, per_req = [], [], []
    for b, p in enumerate(prefixes):
        row = [free.pop() for _ in range(p + n)]
        r2t.req_to_token[req_pool_indices[b], :len(row)] = torch.tensor(row, dtype=torch.int32)
        pk, pkv, pvv = torch.randn(p, D), torch.randn(p, kv_heads, dim), torch.randn(p, kv_heads, v_dim)
        store[row[:p]] = pk
        pool.k_buffer[0][row[:p]], pool.v_buffer[0][row[:p]] = pkv, pvv
        out_cache_loc += row[p:]
        positions += [p + d for d in depth]
        per_req.append((p, pk, pkv, pvv))
    qlen = torch.zeros(bs, n, n, dtype=torch.bool)
    for j in range(n):
        qlen[:, j, _ancestors(parents, j)] = True
    mask = qlen.flatten() if layout == "qlen" else torch.cat(
        [torch.cat([torch.ones(n, p, dtype=torch.bool), qlen[b]], dim=1).flatten() for b, p in enumerate(prefixes)])
    fb = types.SimpleNamespace(
        forward_mode=sgl.ForwardMode.TARGET_VERIFY, seq_lens_cpu=torch.tensor(prefixes),
        req_pool_indices=req_pool_indices, out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64),
        spec_info=types.SimpleNamespace(draft_token_num=n, custom_mask=mask))

    T = bs * n
    x, q_lora = torch.randn(T, HIDDEN), torch.randn(T, Q_LORA)
    pos = torch.tensor(positions)

    def not_verify(*a, **k):
        raise AssertionError("a verify batch went to the non-verify path")

    sgl.set_forward_context(sgl.ForwardContext(attn_backend=backend))
    try:
        sel = sgl.dsa_spec_verify._indexer_with_verify(not_verify)(ix, x, q_lora, pos, fb, 0)
    finally:
        sgl.set_forward_context(None)
    assert sel.shape == (T, TOPK) and sel.dtype == torch.int32

    q, k, v = torch.randn(T, heads * dim), torch.randn(T, kv_heads, dim), torch.randn(T, kv_heads, v_dim)
    layer = sgl.RadixAttention(heads, dim, scale, kv_heads, 0, v_head_dim=v_dim)
    out = sgl.dsa_spec_verify._attention_with_verify(not_verify)(backend, q, k, v, layer, fb, topk_indices=sel)

    draft_keys = _ref_keys(ix, x, pos)
    worst = 0.0
    for b, (p, pk, pkv, pvv) in enumerate(per_req):
        rows = range(b * n, (b + 1) * n)
        keys = torch.cat([pk, draft_keys[rows.start:rows.stop]])  # the request's own, in position order
        ks, vs = torch.cat([pkv, k[rows.start:rows.stop]]), torch.cat([pvv, v[rows.start:rows.stop]])
        for j, t in enumerate(rows):
            visible = list(range(p)) + [p + a for a in _ancestors(parents, j)]
            want = _ref_select(ix, x[t], q_lora[t], positions[t], keys, visible)
            got = set(sel[t].tolist()) - {-1}
            assert got == want, (b, j, sorted(got), sorted(want))
            assert (sel[t] == -1).sum() == TOPK - len(want)
            chosen = sorted(want)
            w = torch.softmax((q[t].view(heads, dim) @ ks[chosen, 0].T) * scale, dim=-1)
            ref = (w @ vs[chosen, 0]).flatten()
            err = (out[t] - ref).abs().max().item()
            worst = max(worst, err)
    print(f"{layout} n={n} prefixes {prefixes}: worst {worst:.2e}")
    assert worst < 1e-5


@pytest.fixture(scope="module")
def draft(cpu_engine_imports):
    with cpu_engine_imports():
        from sgl_kernel import assign_draft_cache_locs_contiguous_cpu  # the CPU op SGLang's func calls there
        from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

        from sglang_hs.server.patches import eagle_cpu_draft
    return types.SimpleNamespace(**locals())


@pytest.mark.parametrize("topk,steps,prefixes,pad", [
    (1, 3, [7, 1, 13, 4], 0),  # DeepSeek-V3.2's MTP as served: a chain of 3 drafts (steps 0 and 1 run a forward)
    (1, 5, [9, 3], 0),
    (2, 3, [6, 11], 0),  # branches (a DSA tree is refused at launch; the draft's spans hold for one anyway)
    (1, 3, [8, 2], 3),  # DP attention: the batch padded after the spans were built, rows writing slot 0
])
def test_each_draft_step_selects_and_attends_its_prefix_and_own_drafts(sgl, draft, topk, steps, prefixes, pad):
    """The MTP draft's decode steps (eagle_cpu_draft's multi-step draft backend, the forward context's attention
    backend while EagleWorkerV2.draft_forward runs a step): the indexer of branch t's step-i row selects its index_topk
    keys among the request's prefix and that branch's drafts of steps 0..i (its own last), at the slots SGLang's CPU
    cache-location op assigns (seq_len + t * steps + s), and its attention reads only those. The reference keeps each
    branch's keys in lists of its own; every other slot of the pools holds garbage."""
    torch.manual_seed(steps * 100 + topk * 10 + sum(prefixes))
    bs, width = len(prefixes), 48
    heads, kv_heads, dim, v_dim, scale = 5, 1, 16, 12, 0.3
    slots = 1 + sum(p + topk * steps for p in prefixes) + 19
    r2t = sgl.ReqToTokenPool(bs + 2, width, "cpu", False)
    r2t.req_to_token.copy_(torch.randint(1, slots, r2t.req_to_token.shape))
    pool = sgl.MHATokenToKVPool(slots, 1, torch.float32, kv_heads, dim, 1, "cpu", False, v_head_dim=v_dim)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]) * 3)
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]) * 3)
    store = sgl.dsa_torch_native._index_k_store(pool, 0, D, pool.k_buffer[0])
    store.copy_(torch.randn_like(store) * 3)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool,
                                   sliding_window_size=None,
                                   server_args=types.SimpleNamespace(speculative_draft_window_size=None))
    ix = _indexer(sgl)

    req_pool_indices = torch.tensor([bs + 1 - b for b in range(bs)], dtype=torch.int64)
    seq_lens = torch.tensor(prefixes, dtype=torch.int64)
    free = (torch.randperm(slots - 1) + 1).tolist()
    per_req = []
    for b, p in enumerate(prefixes):
        row = [free.pop() for _ in range(p + topk * steps)]
        r2t.req_to_token[req_pool_indices[b], :len(row)] = torch.tensor(row, dtype=torch.int32)
        pk, pkv, pvv = torch.randn(p, D), torch.randn(p, kv_heads, dim), torch.randn(p, kv_heads, v_dim)
        store[row[:p]] = pk
        pool.k_buffer[0][row[:p]], pool.v_buffer[0][row[:p]] = pkv, pvv
        per_req.append((p, pk, pkv, pvv))
    out_cache_loc = torch.empty(bs * topk * steps, dtype=torch.int64)
    draft.assign_draft_cache_locs_contiguous_cpu(req_pool_indices, r2t.req_to_token, seq_lens, out_cache_loc,
                                                 width, topk, steps)
    per_step = draft.per_step_draft_out_cache_loc(out_cache_loc, bs, topk, steps)
    multi = draft.eagle_cpu_draft.TorchNativeMultiStepDraftBackend(runner, topk, steps)
    fb = types.SimpleNamespace(forward_mode=sgl.ForwardMode.DECODE, seq_lens=seq_lens,
                               req_pool_indices=req_pool_indices, out_cache_loc=None)
    multi.init_forward_metadata(fb)  # once per draft, as EagleWorkerV2.draft does

    def not_draft(*a, **k):
        raise AssertionError("a draft step went to the plain decode path")

    rows = bs * topk
    branches = [dict(pos=[], index=[], k=[], v=[]) for _ in range(rows)]  # each branch's own drafts, step order
    worst = 0.0
    for i in range(steps - 1):
        backend = multi.attn_backends[i]
        fb.out_cache_loc = torch.cat([per_step[i], torch.zeros(pad, dtype=torch.int64)])
        x, q_lora = torch.randn(rows + pad, HIDDEN), torch.randn(rows + pad, Q_LORA)
        pos = torch.tensor([prefixes[r // topk] + i for r in range(rows)] + [0] * pad)  # a chain's: seq_len + i
        sgl.set_forward_context(sgl.ForwardContext(attn_backend=backend))
        try:
            sel = sgl.dsa_spec_verify._indexer_with_verify(not_draft)(ix, x, q_lora, pos, fb, 0)
        finally:
            sgl.set_forward_context(None)
        assert sel.shape == (rows + pad, TOPK) and (sel[rows:] == -1).all()  # the padding selects nothing
        q = torch.randn(rows + pad, heads * dim)
        k, v = torch.randn(rows + pad, kv_heads, dim), torch.randn(rows + pad, kv_heads, v_dim)
        layer = sgl.RadixAttention(heads, dim, scale, kv_heads, 0, v_head_dim=v_dim)
        out = backend.forward_decode(q, k, v, layer, fb, topk_indices=sel).view(rows + pad, heads * v_dim)
        assert not out[rows:].any()
        new_keys = _ref_keys(ix, x[:rows], pos[:rows])
        for r in range(rows):
            b, t = divmod(r, topk)
            p, pk, pkv, pvv = per_req[b]
            br = branches[r]
            br["pos"].append(p + t * steps + i)
            br["index"].append(new_keys[r])
            br["k"].append(k[r])
            br["v"].append(v[r])
            keys = torch.zeros(p + topk * steps, D)  # by position in the request's row; only visible ones read
            keys[:p] = pk
            keys[br["pos"]] = torch.stack(br["index"])
            visible = list(range(p)) + br["pos"]
            want = _ref_select(ix, x[r], q_lora[r], pos[r].item(), keys, visible)
            got = set(sel[r].tolist()) - {-1}
            assert got == want, (b, t, i, sorted(got), sorted(want))
            assert (sel[r] == -1).sum() == TOPK - len(want)
            ks = {j: pkv[j, 0] for j in range(p)} | {s: kk[0] for s, kk in zip(br["pos"], br["k"])}
            vs = {j: pvv[j, 0] for j in range(p)} | {s: vv[0] for s, vv in zip(br["pos"], br["v"])}
            chosen = sorted(want)
            w = torch.softmax((q[r].view(heads, dim) @ torch.stack([ks[j] for j in chosen]).T) * scale, dim=-1)
            ref = (w @ torch.stack([vs[j] for j in chosen])).flatten()
            worst = max(worst, (out[r] - ref).abs().max().item())
    print(f"topk {topk} steps {steps} prefixes {prefixes}: worst {worst:.2e}")
    assert worst < 1e-5
    # a plain decode (no draft step backend in the forward context) goes to the indexer it wraps
    sgl.set_forward_context(sgl.ForwardContext(attn_backend=types.SimpleNamespace()))
    try:
        with pytest.raises(AssertionError, match="plain decode path"):
            sgl.dsa_spec_verify._indexer_with_verify(not_draft)(ix, x, q_lora, pos, fb, 0)
    finally:
        sgl.set_forward_context(None)
