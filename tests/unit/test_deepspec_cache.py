"""--format deepspec: DeepSpec's target cache v2, read back by tests/deepspec_reader.py (written from the format's
published layout, not from sinks/deepspec.py). Every row must be bit for bit what the sink was handed (FP8: the
cast's bytes, read back as bf16 as DeepSpec's FP8 reader does). DeepSpec itself is not on a package registry, so its own
CacheDataset is not loaded here (docs/extract.md says how its code was compared)."""
import json
import os
import shutil

import pytest
import torch

from deepspec_reader import read_cache
from sglang_hs.extract import cli
from sglang_hs.extract.fp8 import FP8OutOfRange, NonFiniteRows
from sglang_hs.extract.sinks import SINKS, SinkError, deepspec_sample
from sglang_hs.reader import HiddenStateReader

OURS = [0, 2, 5]  # layer ids in sglang-hs's convention (0: the embeddings)
THEIRS = [-1, 1, 4]  # the same states in DeepSpec's (-1: the embeddings; j: the output of decoder layer j)
FP8 = {"fp8": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


def _sample(index, K=3, H=20, dtype=torch.bfloat16, scale=4.0):
    """Rows that differ per token, layer and sample; odd lengths, the final state unlike every layer."""
    T = 3 + index % 7
    g = torch.Generator().manual_seed(500 + index)
    ids = torch.randint(0, 129280, (T,), generator=g)
    mask = torch.randint(0, 2, (T,), generator=g)
    aux = (torch.randn(T, K, H, generator=g) * scale).to(dtype)
    last = torch.randn(T, H, generator=g).to(dtype)
    return ids, mask, aux, last


def _sink(out, save_dtype=None, layer_ids=OURS):
    sink = SINKS["deepspec"](str(out), save_dtype)
    sink.describe_capture({"layer_ids": layer_ids, "model_path": "/models/DeepSeek-V3", "rows_per_layer": 1})
    return sink


def _write(sink, indices, shared=False, **kw):
    """shared: aux and last as the reader hands them out, the two views of one record's rows."""
    written = {}
    for i in indices:
        ids, mask, aux, last = written[i] = _sample(i, **kw)
        if shared:
            rows = torch.cat([aux, last[:, None]], dim=1)
            aux, last = rows[:, :aux.shape[1]], rows[:, aux.shape[1]]
        sink.write(i, ids, mask, aux, last)
    return written


def _bits(x):
    return x.contiguous().view(torch.uint8) if x.dtype.itemsize == 1 else x.contiguous().view(torch.int16)


def _check(out, written, save_dtype=None):
    """The cache in out/target_cache holds `written` in sample order, row for row, bit for bit."""
    rows, m = read_cache(out / "target_cache")
    order = sorted(written)
    stored = FP8.get(save_dtype, torch.bfloat16)
    assert m["num_samples"] == len(order) and m["hidden_size"] == 20
    assert m["hidden_dtype"] == str(stored)[6:] and m["target_model_name_or_path"] == "/models/DeepSeek-V3"
    assert m["target_layer_ids"] == THEIRS and m["sglang_hs"]["layer_ids"] == OURS  # translated, and both recorded
    assert m["sglang_hs"]["sample_indices"] == order
    for (rec, got), index in zip(rows, order):
        ids, mask, aux, last = written[index]
        T = len(ids)
        _, _, seq_len, o_ids, o_att, o_mask, o_hid, o_last = rec
        print(index, rec)
        assert seq_len == T
        # laid out back to back as DeepSpec's writer does
        assert (o_att, o_mask, o_hid, o_last) == (o_ids + 4 * T, o_ids + 5 * T, o_ids + 6 * T,
                                                  o_ids + 6 * T + T * 3 * 20 * stored.itemsize)
        assert got["input_ids"].dtype == torch.int32 and torch.equal(got["input_ids"], ids.int())
        assert torch.equal(got["attention_mask"], torch.ones(T, dtype=torch.uint8))
        assert got["loss_mask"].dtype == torch.uint8 and torch.equal(got["loss_mask"], mask.to(torch.uint8))
        want_hid, want_last = aux.reshape(T, -1).to(stored), last.to(stored)  # one cast from the server's dtype
        assert got["target_hidden_states"].dtype == stored
        assert torch.equal(_bits(got["target_hidden_states"]), _bits(want_hid))
        assert torch.equal(_bits(got["target_last_hidden_states"]), _bits(want_last))
        # what the live dataset yields is what DeepSpec's reader returns (FP8: its cast back to bf16)
        live = deepspec_sample(ids, mask, aux, last, dtype=stored)
        assert live.keys() == got.keys() - {"attention_mask"}
        for k, v in live.items():
            want = got[k].to(torch.bfloat16) if got[k].dtype in FP8.values() else got[k]
            assert v.dtype == want.dtype and torch.equal(_bits(v), _bits(want)), k
    return m


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_reads_back_bit_for_bit_with_layer_ids_translated(tmp_path, dtype, shared):
    sink = _sink(tmp_path, "bf16")
    written = _write(sink, [0, 2, 3, 9, 100], shared=shared, dtype=dtype)  # gaps, as skipped samples leave
    assert sink.finalize() == {"rows": 5}
    _check(tmp_path, written)
    # the shards are the sample files themselves: no extra disk
    for row, index in enumerate(sorted(written)):
        assert os.path.samefile(tmp_path / "target_cache" / f"shard-{row:05d}.bin", sink.path(index))


@pytest.mark.parametrize("save_dtype", ["fp8", "fp8-e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_caches_hold_the_cast_bytes(tmp_path, save_dtype, dtype):
    sink = _sink(tmp_path, save_dtype)
    written = _write(sink, [1, 4, 5], dtype=dtype, scale=30.0)  # within e4m3's range (448)
    assert sink.finalize() == {"rows": 3}
    _check(tmp_path, written, save_dtype)
    bf16 = _sink(tmp_path / "bf16", "bf16")
    _write(bf16, [1], dtype=dtype, scale=30.0)
    T = len(written[1][0])
    assert os.path.getsize(bf16.path(1)) - os.path.getsize(sink.path(1)) == T * 4 * 20  # one byte per element less


def test_values_an_unscaled_fp8_cast_cannot_hold_are_refused_not_clipped(tmp_path):
    ids, mask, aux, last = _sample(0)
    aux[1, 2, 3] = 1000.0  # e4m3fn's largest finite value is 448: torch's cast would saturate it silently
    sink = _sink(tmp_path / "e4m3", "fp8")
    with pytest.raises(FP8OutOfRange) as e:
        sink.write(0, ids, mask, aux, last)
    assert "--save-dtype fp8-e5m2 or bf16" in str(e.value) and "\n" not in str(e.value) and e.value.reason == \
        "fp8_out_of_range"
    assert not os.listdir(tmp_path / "e4m3")
    e5m2 = _sink(tmp_path / "e5m2", "fp8-e5m2")  # e5m2 reaches 57344
    e5m2.write(0, ids, mask, aux, last)
    assert e5m2.finalize() == {"rows": 1}
    aux[0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteRows):
        e5m2.write(1, ids, mask, aux, last)
    with pytest.raises(FP8OutOfRange):  # the live dataset skips what the files would not hold
        deepspec_sample(ids, mask, aux.nan_to_num(), last, dtype=torch.float8_e4m3fn)


def test_shards_merge_resume_adds_rows_and_bad_files_are_refused(tmp_path, capsys):
    written = {}
    for i in range(2):  # --shard i/2 outputs copied into one folder, then --finalize
        out = tmp_path / f"shard{i}"
        sink = _sink(out)
        written.update(_write(sink, [j for j in range(7) if j % 2 == i]))
        assert sink.finalize() == {"rows": len([j for j in range(7) if j % 2 == i])}
    merged = tmp_path / "merged"
    merged.mkdir()
    for i in range(2):
        for p in (tmp_path / f"shard{i}").glob("sample_*.bin"):
            shutil.copy(p, merged / p.name)
    assert cli.main(["--finalize", "--format", "deepspec", "--output", str(merged)]) == 0
    assert "DeepSpec target cache of 7 rows" in capsys.readouterr().err
    _check(merged, written)
    sink = _sink(merged)
    written.update(_write(sink, [20, 8]))  # a resumed run: the cache is rebuilt over every file
    assert sink.finalize() == {"rows": 9} and sink.existing() == 9
    _check(merged, written)
    assert sorted(os.listdir(merged / "target_cache")) == ["manifest.json", "samples.idx"] + [
        f"shard-{r:05d}.bin" for r in range(9)]
    # a copy cut short (a new file: the cache's shard is the old one's link): refused naming it, the cache kept
    data = open(sink.path(3), "rb").read()
    os.unlink(sink.path(3))
    open(sink.path(3), "wb").write(data[:-1])
    with pytest.raises(SinkError, match=r"sample_3\.bin is not a whole sample file .*no DeepSpec target cache written"):
        sink.finalize()
    _check(merged, written)
    os.unlink(sink.path(3))
    other = _sink(merged, layer_ids=[1, 3, 4])  # a shard of another capture copied in
    _write(other, [30])
    with pytest.raises(SinkError, match="different captures"):
        other.finalize()
    assert not [p for p in os.listdir(merged) if p.startswith(".")]


def test_files_without_layer_ids_make_no_cache(tmp_path):
    sink = SINKS["deepspec"](str(tmp_path))
    sink.write(0, *_sample(0))
    with pytest.raises(SinkError, match="records no layer ids"):
        sink.finalize()


def test_the_format_trains_on_the_post_norm_state_and_its_command_names_the_cache():
    from types import SimpleNamespace

    import yaml

    from sglang_hs.extract.trainers import training_command

    sink = SINKS["deepspec"]("/x")
    assert (sink.final_state, sink.needs_last) == ("post-norm", True)  # DeepSpec: AutoModel's last_hidden_state
    rec = SimpleNamespace(input_ids="ids", aux_hidden_states="aux", last_hidden_state="post", last_pre_norm="pre")
    assert sink.sample_of(0, rec, "mask").last == "post"
    argv = training_command("/out", {"model_path": "/m", "layer_ids": OURS}, "deepspec", None)
    opts = dict(a.split("=", 1) for a in argv[argv.index("--opts") + 1::2])  # DeepSpec parses values with yaml
    assert yaml.safe_load(opts["model.target_layer_ids"]) == THEIRS
    assert opts["data.target_cache_path"] == "/out/target_cache" and opts["model.target_model_name_or_path"] == "/m"


def test_the_live_dataset_takes_the_deepspec_layout_only_by_name():
    from sglang_hs.live import LiveHiddenStates

    with pytest.raises(ValueError, match="layout: one of specforge, deepspec, got 'deep'"):
        LiveHiddenStates([], server="http://127.0.0.1:1", dump_dir="/nonexistent", layout="deep")


def _needs_extension():
    from sglang_hs._ext import ExtensionNotBuilt, ext

    try:
        ext()
    except ExtensionNotBuilt as e:  # pragma: no cover
        pytest.skip(f"extension not built: {e}")


def test_a_harvest_of_real_records_becomes_the_cache_and_out_of_range_samples_are_skipped(tmp_path, capsys):
    """Records published by the real writer and ring (no server), harvested with --format deepspec --save-dtype
    fp8: each cache row is its record's store rows (the aux layers, then the post-norm state) cast to e4m3, the
    loss mask on the generated tokens; a record with a value beyond e4m3's range is skipped and counted."""
    _needs_extension()
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    H, slots = 8, 64
    (tmp_path / "dump").mkdir(mode=0o700)
    w = CaptureWriter(str(tmp_path / "dump"), CaptureSpec.resolve([1, 2], "both", 4, H), slots, torch.float32, 1 << 18)
    s, p, h = torch.meshgrid(torch.arange(slots), torch.arange(w.P), torch.arange(H), indexing="ij")
    w.store.copy_(s / 4 + p / 8 + h / 1024)  # differs per slot, row and index; within e4m3's range
    w.store[9, 0, 5] = 1000.0  # a row of the second request (slots 7-12)
    sent, slot = {}, 0
    for i, (rid, prompt, gen) in enumerate([("a", 5, 3), ("b", 4, 3), ("c", 3, 6)]):
        T = prompt + gen - 1
        ids = [100 * i + t for t in range(T + 1)]
        w.publish_gathered(rid, torch.tensor(ids[:T], dtype=torch.int32), torch.arange(slot, slot + T),
                           prompt_len=prompt, next_token=ids[T])
        sent[rid] = ids[:T], torch.arange(slot, slot + T), prompt
        slot += T
    out = tmp_path / "out"
    assert cli.main(["--from-dump", str(tmp_path / "dump"), "--output", str(out), "--idle-timeout", "0.5",
                     "--format", "deepspec", "--save-dtype", "fp8"]) == 0
    err = capsys.readouterr().err
    assert "skipped record b" in err and "fp8_out_of_range: its hidden states reach 1000" in err, err
    m = json.load(open(out / "manifest.json"))
    assert m["skipped"] == {"fp8_out_of_range": 1, "served_without_capture": 0} and m["samples_written"] == 2, m
    assert m["stored_dtype"] == "float8_e4m3fn (unscaled)" and m["deepspec_target_cache"]["rows"] == 2
    assert m["deepspec_target_cache"]["target_layer_ids"] == [0, 1] and m["layer_ids"] == [1, 2]
    assert "train with DeepSpec" in err and "model.target_layer_ids=[0,1]" in err
    rows, cache = read_cache(out / "target_cache")
    assert cache["target_layer_ids"] == [0, 1] and cache["hidden_dtype"] == "float8_e4m3fn"
    assert len(rows) == 2
    for (_, got), rid in zip(rows, ["a", "c"]):  # sample order = the harvest's record order
        ids, where, prompt = sent[rid]
        store = w.store[where]  # [T, K, post-norm, pre-norm]
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].tolist() == [0] * prompt + [1] * (len(ids) - prompt)
        want = store[:, :2].reshape(len(ids), -1).to(torch.float8_e4m3fn)
        assert torch.equal(_bits(got["target_hidden_states"]), _bits(want))
        assert torch.equal(_bits(got["target_last_hidden_states"]), _bits(store[:, 2].to(torch.float8_e4m3fn)))


def test_the_extraction_and_the_live_dataset_give_the_same_rows(tmp_path, monkeypatch):
    """Against a stand-in server publishing through the real writer: `--format deepspec` files, read back, and
    LiveHiddenStates(layout="deepspec") yield the same rows, bit for bit (bf16 and e5m2)."""
    from torch.utils.data import DataLoader

    from sglang_hs.live import LiveHiddenStates

    _needs_extension()
    from test_server_restart import FakeServer, Preparer, expected_rows

    monkeypatch.setattr(cli, "_model_side", lambda ns, manifest, url=None: (Preparer(), None))
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    server = FakeServer(dump)
    (tmp_path / "d.jsonl").write_text("".join('{"input_ids": [1]}\n' for _ in range(4)))
    for save_dtype, dtype in (("bf16", torch.bfloat16), ("fp8-e5m2", torch.float8_e5m2)):
        out = tmp_path / save_dtype
        assert cli.main(["--data", str(tmp_path / "d.jsonl"), "--output", str(out), "--server", server.url,
                         "--hs-dump-dir", str(dump), "--concurrency", "2", "--no-progress", "--format", "deepspec",
                         "--save-dtype", save_dtype]) == 0
        files, m = read_cache(out / "target_cache")
        assert m["target_layer_ids"] == [0, 1] and len(files) == 4
        ds = LiveHiddenStates(list(range(4)), server=server.url, dump_dir=dump, concurrency=2, reader_wait=5,
                              dtype=dtype, layout="deepspec")
        ds._preparer = Preparer()
        live = list(DataLoader(ds, batch_size=None, num_workers=0))
        assert len(live) == 4
        for i, ((_, f), s) in enumerate(zip(files, live)):
            T = 3 + i % 3
            rows = expected_rows(0, T)  # the stand-in server's float32 rows: [aux 1, aux 2, post-norm]
            assert torch.equal(_bits(f["target_hidden_states"]), _bits(rows[:, :2].reshape(T, -1).to(dtype)))
            assert torch.equal(_bits(f["target_last_hidden_states"]), _bits(rows[:, 2].to(dtype)))
            assert sorted(s) == ["input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"]
            for k, v in s.items():
                want = f[k].to(torch.bfloat16) if f[k].dtype in FP8.values() else f[k]
                assert v.dtype == want.dtype and torch.equal(_bits(v), _bits(want)), (i, k)


@pytest.mark.parametrize("part_bytes", [None, 256 << 20])
def test_a_sample_the_live_dataset_skips_still_gives_its_ring_bytes_back(tmp_path, monkeypatch, part_bytes):
    """A record whose rows DeepSpec's FP8 cannot store is skipped (counted): with the acknowledging reader the live
    dataset uses (part_bytes set, the default), it must still be acknowledged, or the ring stays pinned behind it
    and the server holds every captured request once it wraps (review of issue 47's reader half: 6 of 6 records
    were left unacknowledged)."""
    import sglang_hs.extract.sinks as sinks
    from sglang_hs.live import LiveHiddenStates

    _needs_extension()
    from test_server_restart import FakeServer, Preparer

    real, calls = sinks.deepspec_sample, []

    def first_unstorable(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise FP8OutOfRange("planted: a row beyond e4m3's range")
        return real(*a, **kw)

    monkeypatch.setattr(sinks, "deepspec_sample", first_unstorable)
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    server = FakeServer(dump)
    try:
        ds = LiveHiddenStates(list(range(6)), server=server.url, dump_dir=dump, concurrency=2, reader_wait=5,
                              dtype=torch.float8_e4m3fn, layout="deepspec", part_bytes=part_bytes)
        ds._preparer = Preparer()
        assert len(list(ds)) == 5 and sum(ds.skipped.values()) == 1, ds.skipped
        with HiddenStateReader(str(dump), ack=True, wait=5) as reader:
            assert reader.poll() == 0  # nothing left unacknowledged for the next reader
    finally:
        server.http.shutdown()
