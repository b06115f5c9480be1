"""Both capture copies against the plain-torch reference: the Triton kernel (the CUDA path) on the CPU
under TRITON_INTERPRET=1, and the compiled C++ op the server's CPU path uses (csrc/copy_rows_cpu.cpp).

Odd hidden sizes, K = 1..4, bf16 and fp16, with and without the final state, int32 and int64 slots,
non-contiguous aux rows, and graph-style padded rows aimed at the padding slot 0. A copy is exact, so
the tolerance is zero for every dtype; the store is poisoned first so an unwritten element shows.
Slots outside the store: the C++ op refuses the call before writing; the kernel drops those rows, counts
them for `SlotErrors.check()`, and writes nothing into guard regions around the store.
"""
import importlib
import os
import sys

import pytest
import torch

from reference import copy_rows_ref


class _Interpreted:
    """TRITON_INTERPRET=1 while it is entered (@triton.jit reads it when it decorates, the interpreter when
    a kernel runs), then as it was: servers the suite starts later inherit this process's environment and
    must run their own kernels (set at collection for good, it leaked into every later test)."""

    def __enter__(self):
        self.saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"

    def __exit__(self, *exc):
        if self.saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = self.saved


with _Interpreted():
    _name = "sglang_hs.server.ops.copy_rows"
    mod = importlib.reload(sys.modules[_name]) if _name in sys.modules else importlib.import_module(_name)


@pytest.fixture(autouse=True)
def triton_interpreted():
    with _Interpreted():
        yield

PAD_SLOT = 0


def _cpp_copy_rows(aux, last, loc, store):
    from sglang_hs._ext import ExtensionNotBuilt, ext

    try:
        op = ext().copy_rows_cpu
    except ExtensionNotBuilt as e:
        pytest.skip(f"extension not built: {e}")
    op(aux, last, loc, store)


@pytest.fixture(params=["triton-interpret", "cpp"])
def copy_rows(request):
    return mod.copy_rows if request.param == "triton-interpret" else _cpp_copy_rows


def _case(T, K, H, dtype, last, loc_dtype, n_pad=0, slots=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T + n_pad, K * H + 7, generator=g).to(dtype)
    aux = wide[:, 3 : 3 + K * H]  # row stride K*H+7: not contiguous as a whole
    fin = torch.randn(T + n_pad, H, generator=g).to(dtype) if last else None
    real = torch.randperm(slots - 1, generator=g)[:T] + 1  # distinct, never the padding slot
    loc = torch.cat([real, torch.full((n_pad,), PAD_SLOT)]).to(loc_dtype)
    return aux, fin, loc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("H,last", [(111, True), (500, False), (256, True), (7, False)])
def test_matches_reference(copy_rows, dtype, K, H, last):
    aux, fin, loc = _case(T=5, K=K, H=H, dtype=dtype, last=last, loc_dtype=torch.int64)
    P = K + int(last)
    poison = torch.full((64, P, H), float("nan"), dtype=dtype)
    got, want = poison.clone(), poison.clone()
    copy_rows(aux, fin, loc, got)
    copy_rows_ref(aux, fin, loc, want)
    diff = (got.float() - want.float()).nan_to_num(0).abs()
    print(f"K={K} H={H} {dtype}: max diff {diff.max().item()} mean {diff.mean().item()}")
    assert torch.equal(got.isnan(), want.isnan())  # exactly the addressed slots were written
    assert torch.equal(got[loc.long()], want[loc.long()])  # bit-exact copy


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_padding_rows_never_reach_a_real_slot(copy_rows, loc_dtype):
    """Graph replays pad the batch up to its bucket; padded rows point at the padding slot."""
    K, H = 3, 96
    aux, fin, loc = _case(T=6, K=K, H=H, dtype=torch.bfloat16, last=True, loc_dtype=loc_dtype, n_pad=4)
    store = torch.full((64, K + 1, H), float("nan"), dtype=torch.bfloat16)
    copy_rows(aux, fin, loc, store)
    ref = copy_rows_ref(aux[:6], fin[:6], loc[:6], torch.full_like(store, float("nan")))
    real = loc[:6].long()
    assert torch.equal(store[real], ref[real])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[real] = False
    untouched[PAD_SLOT] = False
    assert store[untouched].isnan().all()
    # The padding slot holds one of the padding rows, whole (which one is unspecified).
    pad_rows = torch.cat([aux[6:].reshape(4, K, H), fin[6:, None]], 1)
    assert any(torch.equal(store[PAD_SLOT], r) for r in pad_rows)


def test_zero_rows_is_a_no_op(copy_rows):
    store = torch.zeros(4, 2, 8, dtype=torch.float16)
    copy_rows(torch.empty(0, 16, dtype=torch.float16), None, torch.empty(0, dtype=torch.int32), store)
    assert not store.any()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(aux_width=3 * 64 + 1), "does not hold K=3 layers"),
        (dict(aux_dtype=torch.float16), "aux is (torch.float16|Half), store is (torch.bfloat16|BFloat16)"),
        (dict(loc_dtype=torch.float32), "int32/int64"),
        (dict(loc_len=3), "loc must be"),
        (dict(last_h=63), "does not match"),
    ],
)
def test_launcher_asserts_its_contract(copy_rows, change, message):
    T, K, H = 4, 3, 64
    aux = torch.zeros(T, change.get("aux_width", K * H), dtype=change.get("aux_dtype", torch.bfloat16))
    last = torch.zeros(T, change.get("last_h", H), dtype=torch.bfloat16)
    loc = torch.arange(change.get("loc_len", T)).to(change.get("loc_dtype", torch.int64))
    store = torch.zeros(8, K + 1, H, dtype=torch.bfloat16)
    with pytest.raises((AssertionError, RuntimeError), match=message):  # the launcher asserts, C++ checks
        copy_rows(aux, last, loc, store)


def test_cpp_op_refuses_slots_outside_the_store_before_writing():
    store = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    aux = torch.ones(3, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 8 of row 2 outside"):
        _cpp_copy_rows(aux, None, torch.tensor([1, 2, 8]), store)
    assert not store.any()


GUARD = 3  # slots of poisoned memory either side of the store, inside the same allocation
FAR = {torch.int32: [2**31 - 1, -(2**31)], torch.int64: [2**40, -(2**40)]}


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("where", ["past-the-end", "negative", "far"])
def test_kernel_drops_and_counts_rows_whose_slot_is_outside_the_store(where, loc_dtype):
    """The store is the middle of a bigger buffer: a slot of S or -1 would land in the guard regions
    (a `far` one outside the allocation). Those rows write nothing, their count reaches the host at
    check(), and the in-range rows of the same launch are written exactly."""
    S, K, H = 8, 2, 40
    bad = {"past-the-end": [S, S + 2, S], "negative": [-1, -GUARD, -2], "far": FAR[loc_dtype]}[where]
    good = [1, 5, 0, 7]
    loc = torch.tensor([good[0], bad[0], good[1], *bad[1:], good[2], good[3]], dtype=loc_dtype)
    is_good = torch.tensor([int(s) in good for s in loc.tolist()])
    T = loc.shape[0]
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(T, K * H, generator=g).to(torch.bfloat16)
    fin = torch.randn(T, H, generator=g).to(torch.bfloat16)
    big = torch.full((GUARD + S + GUARD, K + 1, H), float("nan"), dtype=torch.bfloat16)
    store = big[GUARD : GUARD + S]
    errors = mod.SlotErrors("cpu")

    mod.copy_rows(aux, fin, loc, store, errors=errors)

    assert big[:GUARD].isnan().all(), "a row was written before the store"
    assert big[GUARD + S :].isnan().all(), "a row was written past the store"
    want = copy_rows_ref(aux[is_good], fin[is_good], loc[is_good], torch.full_like(store, float("nan")))
    assert torch.equal(store.isnan(), want.isnan())  # the in-range rows, and nothing else, were written
    assert torch.equal(store[good], want[good])
    n, slot, num_slots = errors.read()
    assert (n, num_slots) == (len(bad), S) and slot in bad
    with pytest.raises(RuntimeError, match=rf"dropped {len(bad)} rows whose KV slot lay outside the store's \[0, {S}\)"):
        errors.check()


def test_slot_errors_accumulate_and_tensor_stores_share_a_default_counter():
    store = torch.zeros(4, 1, 16, dtype=torch.float16)
    aux = torch.ones(2, 16, dtype=torch.float16)
    errors = mod.slot_errors("cpu")
    before = errors.read()[0]
    mod.copy_rows(aux, None, torch.tensor([0, 3]), store)  # in range: nothing counted
    assert errors.read()[0] == before
    mod.copy_rows(aux, None, torch.tensor([4, 1]), store)
    mod.copy_rows(aux, None, torch.tensor([2, -1], dtype=torch.int32), store)
    assert errors.read()[0] == before + 2
    assert store[:, 0].all(dim=1).tolist() == [True, True, True, True]
    with pytest.raises(RuntimeError, match=rf"dropped {before + 2} rows"):
        errors.check()
    fresh = mod.SlotErrors("cpu")
    fresh.check()  # a counter nothing was dropped into passes
    mod.copy_rows(aux[:1], None, torch.tensor([9]), store, errors=fresh)
    with pytest.raises(RuntimeError, match=r"dropped 1 row whose KV slot lay outside the store's \[0, 4\) \(e.g. slot 9\)"):
        fresh.check()


@pytest.mark.parametrize("streams, K", [("mean", 3), ("full", 3 * 4)])
def test_deepseek_v4_shaped_rows(copy_rows, streams, K):
    """DeepSeek-V4's rows (hc_mult 4): three layer ids of the streams' mean, or of all four streams (12 aux
    rows), plus the final state; H = 88 (odd against the kernel's blocks), as the aux the V4 overlay hands
    the copy: a packer's [T, K*H] buffer (the stream capture writes x.flatten(1) into each id's slot)."""
    T, H = 7, 88
    g = torch.Generator().manual_seed(4)
    streams_in = [torch.randn(T, 4, H, generator=g).bfloat16() for _ in range(3)]
    aux = torch.cat([x.mean(1) if streams == "mean" else x.flatten(1) for x in streams_in], dim=1)
    fin = torch.randn(T, H, generator=g).bfloat16()
    loc = torch.randperm(63, generator=g)[:T] + 1
    got, want = (torch.full((64, K + 1, H), float("nan"), dtype=torch.bfloat16) for _ in range(2))
    copy_rows(aux, fin, loc, got)
    copy_rows_ref(aux, fin, loc, want)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[loc], want[loc])
    if streams == "full":  # stream s of the k-th id is row 4k + s of its slot
        assert torch.equal(got[loc][:, 4 * 2 + 3], streams_in[2][:, 3])
