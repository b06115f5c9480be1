"""Our two file layouts loaded with the trainers' released readers, not with imitations of them:
SpecForge 0.2.0's `build_offline_eagle3_dataset` reads `--format specforge`; speculators 0.9.0's
`ArrowDataset` (with hs-connectors 0.9.0's `FileTransfer`) and its `CollateFn` read `--format safetensors`.
Files are written by the real sinks from synthetic rows that differ per token and layer, and every tensor the
readers hand to training must equal what was written. The readers are installed by scripts/ensure_env.sh
(requirements/readers.txt, --no-deps, into a cache named in .venv/.readers); without them these tests skip."""
import os
import shutil
import sys

import pytest
import torch

from sglang_hs.extract import cli
from sglang_hs.extract.sinks import SafetensorsSink, SinkError, SpecForgeSink

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readers_path():
    path = os.environ.get("SGLANG_HS_READERS")
    if not path and os.path.exists(os.path.join(REPO, ".venv", ".readers")):
        path = open(os.path.join(REPO, ".venv", ".readers")).read().strip()
    return path if path and os.path.isdir(path) else None


_path = _readers_path()
if _path and _path not in sys.path:
    sys.path.append(_path)  # after the venv: the readers' own dependencies come from the pinned environment
_NO_READERS = "requirements/readers.txt is not installed (run scripts/ensure_env.sh, or set SGLANG_HS_READERS)"


def _import_or_skip(module, names):
    try:
        mod = __import__(module, fromlist=names)
    except ImportError as e:
        pytest.skip(f"cannot import {module}: {e}" if _path else _NO_READERS)
    return [getattr(mod, n) for n in names]


def _sample(index, K=3, H=24, dtype=torch.bfloat16):
    """Rows that differ per token, per layer and per sample; the final state differs from every layer."""
    T = 5 + index % 11
    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, 32000, (T,), generator=g)
    mask = torch.randint(0, 2, (T,), generator=g)
    mask[-1] = 1  # SpecForge zeroes the last position on load; speculators does not
    aux = torch.randn(T, K, H, generator=g).to(dtype)
    last = torch.randn(T, H, generator=g).to(dtype)
    return ids, mask, aux, last


def _write(sink, indices, **kw):
    written = {}
    for i in indices:
        written[i] = _sample(i, **kw)
        sink.write(i, *written[i])
    return written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_specforge_reader_gives_back_every_tensor_written(tmp_path, dtype):
    (build_offline_eagle3_dataset,) = _import_or_skip("specforge.data.preprocessing", ["build_offline_eagle3_dataset"])
    written = _write(SpecForgeSink(str(tmp_path)), [0, 1, 10, 1999, 2000, 4711], dtype=dtype)
    ds = build_offline_eagle3_dataset(str(tmp_path), max_len=4096)
    assert len(ds) == len(written)
    for i in range(len(ds)):
        # The reader sorts paths as strings (data_10 before data_1999) and, on a file it cannot load, silently
        # returns file 0 instead: each item is matched to its sample through its own path.
        index = int(os.path.basename(ds.datapaths[i])[len("data_"):-len(".ckpt")])
        ids, mask, aux, last = written[index]
        item = ds[i]
        T = len(ids)
        print(index, {k: (tuple(v.shape), v.dtype) for k, v in item.items()})
        assert torch.equal(item["input_ids"], ids[None]) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["loss_mask"], torch.cat([mask[:-1], torch.zeros(1, dtype=torch.int64)])[None])
        assert item["hidden_state"].dtype == dtype and item["target"].dtype == dtype
        assert torch.equal(item["hidden_state"], aux.reshape(1, T, -1))  # the drafter's input, layers side by side
        assert torch.equal(item["target"], last[None])  # what SpecForge applies lm_head to
        assert torch.equal(item["attention_mask"], torch.ones(1, T, dtype=torch.long))


def _speculators():
    ArrowDataset, CollateFn = _import_or_skip("speculators.train.data", ["ArrowDataset", "CollateFn"])
    FileTransfer, FP8Transfer = _import_or_skip("hs_connectors", ["FileTransfer", "FP8Transfer"])
    return ArrowDataset, CollateFn, FileTransfer, FP8Transfer


def _check_speculators_folder(out, written, K=3, H=24):
    """The folder loads in speculators' trainer: every row, its hidden states, the verifier's last state,
    token ids and loss mask exactly as written, in sample order; and it batches with CollateFn."""
    ArrowDataset, CollateFn, FileTransfer, FP8Transfer = _speculators()
    order = sorted(written)
    ds = ArrowDataset(4096, str(out), on_missing="raise")
    assert len(ds) == len(order) and ds.approx_lengths == [len(written[i][0]) for i in order]
    assert ds.data.with_format(None)["sample_index"] == order
    for row, index in enumerate(order):
        ids, mask, aux, last = written[index]
        T = len(ids)
        item = ds[row]
        assert isinstance(item, dict), (row, index, item)  # SampleUnavailable: token ids did not match the row
        print(row, index, {k: (tuple(v.shape), v.dtype) for k, v in item.items()})
        assert torch.equal(item["hidden_states"], aux.reshape(T, K * H)) and item["hidden_states"].dtype == aux.dtype
        assert torch.equal(item["verifier_last_hidden_states"], last)
        assert torch.equal(item["input_ids"], ids) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["loss_mask"], mask) and item["loss_mask"].dtype == torch.int64
        assert item["lengths"].tolist() == [T] and torch.equal(item["position_ids"], torch.arange(T))
        for transfer in (FileTransfer(out / "hidden_states"), FP8Transfer(out / "hidden_states", torch.float32)):
            raw = transfer.get_cached(row)  # FP8Transfer passes files without a scales tensor through
            assert torch.equal(raw["hidden_states"][:, :K], aux) and torch.equal(raw["hidden_states"][:, K], last)
            assert torch.equal(raw["token_ids"], ids)
    max_len = sum(len(written[i][0]) for i in order) + 3
    batch = CollateFn(max_len, H, K, dtype=torch.bfloat16)([ds[r] for r in range(len(ds))])
    assert batch["error_records"] == 0 and batch["hidden_states"].shape == (1, max_len, K * H)
    assert torch.equal(batch["input_ids"][0, :max_len - 3], torch.cat([written[i][0] for i in order]))


def test_speculators_reader_gives_back_every_tensor_written(tmp_path):
    _speculators()
    sink = SafetensorsSink(str(tmp_path))
    sink.layer_ids = [2, 4, 5]
    written = _write(sink, [0, 2, 3, 7, 12])  # gaps, as skipped or failed samples leave
    assert sink.finalize() == {"rows": 5}
    _check_speculators_folder(tmp_path, written)
    # hidden_states/ costs no disk: row r is the sample file itself
    for row, index in enumerate(sorted(written)):
        assert os.path.samefile(tmp_path / "hidden_states" / f"hs_{row}.safetensors", tmp_path / f"hs_{index}.safetensors")
    assert sink.existing() == 5  # --resume counts the sample files, not the rows


def test_resume_adds_rows_and_shards_merge_by_copying_the_sample_files(tmp_path, capsys):
    _speculators()
    shards, written = [], {}
    for i in range(2):  # --shard 0/2 and 1/2, each its own folder, each a dataset on its own
        out = tmp_path / f"shard{i}"
        sink = SafetensorsSink(str(out))
        part = _write(sink, [j for j in range(7) if j % 2 == i])
        assert sink.finalize() == {"rows": len(part)}
        _check_speculators_folder(out, part)
        shards.append(out)
        written.update(part)
    merged = tmp_path / "merged"
    merged.mkdir()
    for out in shards:
        for p in out.glob("hs_*.safetensors"):
            shutil.copy(p, merged / p.name)
    assert cli.main(["--finalize", "--format", "safetensors", "--output", str(merged)]) == 0
    assert "dataset of 7 rows" in capsys.readouterr().err
    _check_speculators_folder(merged, written)
    # A resumed run adds samples; finalize rebuilds the rows and hidden_states/ (no stale row file remains).
    sink = SafetensorsSink(str(merged))
    written.update(_write(sink, [8, 5 + 100]))
    assert sink.finalize() == {"rows": 9}
    _check_speculators_folder(merged, written)
    assert sorted(os.listdir(merged / "hidden_states")) == sorted(f"hs_{r}.safetensors" for r in range(9))
    assert not [p for p in os.listdir(merged) if p.startswith(".")]


def test_finalize_refuses_files_speculators_would_misread(tmp_path):
    datasets = pytest.importorskip("datasets", reason="finalize writes a datasets dataset")  # noqa: F841
    sink = SafetensorsSink(str(tmp_path / "nolast"))
    ids, mask, aux, _ = _sample(0)
    sink.write(0, ids, mask, aux, None)  # a server without --hs-last: the last aux layer would pass as final
    with pytest.raises(SinkError, match="no final hidden state"):
        sink.finalize()
    assert not (tmp_path / "nolast" / "state.json").exists()
    sink = SafetensorsSink(str(tmp_path / "mixed"))
    _write(sink, [0, 1])
    sink.layer_ids = [1, 3, 4]  # a shard of another capture copied in
    _write(sink, [2])
    with pytest.raises(SinkError, match="different captures"):
        sink.finalize()
    assert cli.main(["--finalize", "--format", "safetensors", "--output", str(tmp_path / "mixed")]) == 1
    assert cli.main(["--finalize", "--output", str(tmp_path / "mixed")]) == 2  # specforge needs no finalize
