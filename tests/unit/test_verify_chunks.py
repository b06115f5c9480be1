"""--verify of a long record chunk by chunk (issue 47, leftover 1): check() (the captured final states against the
server's logprobs) and check_stored() (the --format safetensors file read back) given a long record's chunks read
the rows a chunk at a time, the logits a block of rows at a time and the file a slice at a time (safe_open's
get_slice), and reach the verdicts of the one-chunk path: the same maximum difference, the same error message,
for the true rows and for rows wrong at every position, chunk edges included. The whole record is never read: its
whole tensors are passed on the meta device (only their shapes are there), and the file's reads are counted."""
import pytest
import torch

from helpers import verify_case
from sglang_hs.extract import verify
from sglang_hs.extract.sinks import SafetensorsSink
from sglang_hs.extract.sinks.base import Chunk
from sglang_hs.extract.verify import VerificationError, check, check_stored
from sglang_hs.reader import RecordChunk

T, K, H, V = 13, 2, 16, 50
ROWS = 3  # rows a chunk: the last chunk short


def _verdict(fn, *args, **kw):
    """What fn returns, or the message it raises."""
    try:
        return ("ok", fn(*args, **kw))
    except VerificationError as e:
        return ("error", str(e))


def _case(seed=0):
    return verify_case(T, V, H, seed)


def _record_chunks(last, n=ROWS):
    return [RecordChunk(s, min(T, s + n), None, None, last[s:s + n], None) for s in range(0, T, n)]


def _wrong_rows():
    """Final states wrong in each single row, in two rows across a chunk edge, shifted by one row."""
    head, last, tokens, server = _case()
    cases = []
    for t in range(T):
        wrong = last.clone()
        wrong[t] = last[t - 1]
        cases.append(wrong)
    edge = last.clone()
    edge[ROWS - 1], edge[ROWS] = last[0], last[1]
    cases.append(edge)
    cases.append(torch.cat([last[1:], last[:1]]))
    return cases


@pytest.mark.parametrize("temperature, sampled_from", [(0.0, None), (0.7, 5)])
def test_check_in_chunks_gives_the_one_chunk_verdicts(monkeypatch, temperature, sampled_from):
    head, last, tokens, server = _case()
    if temperature:  # the sampled tokens' logprobs from the temperature-scaled distribution
        scaled = torch.log_softmax(last @ head.T / temperature, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        server = server[:sampled_from] + scaled[sampled_from - 1:].tolist()
    blocks = []
    real = verify._block_diffs
    monkeypatch.setattr(verify, "_block_diffs", lambda rows, *a: blocks.append(rows.shape[0]) or real(rows, *a))
    kw = dict(temperature=temperature, sampled_from=sampled_from)
    small = 2 * 4 * V  # logits of 2 rows a block
    for states in [last, *_wrong_rows()]:
        whole = _verdict(check, 7, tokens, states, head, server, tokens, **kw)
        blocks.clear()
        meta = torch.empty(T, H, device="meta")  # the whole tensor: its shape only, any read of it fails
        parts = _verdict(check, 7, tokens, meta, head, server, tokens, chunks=_record_chunks(states),
                         part_bytes=small, **kw)
        assert parts[0] == whole[0]  # the largest difference: the same up to the float rounding of a smaller matmul
        assert parts[1] == (pytest.approx(whole[1], abs=1e-5) if whole[0] == "ok" else whole[1])
        assert max(blocks) == 2 and sum(blocks) == T, blocks  # every row once, 2 rows of logits at a time
    # the reference: the true rows pass, a wrong row is named where it was planted
    assert _verdict(check, 7, tokens, last, head, server, tokens, **kw)[0] == "ok"
    for t, wrong in enumerate(_wrong_rows()[:T]):
        verdict = _verdict(check, 7, tokens, torch.empty(T, H, device="meta"), head, server, chunks=_record_chunks(wrong),
                           part_bytes=small, **kw)
        assert verdict[0] == "error" and f"sample 7: row {t} " in verdict[1], (t, verdict)


def _stored(tmp_path, save_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(T, K, H, generator=g) * torch.tensor([0.01, 5.0])[None, :, None]
    last = torch.randn(T, H, generator=g)
    if save_dtype != "bf16":
        aux, last = aux.bfloat16(), last.bfloat16()
    sink = SafetensorsSink(str(tmp_path), save_dtype)
    sink.write(0, torch.arange(T), torch.ones(T), aux, last)
    return sink.path(0), aux, last


def _sink_chunks(aux, last, n=ROWS):
    return [Chunk(s, min(T, s + n), aux[s:s + n], last[s:s + n]) for s in range(0, T, n)]


def _corrupt(path, cells, fp8):
    """The file with the stored elements at (row, layer) in `cells` changed (FP8: by one e4m3 step)."""
    from safetensors.torch import load_file, save_file

    t = load_file(path)
    hs = t["hidden_states"].clone()
    for row, layer in cells:
        if fp8:
            hs.view(torch.uint8)[row, layer, 7] += 2
        else:
            hs[row, layer, 7] = hs[row, layer, 7] * 1.01 + 1e-3
    save_file({**t, "hidden_states": hs}, path)


class _CountedSlices:
    """safe_open whose get_slice records the rows of every slice read, and whose get_tensor (the whole
    tensor) is refused."""

    def __init__(self, real, reads):
        self.real, self.reads = real, reads

    def __call__(self, *a, **kw):
        outer = self

        class Opened:
            def __enter__(self):
                self.f = outer.real(*a, **kw).__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                raise AssertionError(f"{name} read whole")

            def get_slice(self, name):
                s = self.f.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return s.get_shape()

                    def __getitem__(self, rows):
                        got = s[rows]
                        outer.reads.append((name, got.shape[0]))
                        return got
                return Slice()
        return Opened()


@pytest.mark.parametrize("save_dtype", [None, "bf16", "fp8", "fp8-per-layer"])
def test_check_stored_in_chunks_gives_the_one_chunk_verdicts_reading_a_chunk_at_a_time(tmp_path, monkeypatch,
                                                                                       save_dtype):
    import safetensors

    reads = []
    monkeypatch.setattr(safetensors, "safe_open", _CountedSlices(safetensors.safe_open, reads))
    fp8 = bool(save_dtype and save_dtype.startswith("fp8"))
    meta_aux, meta_last = torch.empty(T, K, H, device="meta"), torch.empty(T, H, device="meta")
    cases = [[], [(4, 0)], [(ROWS - 1, 1), (ROWS, 0), (T - 1, 2)], [(T - 1, 2)], [(0, 0)]]
    for i, cells in enumerate(cases):
        path, aux, last = _stored(tmp_path / str(i), save_dtype, seed=i)
        if cells:
            _corrupt(path, cells, fp8)
        whole = _verdict(check_stored, 0, path, aux, last, save_dtype)
        reads.clear()
        parts = _verdict(check_stored, 0, path, meta_aux, meta_last, save_dtype, chunks=_sink_chunks(aux, last))
        assert parts == whole, (cells, parts, whole)
        assert reads and max(n for _, n in reads) == ROWS, reads  # a chunk of the file at a time
        assert sum(n for name, n in reads if name == "hidden_states") == T, reads  # every row once
        if not cells:
            assert whole == ("ok", None)
        else:  # the reference: the cells planted
            row, layer = cells[0]
            assert f"{len(cells)} stored rows" in whole[1] and f"(first: row {row}, layer {layer} of {K + 1})" in \
                whole[1], whole[1]


def test_check_stored_of_another_shape_names_both_in_chunks_too(tmp_path):
    path, aux, last = _stored(tmp_path, None)
    short = [c for c in _sink_chunks(aux[:-1], last[:-1]) if c.start < T - 1]
    with pytest.raises(VerificationError, match=rf"holds hidden_states \({T}, {K + 1}, {H}\), captured \({T - 1}, "):
        check_stored(0, path, torch.empty(T - 1, K, H, device="meta"), last, None, chunks=short)


def test_a_nan_final_state_fails_the_logprob_check():
    """A captured final state of NaNs gives NaN logprobs, and NaN > tolerance is False: such a row passed --verify
    (review). Now it is a disagreeing row, named, in one chunk or several."""
    head, last, tokens, server = _case()
    bad = last.clone()
    bad[ROWS + 1] = float("nan")
    for chunks in (None, _record_chunks(bad)):
        with pytest.raises(VerificationError, match=rf"row {ROWS + 1} .*1 of {T} rows disagree"):
            check(0, tokens, bad, head, server, chunks=chunks)


def test_a_nan_row_stored_as_captured_is_the_same_row_and_chunks_must_cover_every_row(tmp_path):
    """The file read back is compared by its bytes: a captured row holding NaN (stored as it is) is the captured row,
    which NaN != NaN called different (review). And chunks that stop short of the record's rows are refused: the
    rows after them would not be checked."""
    g = torch.Generator().manual_seed(5)
    aux, last = torch.randn(T, K, H, generator=g).bfloat16(), torch.randn(T, H, generator=g).bfloat16()
    aux[2, 1, 3] = float("nan")
    sink = SafetensorsSink(str(tmp_path), None)
    sink.write(0, torch.arange(T), torch.ones(T), aux, last)
    check_stored(0, sink.path(0), aux, last, None)
    check_stored(0, sink.path(0), aux, last, None, chunks=_sink_chunks(aux, last))
    short = _sink_chunks(aux, last)[:-1]
    with pytest.raises(VerificationError, match=rf"sample 0: the sample's chunks end at row {short[-1].stop} of its {T}"):
        check_stored(0, sink.path(0), aux, last, None, chunks=short)
