"""Long records written a chunk at a time (issue 47, item 2: the extraction CLI's half): each format's file
written from chunks of rows is byte for byte the file its whole-sample write makes (the same tensors, dtypes,
keys, header, offsets; safetensors' header metadata compared with its keys sorted: save_file itself orders them
differently from one save to the next), and loads with the format's own reader: safetensors' safe_open and load_file,
torch.load (and torch.load(mmap=True): 64-byte aligned storages) of SpecForge's zip, DeepSpec's offsets. Over
odd shapes (T 37 in chunks of 5 rows: the last one short; H 24), bf16 and float32 rows, every --save-dtype of
each format, and rows of both final states (the final state not next to the aux rows: the sinks' copying
layouts). Chunks that leave a gap, overlap or stop short are refused, no file left."""
import os

import pytest
import torch

from sglang_hs.extract.sinks import SINKS
from sglang_hs.extract.sinks.base import Chunk, SinkError, TrainingSample

T, K, H = 37, 3, 24
SAVE = {"specforge": [None, "bf16"], "safetensors": [None, "bf16", "fp8", "fp8-per-layer"],
        "deepspec": ["bf16", "fp8", "fp8-e5m2"]}
CASES = [(fmt, sd, dt, finals) for fmt, sds in SAVE.items() for sd in sds for dt in (torch.bfloat16, torch.float32)
         for finals in (1, 2)]


def _record(dtype, finals, seed=0):
    """input_ids, loss mask, aux [T, K, H] and the final state [T, H] as a reader's record holds them: views of
    one rows tensor [T, K + finals, H] (finals 2: the post-norm state, then the pre-norm one)."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(T, K + finals, H, generator=g) * 3).to(dtype)
    ids = torch.randint(0, 50000, (T,), generator=g, dtype=torch.int32)
    mask = (torch.arange(T) >= 11).long()
    return ids, mask, rows[:, :K], rows[:, K]


def _metadata_sorted(data: bytes) -> bytes:
    """A safetensors file with its header's __metadata__ keys sorted (nothing else changed; the same length)."""
    import json
    import struct

    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    head["__metadata__"] = dict(sorted(head["__metadata__"].items()))
    body = json.dumps(head, separators=(",", ":")).encode()
    assert len(body.ljust(n)) == n
    return data[:8] + body.ljust(n) + data[8 + n:]


def _chunks(aux, last, n):
    return (Chunk(s, min(T, s + n), aux[s:s + n], last[s:s + n]) for s in range(0, T, n))


def _sink(fmt, save_dtype, folder):
    sink = SINKS[fmt](str(folder), save_dtype)
    sink.describe_capture({"layer_ids": [1, 5, 9], "rows_per_layer": 1, "model_path": "/m"})
    return sink


@pytest.mark.parametrize("fmt,save_dtype,dtype,finals", CASES)
def test_chunked_file_is_the_whole_write_byte_for_byte(tmp_path, fmt, save_dtype, dtype, finals):
    ids, mask, aux, last = _record(dtype, finals)
    if fmt == "deepspec" and save_dtype == "fp8":
        aux, last = aux.clamp(-400, 400), last.clamp(-400, 400)
    whole, parts = _sink(fmt, save_dtype, tmp_path / "whole"), _sink(fmt, save_dtype, tmp_path / "parts")
    assert parts.writes_chunks(aux, last)
    n_whole = whole.write(TrainingSample(7, ids, mask, aux, last))
    n_parts = parts.write(TrainingSample(7, ids, mask, aux, last), chunks=_chunks(aux, last, 5))
    a, b = open(whole.path(7), "rb").read(), open(parts.path(7), "rb").read()
    if fmt == "safetensors":  # safetensors orders the metadata as a hash map does: differently each save_file
        a, b = _metadata_sorted(a), _metadata_sorted(b)
    first = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    print(f"{fmt} {save_dtype} {dtype} finals {finals}: {n_whole} / {n_parts} bytes, first difference at {first}")
    assert n_whole == n_parts and a == b, first
    assert not [f for f in os.listdir(os.path.dirname(parts.path(7))) if f.endswith(".tmp")]
    path = parts.path(7)
    if fmt == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        got = load_file(path)
        assert torch.equal(got["token_ids"], ids.long()) and torch.equal(got["loss_mask"], mask)
        with safe_open(path, "pt") as f:
            assert f.metadata()["num_aux_layers"] == "3" and f.get_slice("hidden_states").get_shape() == [T, K + 1, H]
        if save_dtype is None:
            assert torch.equal(got["hidden_states"], torch.cat([aux, last[:, None]], 1))
    elif fmt == "specforge":
        for mmap in (False, True):
            got = torch.load(path, mmap=mmap, weights_only=True)
            want = torch.cat([aux, last[:, None]], 1).to(torch.bfloat16 if save_dtype == "bf16" else dtype)
            assert torch.equal(got["input_ids"], ids.long()) and torch.equal(got["loss_mask"], mask)
            assert torch.equal(got["hidden_state"], want[:, K].reshape(1, T, H))
            assert torch.equal(got["aux_hidden_state"], want[:, :K].reshape(1, T, K * H))
    else:
        from sglang_hs.extract.sinks.deepspec import read_header, sample_nbytes

        meta, start = read_header(path)
        assert meta["seq_len"] == T and os.path.getsize(path) == start + sum(sample_nbytes(meta))


def test_chunks_that_do_not_cover_the_rows_leave_no_file(tmp_path):
    ids, mask, aux, last = _record(torch.bfloat16, 1)
    for fmt in SAVE:
        sink = _sink(fmt, "bf16", tmp_path / fmt)
        bad = [  # a gap, an overlap, stopping short
            [Chunk(0, 5, aux[:5], last[:5]), Chunk(6, T, aux[6:], last[6:])],
            [Chunk(0, 5, aux[:5], last[:5]), Chunk(4, T, aux[4:], last[4:])],
            [Chunk(0, 5, aux[:5], last[:5])],
        ]
        for chunks in bad:
            with pytest.raises(SinkError, match="chunk|row"):
                sink.write(TrainingSample(3, ids, mask, aux, last), chunks=iter(chunks))
            assert not os.path.exists(sink.path(3))
            folder = os.path.dirname(sink.path(3))
            assert not os.path.isdir(folder) or not [f for f in os.listdir(folder) if f.endswith(".tmp")]


@pytest.mark.parametrize("save_dtype", [None, "bf16"])
def test_a_one_token_record_of_both_final_states_in_specforges_chunks(tmp_path, save_dtype):
    """T = 1 with both final states: aux = rows[:, :K] and last = rows[:, K] are both contiguous views of one
    rows storage that holds the pre-norm row too; the chunked write pickled them as they were and looked for a
    fourth storage torch.save never made (KeyError: 3, review of issue 47's reader half). Now written, and it
    loads to the same tensors as the whole write (whose file also carries the unused pre-norm row: torch.save
    saves a view's whole storage)."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(1, K + 2, H, generator=g).to(torch.bfloat16)
    ids, mask, aux, last = torch.tensor([7], dtype=torch.int32), torch.ones(1, dtype=torch.long), rows[:, :K], rows[:, K]
    got = {}
    for way, chunks in (("whole", None), ("chunks", [Chunk(0, 1, aux, last)])):
        sink = _sink("specforge", save_dtype, tmp_path / way)
        sink.write(TrainingSample(0, ids, mask, aux, last), chunks=chunks)
        got[way] = torch.load(sink.path(0))
    assert got["whole"].keys() == got["chunks"].keys()
    for k in got["whole"]:
        assert got["whole"][k].dtype == got["chunks"][k].dtype and torch.equal(got["whole"][k], got["chunks"][k]), k


def test_specforges_chunks_are_read_back_before_the_file_is_kept(tmp_path, monkeypatch):
    """The chunked SpecForge writer matches torch.save's storage entries to the tensors by torch's numbering and by
    size, and input_ids and loss_mask are the same size: a torch that numbered them otherwise (here: the sample's
    dict in another order, so torch.save sees loss_mask first) would swap them without a word. The file is read
    back with torch.load before it is kept: refused, no file left."""
    from sglang_hs.extract.sinks import specforge

    ids, mask, aux, last = _record(torch.bfloat16, 1)
    real = specforge.specforge_sample

    def loss_mask_first(*args, **kwargs):
        sample = real(*args, **kwargs)
        return {"loss_mask": sample.pop("loss_mask"), **sample}

    monkeypatch.setattr(specforge, "specforge_sample", loss_mask_first)
    sink = _sink("specforge", None, tmp_path)
    with pytest.raises(SinkError, match="read back"):
        sink.write(TrainingSample(0, ids, mask, aux, last), chunks=_chunks(aux, last, 5))
    assert not os.path.exists(sink.path(0))
    assert not [f for f in os.listdir(os.path.dirname(sink.path(0))) if f.endswith(".tmp")]
