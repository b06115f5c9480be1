"""The CPU stand-in's speculative-decoding ops (sglang_hs/server/cpu/stubs/sgl_kernel/spec_ops.py) against
independent references: SGLang 0.5.23's own Triton twins of the tree ops (its XPU path, run here by Triton's
interpreter in a process of its own: TRITON_INTERPRET is read at import), its host-side tree links
(ngram_worker._derive_tree_links), and per-request slicing for the cache-location ops. Random trees of odd
sizes, nodes numbered parents first as SGLang's drafters number them, batch sizes 1..5."""
import os
import subprocess
import sys

import pytest
import torch

from sglang_hs.server.cpu import stubs_dir

sys.path.insert(0, stubs_dir())
from sgl_kernel import spec_ops  # noqa: E402

sys.path.remove(stubs_dir())


def random_trees(bs, n, gen):
    """[bs, n] parents (-1 for the root, node 0; parent < child) and the [bs, n, n] ancestor-or-self mask."""
    parents = torch.full((bs, n), -1, dtype=torch.long)
    mask = torch.zeros((bs, n, n), dtype=torch.bool)
    for b in range(bs):
        mask[b, 0, 0] = True
        for i in range(1, n):
            p = int(torch.randint(0, i, (1,), generator=gen))
            parents[b, i] = p
            mask[b, i] = mask[b, p]
            mask[b, i, i] = True
    return parents, mask


def reconstruct(mask, seq_lens, n):
    bs = mask.shape[0]
    out = [torch.full((bs * n,), 99, dtype=torch.long) for _ in range(4)]
    spec_ops.reconstruct_indices_from_tree_mask(mask.reshape(-1), seq_lens, *out, bs, n)
    return [t.view(bs, n) for t in out]


@pytest.mark.parametrize("bs,n", [(1, 1), (1, 7), (3, 12), (5, 5)])
def test_reconstruct_agrees_with_sglangs_host_links(bs, n):
    gen = torch.Generator().manual_seed(bs * 100 + n)
    parents, mask = random_trees(bs, n, gen)
    seq_lens = torch.randint(1, 50, (bs,), generator=gen)
    positions, index, next_token, next_sibling = reconstruct(mask, seq_lens, n)
    depth = mask.sum(-1) - 1
    assert torch.equal(positions, depth + seq_lens[:, None])
    assert torch.equal(index, torch.arange(bs * n).view(bs, n))
    # SGLang's host-side derivation (ngram_worker._derive_tree_links), restated: first child, next sibling
    for b in range(bs):
        children = {i: [k for k in range(n) if parents[b, k] == i] for i in range(n)}
        for i in range(n):
            assert next_token[b, i] == (children[i][0] if children[i] else -1)
            p = int(parents[b, i])
            later = [k for k in children.get(p, []) if k > i] if p >= 0 else []
            assert next_sibling[b, i] == (later[0] if later else -1)


def test_fill_and_assign_ops_against_slicing():
    gen = torch.Generator().manual_seed(3)
    req_to_token = torch.randint(0, 10_000, (6, 40), dtype=torch.int32, generator=gen)
    rpi = torch.tensor([4, 1, 5], dtype=torch.long)
    start, end = torch.tensor([3, 0, 17]), torch.tensor([9, 0, 30])  # the second request empty
    out = torch.empty(int((end - start).sum()), dtype=torch.long)
    spec_ops.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, out, 40)
    ref = torch.cat([req_to_token[r, s:e].long() for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist())])
    assert torch.equal(out, ref)
    back = torch.zeros_like(req_to_token)
    spec_ops.assign_req_to_token_pool_cpu(rpi, back, start, end, ref, 40)
    for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()):
        assert torch.equal(back[r, s:e], req_to_token[r, s:e])
    assert int(back.count_nonzero()) == int(req_to_token[4, 3:9].count_nonzero() + req_to_token[5, 17:30].count_nonzero())
    seq = torch.tensor([2, 7, 11])
    draft = torch.empty(3 * 2 * 3, dtype=torch.long)
    spec_ops.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq, draft, 40, 2, 3)
    assert torch.equal(draft.view(3, 6), torch.stack([req_to_token[r, s:s + 6].long()
                                                       for r, s in zip(rpi.tolist(), seq.tolist())]))
    with pytest.raises(ValueError, match="out_cache_loc has 5 entries"):
        spec_ops.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq, torch.empty(5, dtype=torch.long),
                                                        40, 2, 3)
    accept_index = torch.tensor([[0, 2, -1], [3, 4, 5]], dtype=torch.int32)
    locs = torch.arange(100, 106, dtype=torch.long)
    got = torch.full((6,), -7, dtype=torch.long)
    spec_ops.fill_accept_out_cache_loc_cpu(accept_index, locs, got)  # SGLang 0.5.23 passes no size
    assert got.tolist() == [100, 102, 103, 104, 105, -7]
    bonus = torch.zeros(2, dtype=torch.int32)
    spec_ops.fill_bonus_tokens_cpu(torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int32),
                                   torch.tensor([2, 3], dtype=torch.int32), bonus, 3)
    assert bonus.tolist() == [6, 10]


TRITON_TWINS = r"""
import sys, torch
sys.path.insert(0, {stubs!r}); sys.path.insert(0, {tests!r})
from sgl_kernel import spec_ops
from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
from test_cpu_spec_ops import random_trees, reconstruct
checked = 0
for seed, (bs, n, steps) in enumerate([(1, 1, 1), (1, 6, 4), (3, 12, 6), (4, 9, 9), (5, 16, 5)]):
    gen = torch.Generator().manual_seed(seed)
    parents, mask = random_trees(bs, n, gen)
    seq_lens = torch.randint(1, 60, (bs,), generator=gen)
    ours = reconstruct(mask, seq_lens, n)
    theirs = [torch.full((bs * n,), 99, dtype=torch.long) for _ in range(4)]
    reconstruct_indices_from_tree_mask_triton(mask.reshape(-1), seq_lens, *theirs, bs, n)
    for name, a, b in zip(("positions", "index", "next_token", "next_sibling"), ours, theirs):
        assert torch.equal(a, b.view(bs, n)), (seed, name, a, b.view(bs, n))
    _, index, next_token, next_sibling = ours
    vocab = 3  # few tokens: drafts match the target's argmax often, along several branches
    for trial in range(4):
        cand = torch.randint(0, vocab, (bs, n), generator=gen)
        target = torch.randint(0, vocab, (bs, n), generator=gen)
        outs = []
        for fn in (spec_ops.verify_tree_greedy_cpu, verify_tree_greedy_triton):
            predicts = torch.full((bs * n,), -5, dtype=torch.int32)
            accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
            accept_num = torch.full((bs,), -3, dtype=torch.int32)
            fn(predicts, accept_index, accept_num, cand, index, next_token, next_sibling, target)
            outs.append((predicts, accept_index, accept_num))
        for name, a, b in zip(("predicts", "accept_index", "accept_num"), *outs):
            assert torch.equal(a, b), (seed, trial, name, a, b)
        checked += int(outs[0][2].sum())
assert checked > 5, checked  # drafts were accepted, not only roots

# EAGLE's tree: parent_list and selected_index made by SGLang's own top-k expansion (select_top_k_tokens,
# organize_draft_results) from random draft scores, built by ours and by SGLang's Triton twin
from sglang.srt.speculative.spec_utils import select_top_k_tokens
from sglang.srt.speculative.eagle_utils import organize_draft_results
from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton
trees = 0
for seed, (bs, topk, steps, n) in enumerate([(1, 1, 1, 2), (2, 1, 3, 4), (3, 2, 3, 5), (2, 4, 3, 8), (4, 3, 4, 7)]):
    gen = torch.Generator().manual_seed(100 + seed)
    scores, hidden, token_list, score_list, parents_list = None, torch.zeros(bs, 4), [], [], []
    for i in range(steps):
        rows = bs if i == 0 else bs * topk
        p = torch.rand(rows, topk, generator=gen).sort(dim=-1, descending=True).values
        idx = torch.randint(0, 50, (rows, topk), generator=gen)
        _, hidden, scores, (sc, tok, par) = select_top_k_tokens(i, p, idx, hidden, scores, topk)
        score_list.append(sc); token_list.append(tok); parents_list.append(par)
    parent_list, selected, _ = organize_draft_results(score_list, token_list, parents_list, n)
    seq_lens = torch.randint(1, 40, (bs,), generator=gen)

    def both_builds(chosen, case):
        for mode in (0, 1):
            size = bs * n * n + (int(seq_lens.sum()) * n if mode == 0 else 0)
            outs = []
            for fn in (spec_ops.build_tree_kernel_efficient_cpu, sgl_build_tree_kernel_triton):
                mask = torch.full((size,), True)
                pos = torch.full((bs * n,), -9, dtype=torch.long)
                ri, rn, rs = torch.full((3, bs, n), -1, dtype=torch.long)
                fn(parent_list, chosen, seq_lens, mask, pos, ri, rn, rs, topk, steps, n, mode)
                outs.append((mask, pos, ri, rn, rs))
            for name, a, b in zip(("tree_mask", "positions", "index", "next_token", "next_sibling"), *outs):
                assert torch.equal(a, b), (case, seed, mode, name, a, b)
        return 2

    trees += both_builds(selected, "tree")
    # a selected node whose parent was not selected (possible when scores tie): it hangs nowhere, and its
    # mask walk stops. A selected parent's id is replaced by a valid expansion id that nothing refers to.
    referred = {{int(parent_list[b, t // topk]) for b in range(bs) for t in selected[b].tolist() if t // topk > 0}}
    hit = [(b, c) for b in range(bs) for c in range(n - 1) if int(selected[b, c]) in referred]
    spare = [t for t in range(topk * parent_list.shape[1]) if t // topk < parent_list.shape[1]
             and t not in referred and all(t not in selected[b].tolist() for b in range(bs))]
    if hit and spare:
        b, c = hit[0]
        orphaned = selected.clone()
        orphaned[b, c] = spare[0]
        trees += both_builds(orphaned, "orphan")
assert trees >= 12, trees  # 5 trees and at least one with an orphaned node, each in both layouts
print("OK", checked)
"""


def test_tree_ops_agree_with_sglangs_triton_twins():
    """Our reconstruct, greedy verification and EAGLE tree build (QLEN and FULL masks, top-k 1 to 4) against
    SGLang's Triton kernels of the same contract, run by Triton's interpreter on CPU tensors in a child
    process."""
    env = dict(os.environ, TRITON_INTERPRET="1", SGLANG_USE_CPU_ENGINE="1")
    code = TRITON_TWINS.format(stubs=stubs_dir(), tests=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
