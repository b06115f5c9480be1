"""The sink stage's interface (sglang_hs/extract/sinks/): every format takes a TrainingSample (or its fields) with
write(), says what the output folder holds with resume_state(), and adds what its trainer needs with finalize();
SINKS is the registry the --format choices come from, and importing it costs no torch (--help stays quick)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.extract.sinks import SINKS, ResumeState, Sink, SinkError, TrainingSample


def _sample(index, T=5, K=2, H=8):
    rows = torch.randn(T, K + 1, H, generator=torch.Generator().manual_seed(index)).bfloat16()
    return TrainingSample(index, torch.arange(T), torch.ones(T, dtype=torch.long), rows[:, :K], rows[:, K])


@pytest.mark.parametrize("fmt", list(SINKS))
def test_a_sample_or_its_fields_make_the_same_file(tmp_path, fmt):
    a, b = SINKS[fmt](str(tmp_path / "a")), SINKS[fmt](str(tmp_path / "b"))
    s = _sample(3)
    assert a.write(s) == b.write(*s) > 0
    assert torch.equal(_load(a, 3), _load(b, 3))


def _load(sink, index):
    if sink.name == "specforge":
        return torch.load(sink.path(index))["aux_hidden_state"]
    if sink.name == "deepspec":  # the whole file: header and the sample's bytes
        return torch.frombuffer(bytearray(open(sink.path(index), "rb").read()), dtype=torch.uint8)
    from safetensors.torch import load_file

    return load_file(sink.path(index))["hidden_states"]


@pytest.mark.parametrize("fmt", list(SINKS))
def test_resume_state_is_the_complete_files_only(tmp_path, fmt):
    sink = SINKS[fmt](str(tmp_path))
    assert sink.resume_state().files == 0
    for i in (0, 2, 4711):
        sink.write(_sample(i))
    partial = sink.path(9) + ".123.tmp"  # a write a crash cut short
    open(partial, "wb").write(b"half")
    state = sink.resume_state()
    assert isinstance(state, ResumeState) and state.files == 3
    assert [i for i in range(10) if state.done(i)] == [0, 2] and state.done(4711) and not state.done(9)
    assert sink.remove_partial() == 1 and not os.path.exists(partial)


def test_finalize_adds_what_the_trainer_reads(tmp_path):
    sf, st = SINKS["specforge"](str(tmp_path / "sf")), SINKS["safetensors"](str(tmp_path / "st"))
    ds = SINKS["deepspec"](str(tmp_path / "ds"))
    for sink in (sf, st, ds):
        sink.describe_capture({"layer_ids": [1, 2], "rows_per_layer": 1, "model_path": "/m"})
        for i in range(2):
            sink.write(_sample(i))
    assert sf.finalize() is None  # SpecForge reads rows_*/ as they are
    assert st.finalize() == {"rows": 2} and os.path.exists(tmp_path / "st" / "state.json")
    assert ds.finalize() == {"rows": 2} and os.path.exists(tmp_path / "ds" / "target_cache" / "samples.idx")


def test_a_record_becomes_the_sample_of_the_final_state_its_trainer_reads():
    rec = SimpleNamespace(input_ids="ids", aux_hidden_states="aux", last_hidden_state="post", last_pre_norm="pre")
    assert SINKS["specforge"]("/x").sample_of(1, rec, "mask") == TrainingSample(1, "ids", "mask", "aux", "post")
    assert SINKS["safetensors"]("/x").sample_of(1, rec, "mask") == TrainingSample(1, "ids", "mask", "aux", "pre")
    assert SINKS["deepspec"]("/x").sample_of(1, rec, "mask") == TrainingSample(1, "ids", "mask", "aux", "post")


def test_the_capture_sets_the_rows_a_file_must_hold(tmp_path):
    sink = SINKS["safetensors"](str(tmp_path))
    sink.describe_capture({"layer_ids": [1, 2, 3]})
    with pytest.raises(SinkError, match="aux holds 2 rows per token, expected 3 layer ids x 1 rows per layer id"):
        sink.write(_sample(0))
    assert not os.listdir(tmp_path)  # refused before any file is made


def test_a_format_refuses_a_dtype_it_cannot_store_in_one_line():
    with pytest.raises(SinkError, match="^--format specforge cannot store --save-dtype fp8$"):
        SINKS["specforge"]("/x", "fp8")
    assert SINKS["safetensors"]("/x", "fp8", share_gid=7).share_gid == 7


def test_a_new_format_is_a_subclass_and_its_registry_line(tmp_path):
    """What sinks/__init__.py's SINKS needs of a format: a Sink with a name, a path and a way to save."""
    class Lines(Sink):
        name = "lines"

        def path(self, index):
            return os.path.join(self.out_dir, f"{index}.txt")

        def existing(self):
            return len(os.listdir(self.out_dir))

        def _save(self, tmp, input_ids, loss_mask, aux, last):
            open(tmp, "w").write(" ".join(map(str, input_ids.tolist())))

    sink = {**SINKS, Lines.name: Lines}["lines"](str(tmp_path))
    assert sink.write(_sample(5)) == len("0 1 2 3 4") and sink.resume_state().done(5)


def test_the_registry_costs_no_torch():
    code = "import sys, sglang_hs.extract.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
