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

from helpers import readers_path
from sglang_hs.extract import cli, output
from sglang_hs.extract.sinks import SafetensorsSink, SinkError, SpecForgeSink

_path = readers_path()
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


def _write(sink, indices, shared=False, **kw):
    """shared: aux and last handed to the sink as the reader hands them out, the two views rows[:, :K] and
    rows[:, K] of one record's rows (the sinks then write those bytes without copying them first)."""
    written = {}
    for i in indices:
        written[i] = ids, mask, aux, last = _sample(i, **kw)
        if shared:
            rows = torch.cat([aux, last[:, None]], dim=1)
            aux, last = rows[:, :aux.shape[1]], rows[:, aux.shape[1]]
        sink.write(i, ids, mask, aux, last)
    return written


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_specforge_reader_gives_back_every_tensor_written(tmp_path, dtype, shared):
    (build_offline_eagle3_dataset,) = _import_or_skip("specforge.data.preprocessing", ["build_offline_eagle3_dataset"])
    sink = SpecForgeSink(str(tmp_path))
    written = _write(sink, [0, 1, 10, 1999, 2000, 4711], shared=shared, dtype=dtype)
    copies = SpecForgeSink(str(tmp_path / "copies"))
    copies.share_rows = False
    for i, sample in written.items():  # a shared storage is saved once: the file is no bigger than with copies
        copies.write(i, *sample)
        assert os.path.getsize(sink.path(i)) <= os.path.getsize(copies.path(i)) + 64
    shutil.rmtree(tmp_path / "copies")
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


@pytest.mark.parametrize("shared", [False, True])
def test_speculators_reader_gives_back_every_tensor_written(tmp_path, shared):
    _speculators()
    sink = SafetensorsSink(str(tmp_path))
    sink.layer_ids = [2, 4, 5]
    written = _write(sink, [0, 2, 3, 7, 12], shared=shared)  # gaps, as skipped or failed samples leave
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


def test_finalize_refuses_post_norm_files_speculators_would_normalise_again(tmp_path):
    """Files of sglang-hs before --hs-last pre-norm hold the post-norm final state (metadata final_state
    "true"); speculators applies the verifier's norm to it again, so no dataset is made of them."""
    pytest.importorskip("datasets", reason="finalize writes a datasets dataset")
    from safetensors.torch import load_file, save_file

    sink = SafetensorsSink(str(tmp_path))
    _write(sink, [0])
    path = sink.path(0)
    save_file(load_file(path), path, metadata={"format": "sglang-hs", "final_state": "true", "num_aux_layers": "3",
                                               "fp8_scale": "none"})
    with pytest.raises(SinkError, match="after the final norm, which speculators normalises again.*--hs-last pre-norm"):
        sink.finalize()


def test_specforge_run_config_the_cli_writes_is_valid_for_specforge(tmp_path):
    """The config `specforge train --config` is pointed at validates against SpecForge 0.2.0's own schema, as
    an offline EAGLE-3 run on the output folder."""
    (load_config,) = _import_or_skip("specforge.config.schema", ["load_config"])
    import json

    m = {"model_path": str(tmp_path / "model"), "layer_ids": [2, 4, 5], "num_hidden_layers": 8, "context_len": 512}
    path = tmp_path / output.SPECFORGE_CONFIG
    path.write_text(json.dumps(output.specforge_config(str(tmp_path), m)))
    cfg = load_config(str(path))
    assert cfg.mode == "offline" and cfg.data.hidden_states_path == str(tmp_path) and cfg.data.max_length == 512
    assert cfg.model.target_model_path == m["model_path"] and cfg.training.strategy == "eagle3"


def test_speculators_command_line_parses_in_speculators(tmp_path):
    """The command printed for --format safetensors is one speculators 0.9.0's own argument resolution takes,
    with the aux ids as --target-layer-ids (the final state is not one of them)."""
    (resolution,) = _import_or_skip("speculators.train.config", ["resolution"])
    m = {"model_path": str(tmp_path / "model"), "layer_ids": [2, 4, 5], "num_hidden_layers": 8}
    argv = output.training_command(str(tmp_path), m, "safetensors", None)
    assert argv[:2] == ["speculators", "train"]
    ns = resolution.build_parser().parse_args(argv[2:])
    print(vars(ns))
    assert ns.target_layer_ids == [2, 4, 5] and ns.data_path == str(tmp_path)
    assert ns.verifier_name_or_path == m["model_path"] and ns.hidden_states_backend == "file"


# --- FP8 (--save-dtype fp8 / fp8-per-layer): speculators' scheme, read with hs-connectors' FP8Transfer ---

def _layered_sample(index, K=3, H=160):
    """bf16 rows whose layers differ in norm as a DeepSeek residual stream's do (early layers small, the
    final post-norm state of order 1), with a few outliers per row, odd H."""
    ids, mask, aux, last = _sample(index, K=K, H=H, dtype=torch.float32)
    g = torch.Generator().manual_seed(77 + index)
    aux = aux * torch.tensor([0.02, 0.3, 4.0][:K])[None, :, None]
    aux[:, :, :3] *= 1 + 20 * torch.rand(aux.shape[0], K, 3, generator=g)  # outlier channels
    return ids, mask, aux.bfloat16(), last.bfloat16()


def _assert_fp8_rows_match(got, want, scale, what):
    """got: the reader's dequantized rows [T, L, H]; want: the bf16 rows written; scale: the file's scales.
    Every element within e4m3's rounding bound, so every row's L2 error within that bound's norm."""
    from sglang_hs.extract import fp8

    assert got.dtype == torch.bfloat16 and got.shape == want.shape, (what, got.dtype, got.shape)
    diff = (got.float() - want.float())
    bound = fp8.error_bound(want, scale)
    rel = diff.norm(dim=-1) / want.float().norm(dim=-1)
    print(what, "max |diff|/bound", float((diff.abs() / bound).max()), "row rel L2 per layer: max",
          rel.amax(0).tolist(), "mean", rel.mean(0).tolist())
    assert (diff.abs() <= bound).all(), (what, (diff.abs() > bound).nonzero()[:5])
    assert (diff.norm(dim=-1) <= bound.norm(dim=-1)).all(), what
    assert rel.median() < 2 ** -4, what  # typical rows: e4m3's relative precision, not the worst case


@pytest.mark.parametrize("save_dtype", ["fp8", "fp8-per-layer"])
def test_fp8_files_are_speculators_scheme_and_fp8transfer_dequantizes_them(tmp_path, save_dtype):
    from safetensors import safe_open

    ArrowDataset, CollateFn, FileTransfer, FP8Transfer = _speculators()
    (SCALES_KEY,) = _import_or_skip("hs_connectors.fp8_utils", ["SCALES_KEY"])
    K, H = 3, 160
    sink = SafetensorsSink(str(tmp_path), save_dtype)
    sink.layer_ids = [2, 4, 5]
    written = {}
    for i in [0, 3, 4, 9]:
        written[i] = _layered_sample(i, K, H)
        sink.write(i, *written[i])
    assert sink.finalize() == {"rows": 4}
    order = sorted(written)
    per_layer = save_dtype == "fp8-per-layer"
    for row, index in enumerate(order):
        ids, mask, aux, last = written[index]
        T = len(ids)
        want = torch.cat([aux, last[:, None]], dim=1)
        with safe_open(str(tmp_path / f"hs_{index}.safetensors"), "pt") as f:  # the bytes on disk
            assert set(f.keys()) == {"hidden_states", SCALES_KEY, "token_ids", "loss_mask"}
            q, scale = f.get_tensor("hidden_states"), f.get_tensor(SCALES_KEY)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (T, K + 1, H)
        assert scale.dtype == torch.float32 and scale.shape == ((T, K + 1, 1) if per_layer else (T, 1, 1))
        assert torch.equal(scale.bfloat16().float(), scale)  # the reader casts it to bf16: exactly
        # the scale spans e4m3's range: each token's (or token-layer's) largest value quantizes to 448
        assert (q.float().abs().amax(dim=(2,) if per_layer else (1, 2), keepdim=True) == 448).all()
        raw = FP8Transfer(tmp_path / "hidden_states").get_cached(row)  # the released reader, default bf16
        assert SCALES_KEY not in raw and torch.equal(raw["token_ids"], ids)
        _assert_fp8_rows_match(raw["hidden_states"], want, scale, f"{save_dtype} row {row}")
    # and through the trainer's dataset and collate function, as `--hidden-states-backend fp8` builds them
    ds = ArrowDataset(4096, str(tmp_path), transfer=FP8Transfer(tmp_path / "hidden_states"), on_missing="raise")
    assert len(ds) == 4
    for row, index in enumerate(order):
        ids, mask, aux, last = written[index]
        item = ds[row]
        assert isinstance(item, dict), (row, item)
        got = torch.cat([item["hidden_states"].view(len(ids), K, H), item["verifier_last_hidden_states"][:, None]], 1)
        with safe_open(str(tmp_path / f"hs_{index}.safetensors"), "pt") as f:
            scale = f.get_tensor(SCALES_KEY)
        _assert_fp8_rows_match(got, torch.cat([aux, last[:, None]], dim=1), scale, f"ArrowDataset row {row}")
        assert torch.equal(item["input_ids"], ids) and torch.equal(item["loss_mask"], mask)
    batch = CollateFn(4096, H, K, dtype=torch.bfloat16)([ds[r] for r in range(len(ds))])
    assert batch["error_records"] == 0


def test_fp8_files_are_half_the_size_of_bf16(tmp_path):
    """DeepSeek-V3's row width (H = 7168, 3 aux layers + the final state), 64 tokens."""
    ids, mask, _, _ = _sample(0)
    T = len(ids)
    aux, last = torch.randn(T, 3, 7168).bfloat16(), torch.randn(T, 7168).bfloat16()
    size = {d: SafetensorsSink(str(tmp_path / str(d)), d).write(0, ids, mask, aux, last) for d in (None, "fp8")}
    print(size, size["fp8"] / size[None])
    assert 0.49 < size["fp8"] / size[None] < 0.51


def test_fp8_shards_merge_and_captures_of_another_dtype_are_refused(tmp_path, capsys):
    _, _, _, FP8Transfer = _speculators()
    written = {}
    for i in range(2):  # --shard i/2 --save-dtype fp8, copied into one folder and finalized
        sink = SafetensorsSink(str(tmp_path / "merged"), "fp8")
        for j in range(i, 6, 2):
            written[j] = _layered_sample(j)
            sink.write(j, *written[j])
    assert cli.main(["--finalize", "--format", "safetensors", "--output", str(tmp_path / "merged")]) == 0
    for row, index in enumerate(sorted(written)):
        ids, _, aux, last = written[index]
        raw = FP8Transfer(tmp_path / "merged" / "hidden_states").get_cached(row)
        assert torch.equal(raw["token_ids"], ids)
        assert raw["hidden_states"].dtype == torch.bfloat16  # dequantized: the file had its scales
    for other in (None, "fp8-per-layer"):  # a bf16 or per-layer shard copied in: not one dataset
        out = tmp_path / f"mixed-{other}"
        shutil.copytree(tmp_path / "merged", out)
        SafetensorsSink(str(out), other).write(99, *_layered_sample(99))
        with pytest.raises(SinkError, match="different captures"):
            SafetensorsSink(str(out)).finalize()


def test_token_freq_is_what_each_trainer_counts(tmp_path):
    """finalize writes token_freq.pt, the {token: count} of the loss-masked tokens speculators reads with
    --draft-vocab-size: equal to what speculators' own save_token_frequency_distribution counts over the
    dataset, and to what SpecForge 0.2.0 counts over the same samples in its layout to build its d2t/t2d
    (count_effective_feature_tokens). A d2t/t2d cache speculators left from earlier files is removed."""
    (save_freq, build_maps) = _import_or_skip("speculators.train.vocab_mapping", [
        "save_token_frequency_distribution", "build_vocab_mappings_from_distribution"])
    (count_specforge,) = _import_or_skip("specforge.training.vocab_mapping", ["count_effective_feature_tokens"])
    import datasets

    out = tmp_path / "st"
    sink = SafetensorsSink(str(out))
    written = _write(sink, [0, 1, 2, 5, 9])
    (out / "d2t-64.npy").write_bytes(b"stale")
    (out / "t2d-64.npy").write_bytes(b"stale")
    assert sink.finalize() == {"rows": 5}
    ours = torch.load(out / "token_freq.pt", weights_only=True)
    assert not (out / "d2t-64.npy").exists() and not (out / "t2d-64.npy").exists()
    ds = datasets.load_from_disk(str(out))
    save_freq(ds, tmp_path / "theirs.pt")
    assert ours == torch.load(tmp_path / "theirs.pt", weights_only=True)
    assert sum(ours.values()) == sum(int(m.sum()) for _, m, _, _ in written.values())
    sf = SpecForgeSink(str(tmp_path / "sf"))
    for i, sample in written.items():
        sf.write(i, *sample)
    assert dict(count_specforge(str(tmp_path / "sf"))) == ours
    d2t, t2d = build_maps(ours, draft_vocab_size=16, target_vocab_size=32000)  # what --draft-vocab-size 16 builds
    assert int(t2d.sum()) == 16 and set((d2t + torch.arange(16)).tolist()) <= set(ours) | set(range(16))


# --- speculators end to end: its prepare_data's dataset and its own training data pipeline over our output ---

def _speculators_pipeline(out, K, H, total_seq_len, train_ratio=0.75):
    """speculators 0.9.0's own training data pipeline (create_train_val_loaders: ArrowDataset, its packing
    sampler and CollateFn, train and val splits) over folder `out`, as `speculators train --data-path out` builds
    it (no vLLM: a missing file raises). Returns (samples kept, samples dropped, {token ids: (loss mask,
    aux rows, last state)} of the kept ones), both splits together."""
    (create_train_val_loaders,) = _import_or_skip("speculators.train.dataloader", ["create_train_val_loaders"])
    loaders = create_train_val_loaders(
        data_path=str(out), total_seq_len=total_seq_len, hidden_states_dtype=torch.bfloat16,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="unused",
        request_timeout=1.0, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=H, num_target_layers=K, num_workers=0, prefetch_factor=None, preprocess=None,
        train_data_ratio=train_ratio)
    kept, dropped, docs = 0, 0, {}
    for loader in loaders:
        for batch in loader:
            dropped += int(batch["error_records"])
            doc = batch["document_ids"][0]
            for d in range(int(doc.max()) + 1):
                at = doc == d
                ids = tuple(batch["input_ids"][0, at].tolist())
                docs[ids] = (batch["loss_mask"][0, at], batch["hidden_states"][0, at],
                             batch["verifier_last_hidden_states"][0, at])
                kept += 1
    return kept, dropped, docs


def test_speculators_pipeline_keeps_every_sample_and_drops_a_planted_mismatch(tmp_path):
    """The dataset finalize writes is the one speculators' prepare_data builds from the same (input_ids,
    loss_mask) rows (its build_speculator_training_dataset, pre-tokenized rows), row for row and file_idx for
    file_idx; speculators' own training data pipeline over the folder keeps every sample (zero dropped), each
    with its rows. A row whose input_ids are off by one (the dataset no longer the files') is dropped by
    speculators' token check, and the count here says so."""
    (build_dataset,) = _import_or_skip("speculators.data_generation.preprocessing",
                                       ["build_speculator_training_dataset"])
    import datasets

    K, H = 3, 24
    sink = SafetensorsSink(str(tmp_path / "out"))
    sink.layer_ids = [2, 4, 5]
    indices = [0, 2, 3, 7, 12, 13, 20, 31]  # gaps, as skipped or failed samples leave
    written = _write(sink, indices)
    assert sink.finalize() == {"rows": len(indices)}
    ours = datasets.load_from_disk(str(tmp_path / "out")).with_format(None)
    # (datasets types a column named input_ids int32, as in prepare_data's dataset of rendered conversations)
    rows = {"input_ids": [written[i][0].tolist() for i in indices],
            "loss_mask": [written[i][1].tolist() for i in indices]}
    theirs = build_dataset(datasets.Dataset.from_dict(rows), processor=None, max_length=4096, num_proc=1)
    theirs = theirs.with_format(None)
    assert len(theirs) == len(ours) == len(indices)  # prepare_data dropped none (each row has a masked token)
    for col in ("input_ids", "loss_mask", "seq_len"):
        assert ours[col] == theirs[col], col
        assert ours.features[col] == theirs.features[col], (col, ours.features[col], theirs.features[col])
    total = sum(len(written[i][0]) for i in indices) + 1
    kept, dropped, docs = _speculators_pipeline(tmp_path / "out", K, H, total)
    print("speculators pipeline: kept", kept, "dropped", dropped)
    assert (kept, dropped) == (len(indices), 0)
    for i in indices:
        ids, mask, aux, last = written[i]
        got_mask, got_aux, got_last = docs[tuple(ids.tolist())]
        assert torch.equal(got_mask, mask) and torch.equal(got_aux, aux.reshape(len(ids), K * H))
        assert torch.equal(got_last, last)
    # planted: row 5's input_ids off by one in the dataset (its file unchanged)
    planted = tmp_path / "planted"
    shutil.copytree(tmp_path / "out", planted)
    bad = ours.map(lambda r, n: {"input_ids": [t + 1 for t in r["input_ids"]] if n == 5 else r["input_ids"]},
                   with_indices=True)
    for p in planted.glob("data-*.arrow"):
        p.unlink()
    (planted / "state.json").unlink()
    bad.set_format(type="torch")
    bad.save_to_disk(str(planted / ".ds"))
    for p in (planted / ".ds").iterdir():
        os.replace(p, planted / p.name)
    with pytest.warns(UserWarning, match="don'tmatch input ids"):
        kept, dropped, docs = _speculators_pipeline(planted, K, H, total)
    print("planted: kept", kept, "dropped", dropped)
    assert (kept, dropped) == (len(indices) - 1, 1) and tuple(written[indices[5]][0].tolist()) not in docs
