"""The CPU engine's speculative verify pass (sglang_hs/server/patches/spec_verify_torch_native.py, verify_attention)
against a plain-torch reference on SGLang's own pools: each request's draft rows attend its prefix and, of the
drafts, only what the tree mask lets them see, in both mask layouts SGLang's CPU workers produce (QLEN: drafts x
drafts; FULL: drafts x prefix + drafts, with prefix keys masked too). Requests sit in pool rows out of order at
shuffled KV slots and every other slot holds garbage, so a row that reads a key it must not differs.
Odd sizes: head dims 24/20, GQA 5 query heads over 1 KV head, prefixes 1..13, 3 to 5 draft tokens.

Under DP attention SGLang pads a group's verify batch to the largest group's (ForwardBatch.prepare_mlp_sync_batch:
requests past `_original_batch_size`, pool row 0, the padding seq len, KV at slot 0) while the tree mask covers the
batch's own requests only: those rows are zeros and the real ones exact. Before that case was handled, a
DP-attention EAGLE server's scheduler died on its first verify with a padded group ("a custom mask of 16 entries for
2 requests of 4 drafts")."""
import types

import pytest
import torch

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def sgl(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from sglang_hs.server.patches import spec_verify_torch_native
    return types.SimpleNamespace(**locals())


def _tree(n, gen):
    """A random draft tree of n tokens (token 0 the root, the last verified token): [n, n] bool, each row its
    ancestors and itself."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


@pytest.mark.parametrize("layout", ["qlen", "full"])
@pytest.mark.parametrize("heads,kv_heads,n,prefixes,pad,extra", [
    (5, 1, 4, [7, 1, 13], 0, 0),  # DeepSeek's MTP chain of 3 drafts + the last token, as a tree
    (3, 3, 5, [5, 11], 0, 0),
    (5, 1, 4, [9], 2, 0),  # DP attention: one request, the batch padded by two to a larger group's
    # ... and its tokens rounded up to a multiple of the group's attention TP size (9 -> 10 rows at attention TP 2)
    (3, 1, 3, [4, 2], 1, 1),
])
def test_each_draft_row_attends_its_prefix_and_its_tree_ancestors(sgl, layout, heads, kv_heads, n, prefixes, pad,
                                                                  extra):
    gen = torch.Generator().manual_seed(n * 10 + len(prefixes) + pad)
    dim, v_dim, scale = 24, 20, 0.19
    bs, width = len(prefixes), 40
    slots = 1 + sum(p + n for p in prefixes) + 11
    r2t = sgl.ReqToTokenPool(bs + 2, width, "cpu", False)
    pool = sgl.MHATokenToKVPool(slots, 1, torch.float32, kv_heads, dim, 1, "cpu", False, v_head_dim=v_dim)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen) * 3)  # garbage wherever no one wrote
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen) * 3)
    layer = sgl.RadixAttention(heads, dim, scale, kv_heads, 0, v_head_dim=v_dim)

    reqs = [bs + 1 - b for b in range(bs)]  # pool rows out of order
    free = (torch.randperm(slots - 1, generator=gen) + 1).tolist()
    out_cache_loc, keys, masks, full_mask = [], [], [], []
    for req, p in zip(reqs, prefixes):
        row = [free.pop() for _ in range(p + n)]
        r2t.req_to_token[req, :len(row)] = torch.tensor(row, dtype=torch.int32)
        k, v = torch.randn(p, kv_heads, dim, generator=gen), torch.randn(p, kv_heads, v_dim, generator=gen)
        pool.k_buffer[0][row[:p]], pool.v_buffer[0][row[:p]] = k, v
        keys.append((k, v))
        out_cache_loc += row[p:]
        tree = _tree(n, gen)
        visible = torch.ones(n, p, dtype=torch.bool)
        if layout == "full":  # FULL masks carry the prefix too: hide one prefix key from one draft
            visible[n - 1, p // 2] = False
        masks.append(torch.cat([visible, tree], dim=1))
        full_mask.append(torch.cat([visible, tree], dim=1).reshape(-1) if layout == "full" else tree.reshape(-1))
    rows = (bs + pad) * n + extra
    q = torch.randn(rows, heads * dim, generator=gen)
    k = torch.randn(rows, kv_heads, dim, generator=gen)
    v = torch.randn(rows, kv_heads, v_dim, generator=gen)
    padded = types.SimpleNamespace(
        spec_info=types.SimpleNamespace(draft_token_num=n, custom_mask=torch.cat(full_mask)),
        seq_lens_cpu=torch.tensor(prefixes + [1] * pad), req_pool_indices=torch.tensor(reqs + [0] * pad),
        out_cache_loc=torch.tensor(out_cache_loc + [0] * (pad * n + extra)), _original_batch_size=bs if pad else None)
    backend = types.SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=r2t, swa_out_cache_loc=None)

    got = sgl.spec_verify_torch_native.verify_attention(backend, q, k, v, layer, padded).view(rows, heads, v_dim)

    assert not got[bs * n:].any()  # the padding's rows: zeros
    worst, groups = 0.0, heads // kv_heads
    for b, ((pk, pv), mask) in enumerate(zip(keys, masks)):
        drafts = slice(b * n, (b + 1) * n)
        key = torch.cat([pk, k[drafts]]).repeat_interleave(groups, dim=1).transpose(0, 1)  # [heads, p + n, d]
        value = torch.cat([pv, v[drafts]]).repeat_interleave(groups, dim=1).transpose(0, 1)
        query = q[drafts].view(n, heads, dim).transpose(0, 1)  # [heads, n, d]
        w = (query @ key.transpose(1, 2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        want = (w @ value).transpose(0, 1)  # [n, heads, v_dim]
        worst = max(worst, (got[drafts] - want).abs().max().item())
    print(f"{layout} n {n} prefixes {prefixes} pad {pad} extra {extra}: max abs difference {worst:.3g}")
    assert worst < 1e-5


def test_a_mask_that_fits_no_layout_is_refused(sgl):
    spec = types.SimpleNamespace(custom_mask=torch.ones(7, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="a custom mask of 7 entries for 2 requests of 2 drafts"):
        sgl.spec_verify_torch_native._tree_masks(spec, [3, 4], 2)
