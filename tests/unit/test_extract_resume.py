"""The resume stage (sglang_hs/extract/resume.py, journal.py, manifest.py): what --output already holds decides
whether a run may continue there, in one place for both kinds of run, and manifest.json is read back by the one
module that writes it."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.extract.config import OutputSettings
from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.journal import JOURNAL, Journal, setup_of
from sglang_hs.extract.manifest import previous, write_manifest
from sglang_hs.extract.output import prepare_output
from sglang_hs.extract.resume import continue_harvest, continue_requests
from sglang_hs.extract.sinks import SINKS, TrainingSample
from sglang_hs.extract.stats import Stats

MANIFEST = {"model_path": "m", "architecture": "DeepseekV3ForCausalLM", "dtype": "bfloat16", "hidden_size": 8,
            "num_hidden_layers": 4, "layer_ids": [1, 2], "last": True, "hf_output_hidden_states_index": [1, 2, 4],
            "convention": "hf"}


def _output(tmp_path, resume=False, save_dtype="bf16", fmt="specforge"):
    return OutputSettings(str(tmp_path / "out"), fmt, save_dtype, None, resume)


def _files(output, *indices):
    prepare_output(output.dir, None)
    sink = SINKS[output.format](output.dir, output.save_dtype)
    for i in indices:
        rows = torch.zeros(3, 3, 8)
        sink.write(TrainingSample(i, torch.arange(3), torch.ones(3), rows[:, :2], rows[:, 2]))
    return sink


def test_a_data_run_starts_fresh_or_continues_only_with_resume_and_the_same_dtype(tmp_path, capsys):
    out = _output(tmp_path)
    sink = SINKS[out.format](out.dir, out.save_dtype)
    assert continue_requests(out, sink).files == 0 and os.path.isdir(out.dir)
    _files(out, 0, 1)
    open(sink.path(5) + ".9.tmp", "wb").write(b"half")
    with pytest.raises(ExtractError, match=f"^--output {out.dir} already holds 2 specforge sample files; pass "
                                           "--resume"):
        continue_requests(out, sink)
    write_manifest(out.dir, MANIFEST, SimpleNamespace(data=None, from_dump=None, save_dtype="bf16", shard="0/1",
                                                      regenerate=False), Stats(), sink, "interrupted")
    state = continue_requests(_output(tmp_path, resume=True), sink)
    assert state.files == 2 and state.done(1) and not state.done(5)
    assert "removed 1 partial file(s) an interrupted run left" in capsys.readouterr().err
    st = SINKS["safetensors"](out.dir)  # the same folder, read as another run with no --save-dtype
    _files(_output(tmp_path, save_dtype=None, fmt="safetensors"), 0)
    with pytest.raises(ExtractError, match="^--save-dtype: --output .* holds files of a run with --save-dtype bf16; "
                                           "resume it with the same \\(this run has no --save-dtype\\)$"):
        continue_requests(_output(tmp_path, resume=True, save_dtype=None, fmt="safetensors"), st)


def test_manifest_json_is_read_back_as_written(tmp_path):
    out = _output(tmp_path)
    assert previous(out.dir) is None
    sink = _files(out)
    write_manifest(out.dir, MANIFEST, SimpleNamespace(data="d.jsonl", from_dump=None, save_dtype="bf16", shard="1/2",
                                                      regenerate=True), Stats(), sink, "complete")
    m = previous(out.dir)
    assert m == json.load(open(os.path.join(out.dir, "manifest.json")))
    assert (m["status"], m["save_dtype"], m["shard"], m["regenerate"], m["format"]) == (
        "complete", "bf16", "1/2", True, "specforge")


def test_a_harvest_continues_its_own_journal_and_refuses_other_files(tmp_path):
    out = _output(tmp_path)
    sink = SINKS[out.format](out.dir, out.save_dtype)
    journal = continue_harvest(out, sink)
    with pytest.raises(ExtractError, match="is being harvested into by another harvester"):
        continue_harvest(out, sink)  # the lock: one harvester per --output
    journal.check_setup(setup_of(out, MANIFEST), out.dir)
    journal.add_file({"index": 0, "rid": "r"})
    journal.close()
    _files(out, 0)
    again = continue_harvest(out, sink)  # its own files: the journal says which record each holds
    assert again.files == {0: {"index": 0, "rid": "r"}} and again.setup["layer_ids"] == [1, 2]
    again.close()
    os.remove(os.path.join(out.dir, JOURNAL))
    with pytest.raises(ExtractError, match="already holds 1 specforge sample files of another run \\(no harvest "
                                           "journal\\)"):
        continue_harvest(out, sink)


def test_a_journal_without_its_setup_line_takes_the_setup_from_the_last_manifest(tmp_path):
    out = _output(tmp_path)
    sink = _files(out)
    write_manifest(out.dir, MANIFEST, SimpleNamespace(data=None, from_dump="/d", save_dtype="bf16", shard="0/1",
                                                      regenerate=False), Stats(), sink, "complete")
    journal = Journal(out.dir)
    with pytest.raises(ExtractError, match="layer_ids \\[1, 2\\] there, \\[1, 3\\] now"):
        journal.check_setup(setup_of(out, dict(MANIFEST, layer_ids=[1, 3])), out.dir)
    journal.close()
