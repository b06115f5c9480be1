"""sgl_kernel's CPU speculative-decoding ops, in plain torch, for the CPU engine's stand-in.

SGLang 0.5.23's speculative workers call these on the CPU engine (kernels/ops/speculative/cache_locs.py,
spec_tree.py, eagle.py, reconstruct_tree.py; mem_cache/allocation.py). The real ones live in sgl-kernel's
CPU build (csrc/cpu/), which PyPI does not ship. Each function here has the C++ op's signature and
contract, written from it (arguments mutated in place where the op mutates them); a Python loop runs
over requests, never over tokens of a forward. tests/unit/test_cpu_spec_ops.py checks each against an
independent reference (SGLang's own Triton kernel or host code where it has one).
"""
from __future__ import annotations

import torch


def _ranges(start: torch.Tensor, end: torch.Tensor):
    return [(int(s), int(e)) for s, e in zip(start.tolist(), end.tolist())]


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    """out_cache_loc = concat over requests i of req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    pos = 0
    for i, (s, e) in enumerate(_ranges(start_offset, end_offset)):
        out_cache_loc[pos:pos + e - s] = req_to_token[int(req_pool_indices[i]), s:e]
        pos += e - s


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    """The inverse: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i] - start[i] entries of
    out_cache_loc, request after request."""
    pos = 0
    for i, (s, e) in enumerate(_ranges(start_offset, end_offset)):
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[pos:pos + e - s].to(req_to_token.dtype)
        pos += e - s


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_steps) -> None:
    """out_cache_loc[i * topk * num_steps:][:topk * num_steps] = req_to_token[req i, seq_lens[i]:][:topk * num_steps]."""
    n = int(topk) * int(num_steps)
    if out_cache_loc.numel() != req_pool_indices.numel() * n:
        raise ValueError(f"assign_draft_cache_locs_contiguous_cpu: out_cache_loc has {out_cache_loc.numel()} "
                         f"entries, expected {req_pool_indices.numel()} x {n}")
    out = out_cache_loc.view(-1, n) if n else out_cache_loc
    for i, s in enumerate(seq_lens.tolist()):
        out[i] = req_to_token[int(req_pool_indices[i]), int(s):int(s) + n]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc, size=None) -> None:
    """accept_out_cache_loc[:m] = out_cache_loc[the entries of accept_index[:size] that are > -1], in order;
    the rest is left as it was. SGLang 0.5.23 calls it without `size` (all of accept_index)."""
    idx = accept_index.reshape(-1)
    idx = (idx if size is None else idx[: int(size)]).long()
    picked = out_cache_loc[idx[idx > -1]]
    accept_out_cache_loc[: picked.numel()] = picked


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """bonus_tokens[i] = accept_tokens[accept_stride * i + accept_lens[i] - 1]: each request's last accepted."""
    lens = accept_lens.long()
    where = torch.arange(lens.numel(), dtype=torch.long) * int(accept_stride) + lens - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[where])


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Greedy tree verification. For each request b: walk down from the root (node 0); at each depth take the
    first child, in sibling order, whose draft token equals the target's argmax at the last accepted node;
    stop when none does or after accept_index.shape[1] - 1 steps. accept_index[b] gets the accepted nodes'
    flat indices (retrive_index), root first; accept_token_num[b] the number of accepted drafts (root
    excluded); predicts[flat index of each accepted node] the target's token there (the last one's is the
    bonus token). Entries of nodes not accepted are left as they were."""
    bs, steps = candidates.shape[0], accept_index.shape[1]
    cand, ri = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        last = ri[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    predicts[last] = target[last]
                    accepted += 1
                    accept_index[b, accepted] = ri[b][cur]
                    last = ri[b][cur]
                    break
                cur = sib[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def _first_true(x: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, -1 where there is none."""
    return torch.where(x.any(-1), x.to(torch.int8).argmax(-1), torch.full(x.shape[:-1], -1, dtype=torch.long))


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token,
                                       retrive_next_sibling, batch_size, draft_token_num) -> None:
    """NGRAM's verify metadata from its tree mask (sgl_kernel.speculative's op; SGLang's Triton twin in
    kernels/ops/speculative/reconstruct_tree.py states the contract). With n = draft_token_num and
    anc[b, i, j] = tree_mask[b, i, j] and j < i (j is an ancestor of i): positions[b, i] = #ancestors of i +
    verified_seq_len[b]; retrive_index[b, i] = b * n + i; next_token[b, i] = the smallest k with i an ancestor
    of k (its first child), else -1; next_sibling[b, i] = the smallest k > i with the same parent (the
    largest ancestor), else -1, and -1 for the root."""
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    order = torch.arange(n)
    anc = tree_mask.reshape(bs, n, n).bool() & (order[None, :] < order[:, None])
    positions.view(bs, n).copy_(anc.sum(-1) + verified_seq_len.reshape(bs, 1).long())
    retrive_index.view(bs, n).copy_(torch.arange(bs * n).view(bs, n))
    parent = torch.where(anc.any(-1), (anc.long() * order).argmax(-1), torch.full((bs, n), -1, dtype=torch.long))
    retrive_next_token.view(bs, n).copy_(_first_true(anc.transpose(1, 2)))
    later = order[None, :] > order[:, None]  # [i, k]: k > i
    same = (parent[:, None, :] == parent[:, :, None]) & later & (parent[:, :, None] >= 0)
    retrive_next_sibling.view(bs, n).copy_(_first_true(same))


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode) -> None:
    """EAGLE's draft tree from its top-k expansion. selected_index [bs, n - 1] holds the chosen draft tokens'
    ids in the expansion (parent_list [bs, topk * (depth - 1) + 1] the ids of their parents), in the order
    of the verify tokens 1..n-1 (token 0 is the root, the last verified token). Per request b: retrive_index
    = b * n + i; next_token / next_sibling link each node to its first child and the next child of its
    parent (children inserted from the last, so siblings in index order); positions = seq_len + depth; and
    the tree mask, each row the node's ancestors and itself, in QLEN layout (mode 1: [n, n] per request)
    or FULL layout (mode 0: the row's [seq_len + n] columns, of which the prefix's are left as they are).
    As SGLang's Triton twin (spec_tree.sgl_build_tree_kernel_efficient_triton) walks it: a parent is looked
    for in the request's own row, a node whose parent was not selected hangs nowhere (no link) and its mask
    walk stops there, and the walk up takes at most `depth` steps."""
    mode, n, k = int(tree_mask_mode), int(draft_token_num), int(topk)
    if mode == 2:
        raise NotImplementedError("build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING has no CPU path")
    bs = parent_list.shape[0]
    parents, seq = parent_list.tolist(), verified_seq_len.tolist()
    sel = selected_index.reshape(bs, -1).tolist()

    def where_selected(b, token):  # the verify index - 1 of expansion id `token` in request b, or None
        return next((c for c in range(n - 1) if sel[b][c] == token), None)

    ri, nxt, sib = retrive_index.view(bs, n), retrive_next_token.view(bs, n), retrive_next_sibling.view(bs, n)
    pos, mask = positions.view(-1), tree_mask.view(-1)
    full_start = 0
    for b in range(bs):
        off, L = b * n, int(seq[b])
        pos[off] = L
        ri[b, 0] = off
        for i in range(n - 1, 0, -1):
            ri[b, i] = off + i
            parent_tb = sel[b][i - 1] // k
            at = 0  # the root
            if parent_tb > 0:
                c = where_selected(b, parents[b][parent_tb])
                if c is None:
                    continue
                at = c + 1
            first = int(nxt[b, at])
            nxt[b, at] = i
            if first != -1:
                sib[b, i] = first
        for tid in range(n):
            row = (off + tid) * n if mode == 1 else full_start + (L + n) * tid + L
            mask[row] = True
            mask[row + 1:row + n] = False
            if tid == 0:
                continue
            depth_of, cur = 0, tid - 1
            for _ in range(int(depth)):
                depth_of += 1
                mask[row + cur + 1] = True
                parent_tb = sel[b][cur] // k
                if parent_tb == 0:
                    break
                cur = where_selected(b, parents[b][parent_tb])
                if cur is None:
                    break
            pos[off + tid] = depth_of + L
        full_start += (L + n) * n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """An MHA KV pool's move (memory_pool.py `move_kv_cache`, and its warm-up at start-up): in every buffer
    `data_ptrs[j]` (a layer's K or V, `strides[j]` bytes per slot), slot tgt_loc[i] = slot src_loc[i], all
    sources read before any target is written (SGLang's Triton twin, `copy_all_layer_kv_cache_tiled`, is
    safe in place the same way). The buffers are raw addresses, as the real op takes them."""
    import ctypes

    tgt, src = tgt_loc.to(torch.long).cpu(), src_loc.to(torch.long).cpu()
    if tgt.numel() == 0:
        return
    if tgt.shape != src.shape:
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {tgt.numel()} targets for {src.numel()} sources")
    slots = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(slots, int(stride))
        buf[tgt] = buf[src].clone()

