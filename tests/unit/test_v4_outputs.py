"""DeepSeek-V4's capture convention in what reads the dump and writes the training files (issue 34, item 4).

With `--hs-hc-streams full` a layer id holds hc_mult rows (rows_per_layer in the server's manifest), so no
count of layers may come from a row count: the safetensors sink records the layer ids' count in
`num_aux_layers` (it said aux.shape[1], the rows) and rows_per_layer beside it; a reattaching reader treats
a server restarted with other rows per layer id (or other final states) as another setup; the EAGLE-3
trainers' formats and the live dataset refuse full streams in one line (tests/unit/test_v4_trainers.py
trains on the default convention). Dumps are written by the real CaptureWriter with the spec and manifest
fields the V4 overlay gives it (sglang_hs/server/models/deepseek_v4.py); SGLang's V4 forward cannot run here."""
import json
import os
import re
import types

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.extract import cli  # noqa: E402
from sglang_hs.extract.sinks import SafetensorsSink, SinkError, SpecForgeSink  # noqa: E402
from sglang_hs.reader import HiddenStateReader, ServerRestarted  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

H, HC, LAYERS, NUM_LAYERS, SLOTS = 24, 4, [1, 3, 5], 6, 64
V4 = "DeepseekV4ForCausalLM"


def v4_writer(dump, streams="mean", last="both", generation=0):
    """A V4 server's writer as the overlay makes it: the spec of its hc_mult and --hs-hc-streams, rows that
    differ per slot, row and hidden index (and per server generation)."""
    dump.mkdir(mode=0o700, exist_ok=True)
    spec = CaptureSpec.resolve(LAYERS, last, NUM_LAYERS, H, hc_mult=HC, streams=streams)
    w = CaptureWriter(str(dump), spec, SLOTS, torch.float32, 1 << 18, model_path="v4", architecture=V4)
    s, p, h = torch.meshgrid(torch.arange(SLOTS), torch.arange(w.P), torch.arange(H), indexing="ij")
    w.store.copy_(1000 * generation + s + p / 32 + h / 1024)
    return w


def test_the_writer_manifest_carries_the_v4_fields(tmp_path):
    w = v4_writer(tmp_path / "dump", "full")
    m = json.load(open(tmp_path / "dump" / "manifest.json"))
    assert (m["hc_mult"], m["hc_streams"], m["rows_per_layer"], m["dspark_layer_ids"]) == (HC, "full", HC, [0, 2, 4])
    assert w.P == len(LAYERS) * HC + 2


def _full_sample(T=7):
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, 300, (T,), generator=g), torch.ones(T, dtype=torch.long),
            torch.randn(T, len(LAYERS) * HC, H, generator=g), torch.randn(T, H, generator=g))


def test_safetensors_metadata_counts_layer_ids_not_rows(tmp_path):
    """Full streams: hidden_states [T, K * hc_mult + 1, H] as captured; num_aux_layers is K (it was the row
    count, K * hc_mult) and rows_per_layer says hc_mult."""
    from safetensors import safe_open

    ids, mask, aux, last = _full_sample()
    sink = SafetensorsSink(str(tmp_path))
    sink.layer_ids, sink.rows_per_layer = LAYERS, HC
    sink.write(0, ids, mask, aux, last)
    with safe_open(sink.path(0), "pt") as f:
        meta, hs = f.metadata(), f.get_tensor("hidden_states")
    print(meta)
    assert meta["num_aux_layers"] == str(len(LAYERS)) and meta["rows_per_layer"] == str(HC)
    assert meta["layer_ids"] == "1,3,5"
    assert torch.equal(hs, torch.cat([aux, last[:, None]], dim=1))
    # the default convention (one row per id) writes what every earlier file holds: no rows_per_layer key
    plain = SafetensorsSink(str(tmp_path / "mean"))
    plain.layer_ids = LAYERS
    plain.write(0, ids, mask, aux[:, :len(LAYERS)], last)
    with safe_open(plain.path(0), "pt") as f:
        meta = f.metadata()
    assert meta["num_aux_layers"] == "3" and "rows_per_layer" not in meta


@pytest.mark.parametrize("sink_cls", [SafetensorsSink, SpecForgeSink])
def test_rows_that_do_not_fit_the_layer_ids_are_refused_before_a_file_is_made(tmp_path, sink_cls):
    ids, mask, aux, last = _full_sample()
    sink = sink_cls(str(tmp_path))
    sink.layer_ids, sink.rows_per_layer = LAYERS, HC
    with pytest.raises(SinkError, match=r"^aux holds 11 rows per token, expected 3 layer ids x 4 rows per layer id$"):
        sink.write(0, ids, mask, aux[:, :11], last)
    sink.rows_per_layer = 1  # the mean convention's sink handed full-stream rows
    with pytest.raises(SinkError, match="aux holds 12 rows per token, expected 3 layer ids x 1 rows"):
        sink.write(0, ids, mask, aux, last)
    assert sink.existing() == 0 and not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_finalize_refuses_full_stream_files(tmp_path):
    pytest.importorskip("datasets", reason="finalize writes a datasets dataset")
    ids, mask, aux, last = _full_sample()
    sink = SafetensorsSink(str(tmp_path))
    sink.layer_ids, sink.rows_per_layer = LAYERS, HC
    sink.write(0, ids, mask, aux, last)
    with pytest.raises(SinkError, match="holds 4 rows per layer id .*--hs-hc-streams full.*no speculators dataset"):
        sink.finalize()
    assert not (tmp_path / "state.json").exists()


@pytest.mark.parametrize("before, after, differs", [
    (("mean", "both"), ("full", "both"), "rows_per_layer 1 before, 4 now"),
    (("mean", "post-norm"), ("mean", "both"), "last_states ['post-norm'] before, ['post-norm', 'pre-norm'] now"),
])
def test_a_reattaching_reader_stops_when_the_rows_per_token_change(tmp_path, before, after, differs):
    """Same layer ids, other rows per record: the restarted server's records are split by another row count
    (the reader's num_aux and final-state rows are fixed when it attaches), so it is another setup."""
    dump = tmp_path / "dump"
    v4_writer(dump, *before)
    reader = HiddenStateReader(str(dump), wait=1, reattach=True)
    assert reader.num_aux == len(LAYERS)
    v4_writer(dump, *after, generation=1)
    with pytest.raises(ServerRestarted, match="another capture setup .*" + re.escape(differs)):
        reader.next(timeout=5)
    reader.close()


def test_a_reader_of_full_streams_splits_k_times_hc_rows_then_the_finals(tmp_path):
    dump = tmp_path / "dump"
    w = v4_writer(dump, "full")
    w.publish_gathered("r", torch.arange(5, dtype=torch.int32), torch.arange(3, 8), prompt_len=2, next_token=9)
    reader = HiddenStateReader(str(dump), wait=1)
    rec = reader.take("r", timeout=5)
    K = len(LAYERS) * HC
    assert rec.aux_hidden_states.shape == (5, K, H)
    assert torch.equal(rec.aux_hidden_states, w.store[3:8, :K])
    assert torch.equal(rec.last_hidden_state, w.store[3:8, K]) and torch.equal(rec.last_pre_norm, w.store[3:8, K + 1])
    reader.close()


@pytest.mark.parametrize("fmt", ["specforge", "safetensors"])
def test_the_extraction_refuses_full_streams_for_the_eagle3_formats_in_one_line(tmp_path, fmt, capsys):
    """Both trainers size the draft's fc as layers x hidden (SpecForge 3 x target_hidden_size, speculators
    len(--target-layer-ids) x hidden_size): K x hc_mult x H per token would fail at their first step."""
    w = v4_writer(tmp_path / "dump", "full")
    w.publish_gathered("r", torch.arange(5, dtype=torch.int32), torch.arange(5), prompt_len=2, next_token=9)
    rc = cli.main(["--from-dump", str(tmp_path / "dump"), "--output", str(tmp_path / "out"), "--format", fmt,
                   "--idle-timeout", "0.5"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    print(err)
    assert rc != 0 and len(err) == 1, err
    assert err[0].startswith(f"python -m sglang_hs.extract: error: --format {fmt}: the server of ")
    assert "--hs-hc-streams full, 4 rows of 24 per layer id" in err[0] and "--hs-hc-streams mean" in err[0]
    assert not list((tmp_path / "out").glob("**/*.ckpt")) and not list((tmp_path / "out").glob("hs_*"))
    assert w.ring.free_bytes() < w.ring.capacity  # the record stays for a reader that can use it


def test_the_live_dataset_refuses_full_streams_in_one_line(tmp_path):
    from sglang_hs.live import LiveDatasetError, LiveHiddenStates

    m = {"last": True, "last_states": ["post-norm", "pre-norm"], "rows_per_layer": HC, "layer_ids": LAYERS}
    closed = []
    reader = types.SimpleNamespace(manifest=m, close=lambda: closed.append(1))
    ds = LiveHiddenStates([], server="http://127.0.0.1:9", dump_dir=str(tmp_path))
    with pytest.raises(LiveDatasetError, match=r"^LiveHiddenStates: the server at http://127.0.0.1:9 captures "
                       r"DeepSeek-V4's full hyper-connection streams .*--hs-hc-streams mean$"):
        list(ds._samples(reader, "x-", 0, 1, 1))
    assert closed == [1]


def _checkpoint(path, names, seed):
    from safetensors.torch import save_file

    path.mkdir()
    g = torch.Generator().manual_seed(seed)
    save_file({n: torch.randn(6, 4, generator=g) if "norm" not in n else torch.randn(4, generator=g) for n in names},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": [V4]}))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def test_speculators_verifier_renames_v4s_tensors_and_is_remade_for_another_checkpoint(tmp_path):
    """speculators 0.9.0 finds no lm_head.weight in DeepSeek-V4's layout (head.weight, embed.weight) and takes the
    embedding for it (tests/unit/test_v4_trainers.py measures the teacher); the extraction's verifier folder
    holds them under speculators' names, is kept for the same checkpoint and remade for another."""
    from safetensors import safe_open

    from sglang_hs.extract import checkpoint_names, output

    v3 = _checkpoint(tmp_path / "v3", ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"], 0)
    assert checkpoint_names.speculators_renames(v3) == {}
    assert checkpoint_names.write_speculators_verifier(str(tmp_path), v3) is None
    assert output.training_command(str(tmp_path), {"model_path": v3, "layer_ids": [1]}, "safetensors", None)[5] == v3
    a = _checkpoint(tmp_path / "a", ["embed.weight", "head.weight", "norm.weight", "layers.0.attn_norm.weight"], 1)
    assert checkpoint_names.speculators_renames(a) == {"model.embed_tokens.weight": "embed.weight",
                                             "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight"}
    out = tmp_path / "out"
    out.mkdir()
    shim = checkpoint_names.write_speculators_verifier(str(out), a)
    assert shim == str(out / checkpoint_names.SPECULATORS_VERIFIER)
    assert output.training_command(str(out), {"model_path": a, "layer_ids": [1]}, "safetensors", None)[5] == shim

    def tensors(folder):
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    src = tensors(a)
    got = tensors(shim)
    assert set(got) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert torch.equal(got["lm_head.weight"], src["head.weight"]) and torch.equal(got["model.norm.weight"], src["norm.weight"])
    assert os.path.realpath(os.path.join(shim, "config.json")) == os.path.join(a, "config.json")
    assert os.path.islink(os.path.join(shim, "tokenizer.json"))
    mtime = os.stat(os.path.join(shim, "model.safetensors")).st_mtime_ns
    assert checkpoint_names.write_speculators_verifier(str(out), a) == shim  # the same checkpoint: kept
    assert os.stat(os.path.join(shim, "model.safetensors")).st_mtime_ns == mtime
    b = _checkpoint(tmp_path / "b", ["model.embed_tokens.weight", "head.weight", "model.norm.weight"], 2)
    assert checkpoint_names.speculators_renames(b)["lm_head.weight"] == "head.weight"
    checkpoint_names.write_speculators_verifier(str(out), b)  # another checkpoint: remade from it
    assert torch.equal(tensors(shim)["lm_head.weight"], tensors(b)["head.weight"])
    assert os.path.realpath(os.path.join(shim, "config.json")) == os.path.join(b, "config.json")
    assert sorted(os.listdir(out)) == [checkpoint_names.SPECULATORS_VERIFIER]  # no temporary folder left
