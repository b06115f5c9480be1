"""The CPU engine's expert-parallel fix (sglang_hs/server/patches/moe_native_ep.py) against SGLang's own
`moe_forward_native` on every expert: the experts split over two "ranks" (each sees its own experts as
local ids and the other's as -1, as SGLang's standard dispatcher gives them), each rank's patched output,
summed as the all-reduce sums them, equals the unsplit output; entries dropped on a rank are never
computed (an expert that would return inf for them leaves the output finite); steps without -1 are
SGLang's function unchanged."""
import types

import pytest
import torch


@pytest.fixture(scope="module")
def fmn(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.srt.layers.moe import fused_moe_native
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        from sglang_hs.server.patches import moe_native_ep
    before = fused_moe_native.moe_forward_native
    original = moe_native_ep.apply()
    patched = fused_moe_native.moe_forward_native
    fused_moe_native.moe_forward_native = before  # other tests see SGLang's module as it was
    return types.SimpleNamespace(original=original, patched=patched, cfg=MoeRunnerConfig(activation="silu"),
                                 out=StandardTopKOutput)


def _layer(w13, w2):
    return types.SimpleNamespace(num_experts=w13.shape[0], w13_weight=w13, w2_weight=w2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T,E,K,H,I", [(1, 4, 2, 16, 8), (37, 8, 3, 48, 24), (64, 6, 6, 32, 16)])
def test_two_ranks_sum_to_the_unsplit_moe(fmn, dtype, tol, T, E, K, H, I):
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=g)
    ref = fmn.original(_layer(w13, w2), x, fmn.out(weights, ids, torch.zeros(T, E)), fmn.cfg)
    half = E // 2
    total = torch.zeros(T, H)
    for lo, hi in ((0, half), (half, E)):  # rank 0 holds experts [0, half), rank 1 the rest
        local = torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, -1))
        y = fmn.patched(_layer(w13[lo:hi], w2[lo:hi]), x, fmn.out(weights, local, torch.zeros(T, E)), fmn.cfg)
        assert y.shape == (T, H) and y.dtype == dtype
        total += y.float()
    err = ((total - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6))
    print(f"{dtype} T={T} E={E} K={K}: max row rel err {err.max():.2e}, mean {err.mean():.2e}")
    assert err.max() < tol


def test_dropped_entries_are_not_computed(fmn):
    T, E, K, H, I = 5, 4, 2, 8, 4
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    w2[0] = float("inf")  # local expert 0 would poison any row sent to it
    ids = torch.tensor([[1, -1], [-1, 2], [3, -1], [-1, -1], [2, 1]], dtype=torch.int32)
    y = fmn.patched(_layer(w13, w2), x, fmn.out(torch.rand(T, K), ids, torch.zeros(T, E)), fmn.cfg)
    assert torch.isfinite(y).all(), y
    assert (y[3] == 0).all()  # a token with no local expert adds nothing


def test_steps_without_drops_are_sglangs_function(fmn):
    T, E, K, H, I = 9, 4, 2, 8, 4
    x, w13, w2 = torch.randn(T, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    out = fmn.out(torch.rand(T, K), ids, torch.zeros(T, E))
    assert torch.equal(fmn.patched(_layer(w13, w2), x, out, fmn.cfg), fmn.original(_layer(w13, w2), x, out, fmn.cfg))
