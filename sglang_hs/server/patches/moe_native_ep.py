"""CPU engine, expert parallel: the native MoE runner skips the experts of other ranks.

With `--ep-size > 1` SGLang's standard dispatcher maps each token's top-k global expert ids to this
rank's local ids and marks experts held by other ranks with the drop sentinel -1
(token_dispatcher/standard.py). Without AMX the CPU engine runs `moe_forward_native`
(layers/moe/fused_moe_native.py), which scatters the ids into a count table and fails on -1 ("index -1
is out of bounds"), so no EP server answers a request. When a step has such entries, the patch calls
SGLang's function once per top-k column on the rows whose entry is local, with weight 1 (so it returns
that expert's output exactly as SGLang computes it), and adds the outputs times their weights in the
weights' dtype, cast to the model's once: SGLang's own arithmetic for the local experts, dropped entries
never computed (no 0 * inf); the other ranks add their experts' share in the all-reduce that follows.
Steps without -1 call it unchanged. (One call with every -1 sent to some local expert would not do: a
token with two such entries would be counted once by the function's scatter_ and lose a row.) See the ledger
in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import functools

import torch

from sglang_hs.version import SGLANG_VERSION

ORIGINALS = {}


def apply():
    """Wrap fused_moe_native.moe_forward_native; returns the original (for tests). Idempotent."""
    import sglang
    from sglang.srt.layers.moe import fused_moe_native as fmn

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch moe_native_ep targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    if "moe_forward_native" in ORIGINALS:
        return ORIGINALS["moe_forward_native"]
    original = ORIGINALS["moe_forward_native"] = fmn.moe_forward_native

    @functools.wraps(original)
    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        topk_weights, topk_ids = topk_output[0], topk_output[1]
        dropped = topk_ids < 0
        if not bool(dropped.any()):
            return original(layer, x, topk_output, moe_runner_config)
        # One top-k column at a time, local entries only: the original counts a token's experts with
        # scatter_ (set, not add), so two entries of one row sent to the same expert would lose a row.
        out = torch.zeros(x.shape[0], x.shape[-1], dtype=topk_weights.dtype, device=x.device)
        for j in range(topk_ids.shape[1]):
            rows = (~dropped[:, j]).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            column = topk_output._replace(topk_weights=torch.ones_like(topk_weights[rows, j:j + 1]),
                                          topk_ids=topk_ids[rows, j:j + 1])
            y = original(layer, x[rows], column, moe_runner_config)  # the expert's output, in x's dtype
            out.index_add_(0, rows, y.to(out.dtype) * topk_weights[rows, j:j + 1])
        return out.to(x.dtype)

    fmn.moe_forward_native = moe_forward_native
    return original
