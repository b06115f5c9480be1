"""The finish path's gather (csrc/gather_rows_cpu.cpp) and the capture copy's streamed path, byte for byte
against plain torch.

The op copies runs of consecutive indices as one block, streams the stores of a large gather past the
cache (stream_copy.h: plain copies for an unaligned head and a tail shorter than 64 bytes) and splits a
gather of more than 16 MiB over threads. Each of those paths is driven here: row sizes that are not a
multiple of 16 or 64 bytes, destinations misaligned by 1..15 bytes, totals either side of the 2 MiB
streaming threshold, index patterns with runs, repeats and reversals (hypothesis), DeepSeek-V3 rows
(57,344 bytes) over threads, for the gather and for the capture copy (the staging scatter). The
destination is poisoned first, so an unwritten byte shows.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import copy_rows_ref

STREAM_BYTES = 2 << 20  # csrc/stream_copy.h kStreamThresholdBytes
THREAD_BYTES = 8 << 20  # csrc/row_threads.h kMinBytesPerThread


@pytest.fixture(scope="module")
def ext():
    from sglang_hs._ext import ExtensionNotBuilt, ext

    try:
        return ext()
    except ExtensionNotBuilt as e:
        pytest.skip(f"extension not built: {e}")


def _src(S, row, seed=0):
    return torch.randint(0, 256, (S, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _out(T, row, misalign=0):
    """A poisoned [T, row] uint8 destination starting `misalign` bytes past a 64-byte boundary."""
    buf = torch.full((T * row + 128,), 0xA5, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 64 + misalign
    return buf, buf[start : start + T * row].view(T, row)


@pytest.mark.parametrize("row", [1, 15, 63, 64, 65, 1001, 4096 + 13, 57344])
@pytest.mark.parametrize("big", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("misalign", [0, 1, 7, 15])
def test_gather_matches_index_select(ext, row, big, misalign):
    T = (STREAM_BYTES // row + 3) if big else max(1, (STREAM_BYTES // row) // 4)
    assert (T * row >= STREAM_BYTES) == big
    S = T + 50
    src = _src(S, row)
    idx = torch.randperm(S, generator=torch.Generator().manual_seed(1))[:T]
    buf, out = _out(T, row, misalign)
    ext.gather_rows_cpu(src, idx, out, 1)
    assert torch.equal(out, src[idx])
    start = out.data_ptr() - buf.data_ptr()
    assert bool((buf[:start] == 0xA5).all()) and bool((buf[start + T * row :] == 0xA5).all()), "wrote outside out"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_gather_any_index_pattern(ext, data):
    """Runs of consecutive indices (merged into one copy), repeats, reversals, a run up to the last row."""
    row = data.draw(st.sampled_from([4096 + 13, 8192]), label="row")
    S = data.draw(st.integers(300, 700), label="S")
    pieces = data.draw(st.lists(st.tuples(st.integers(0, S - 1), st.integers(1, 200), st.booleans()),
                                min_size=1, max_size=12), label="runs")
    idx = []
    for start, n, backwards in pieces:
        run = list(range(start, min(S, start + n)))
        idx += run[::-1] if backwards else run
    idx = torch.tensor(idx, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]), label="idx dtype"))
    threads = data.draw(st.integers(1, 4), label="threads")
    src = _src(S, row, seed=S)
    buf, out = _out(len(idx), row, data.draw(st.integers(0, 15), label="misalign"))
    ext.gather_rows_cpu(src, idx, out, threads)
    assert torch.equal(out, src[idx.long()])


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_deepseek_v3_rows_over_threads(ext, threads):
    """[T, 4, 7168] bf16 rows (57,344 bytes), 17 MB: two threads at most (8 MiB each); without idx, a copy."""
    T, S = 300, 1024
    src = torch.randn(S, 4, 7168).to(torch.bfloat16)
    idx = torch.randperm(S, generator=torch.Generator().manual_seed(2))[:T]
    assert T * 4 * 7168 * 2 >= 2 * THREAD_BYTES
    out = torch.full((T, 4, 7168), float("nan"), dtype=torch.bfloat16)
    ext.gather_rows_cpu(src, idx, out, threads)
    assert torch.equal(out.view(torch.int16), src[idx].view(torch.int16))
    out2 = torch.full((T, 4, 7168), float("nan"), dtype=torch.bfloat16)
    ext.gather_rows_cpu(out, None, out2, threads)
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16))


def test_zero_rows_is_a_no_op(ext):
    src = _src(4, 16)
    out = torch.empty(0, 16, dtype=torch.uint8)
    ext.gather_rows_cpu(src, torch.empty(0, dtype=torch.int64), out, 1)
    ext.gather_rows_cpu(torch.empty(0, 16, dtype=torch.uint8), None, out, 1)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "idx": torch.tensor([0, 9])}, r"index 9 of row 1 outside \[0, 8\)"),
    (lambda a: {**a, "idx": torch.tensor([0, -1])}, r"index -1 of row 1 outside"),
    (lambda a: {**a, "idx": torch.tensor([0.0, 1.0])}, "int32/int64"),
    (lambda a: {**a, "idx": torch.tensor([0, 1, 2])}, "idx must be a CPU .T=2."),
    (lambda a: {**a, "out": torch.zeros(2, 17, dtype=torch.uint8)}, "does not hold rows of src"),
    (lambda a: {**a, "out": torch.zeros(2, 16, dtype=torch.int8)}, "src is Byte, out is Char"),
    (lambda a: {**a, "out": torch.zeros(16, 2, dtype=torch.uint8).t()}, "must be contiguous"),
    (lambda a: {**a, "threads": 0}, "num_threads must be >= 1"),
    (lambda a: {**a, "idx": None}, "without idx, out must have src's 8 rows, not 2"),
    (lambda a: {**a, "out": a["src"][2:4]}, "out overlaps src"),
])
def test_refuses_before_writing(ext, change, message):
    args = change({"src": _src(8, 16), "idx": torch.tensor([0, 1]), "out": torch.full((2, 16), 0xA5,
                                                                                    dtype=torch.uint8), "threads": 1})
    before = args["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        ext.gather_rows_cpu(args["src"], args["idx"], args["out"], args["threads"])
    assert torch.equal(args["out"], before)


@pytest.mark.parametrize("H,last", [(7168, True), (1001, False), (67, True)])
def test_capture_copy_streams_a_large_step(ext, H, last):
    """copy_rows_cpu above the streaming threshold (a long prefill, the staging scatter): odd hidden sizes,
    non-contiguous aux rows, int32 slots, against the plain-torch reference."""
    K, dtype = 3, torch.bfloat16
    P = K + int(last)
    T = STREAM_BYTES // (P * H * 2) + 5
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(T, K * H + 7, generator=g).to(dtype)
    aux = wide[:, 3 : 3 + K * H]
    fin = torch.randn(T, H, generator=g).to(dtype) if last else None
    loc = torch.randperm(2 * T, generator=g)[:T].to(torch.int32)
    store = torch.full((2 * T, P, H), float("nan"), dtype=dtype)
    expect = copy_rows_ref(aux, fin, loc, store.clone())
    ext.copy_rows_cpu(aux, fin, loc, store)
    assert torch.equal(store.view(torch.int16), expect.view(torch.int16))


@pytest.mark.parametrize("T, threads", [(301, 1), (301, 2), (301, 3), (301, 8), (601, 4), (601, 8)])
def test_capture_copy_of_deepseek_v3_rows_over_threads(ext, T, threads):
    """copy_rows_cpu with num_threads (the staging scatter): 301 rows of [4, 7168] bf16, 17 MB, room for two
    8 MiB ranges, or 601 (34 MB, four uneven ranges: 151, 151, 151, 148 rows), into a poisoned store at
    random int64 slots, against the plain-torch reference; more threads asked for than the rows allow take
    what the rows allow."""
    K, H, S = 3, 7168, 1024
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(T, K * H, generator=g).to(torch.bfloat16)
    fin = torch.randn(T, H, generator=g).to(torch.bfloat16)
    loc = torch.randperm(S, generator=g)[:T]
    assert T * (K + 1) * H * 2 >= 2 * THREAD_BYTES
    store = torch.full((S, K + 1, H), float("nan"), dtype=torch.bfloat16)
    expect = copy_rows_ref(aux, fin, loc, store.clone())
    ext.copy_rows_cpu(aux, fin, loc, store, threads)
    assert torch.equal(store.view(torch.int16), expect.view(torch.int16))


def test_capture_copy_refuses_no_threads_before_writing(ext):
    store = torch.full((4, 2, 8), float("nan"))
    with pytest.raises(RuntimeError, match="num_threads must be >= 1, got 0"):
        ext.copy_rows_cpu(torch.ones(1, 8), torch.ones(1, 8), torch.tensor([1]), store, 0)
    assert store.isnan().all()
