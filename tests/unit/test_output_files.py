"""The extraction CLI's and the harvester's output files get the dump dir's care (issue 31, item 7): private
by default (files 0600, folders 0700), of --output-group when asked (0640 / 0750); another user's --output
folder and a symlinked harvest journal are refused in one line naming the path."""
import json
import os
import stat
import types

import pytest
import torch

from sglang_hs.extract import cli, harvest, output
from sglang_hs.extract.sinks import DeepSpecSink, SafetensorsSink, SpecForgeSink

MANIFEST = {"model_path": "m", "architecture": "DeepseekV3ForCausalLM", "dtype": "bfloat16", "hidden_size": 8,
            "num_hidden_layers": 4, "layer_ids": [1, 2], "last": True, "hf_output_hidden_states_index": [1, 2, 4],
            "convention": "hf"}


def _modes(top):
    """{relative path: (mode, gid)} of every folder and file under `top` (links: the link's target file)."""
    out = {".": (stat.S_IMODE(os.stat(top).st_mode), os.stat(top).st_gid)}
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.stat(p)
            out[os.path.relpath(p, top)] = (stat.S_IMODE(st.st_mode), st.st_gid)
    return out


def _write_everything(out, gid):
    """What a run leaves in --output: sample files of every format, DeepSpec's target cache, speculators' dataset, the journal and
    the manifest, made by the CLI's own code."""
    ns = cli.build_parser().parse_args(["--output", out, "--data", "x", "--format", "safetensors"])
    ns.output_gid = gid
    output.prepare_output(out, gid)
    rows = torch.randn(5, 3, 8, dtype=torch.bfloat16)
    output.prepare_output(os.path.join(out, "sf"), gid)
    output.prepare_output(os.path.join(out, "ds"), gid)
    ds = DeepSpecSink(os.path.join(out, "ds"))
    for sink in (SafetensorsSink(out), SpecForgeSink(os.path.join(out, "sf")), ds):
        sink.share_gid = gid
        sink.layer_ids = [1, 2]
        for i in range(2):
            sink.write(i, torch.arange(5), torch.ones(5), rows[:, :2], rows[:, 2])
    st = SafetensorsSink(out)
    st.share_gid = gid
    assert st.finalize() == {"rows": 2} and ds.finalize() == {"rows": 2}  # DeepSpec's target cache
    journal = harvest.Journal(out, gid)
    journal.add_file({"index": 0, "rid": "r"})
    journal.close()
    output.write_manifest(out, MANIFEST, ns, output.Stats(), st, "complete", {"rows": 2})


@pytest.mark.parametrize("shared", [False, True])
def test_every_output_file_is_private_or_of_the_group(tmp_path, shared):
    gid = os.getegid() if shared else None
    if shared and os.geteuid() == 0:
        gid = 4343  # root may give files to any group: one it is not in shows the group is set, not inherited
    out = str(tmp_path / "out")
    _write_everything(out, gid)
    modes = _modes(out)
    for must in ("hs_0.safetensors", "sf/rows_0-2000/data_1.ckpt", "hidden_states/hs_1.safetensors", "state.json",
                 "dataset_info.json", "harvest.jsonl", "manifest.json", "ds/sample_1.bin", "ds/target_cache",
                 "ds/target_cache/samples.idx", "ds/target_cache/manifest.json", "ds/target_cache/shard-00001.bin"):
        assert must in modes, sorted(modes)
    wrong = {p: (f"{m:04o}", g) for p, (m, g) in modes.items()
             if m != ((0o750 if os.path.isdir(os.path.join(out, p)) else 0o640) if shared
                      else (0o700 if os.path.isdir(os.path.join(out, p)) else 0o600))
             or (shared and g != gid)}
    assert not wrong, wrong


def test_an_existing_journal_of_an_older_version_becomes_private(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "harvest.jsonl").write_text("")
    os.chmod(out / "harvest.jsonl", 0o644)
    harvest.Journal(str(out)).close()  # an empty journal is removed at close: look while it is open
    (out / "harvest.jsonl").write_text('{"ring": "a", "number": 0}\n')
    os.chmod(out / "harvest.jsonl", 0o644)
    j = harvest.Journal(str(out))
    assert stat.S_IMODE(os.stat(out / "harvest.jsonl").st_mode) == 0o600 and j.rings == {"a": 0}
    j.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
@pytest.mark.parametrize("args", [["--format", "safetensors", "--finalize"],
                                  ["--from-dump", "/nonexistent-dump"],
                                  ["--data", __file__, "--server", "http://127.0.0.1:9",
                                   "--hs-dump-dir", "/nonexistent-dump"]])
def test_an_output_folder_of_another_user_is_refused(tmp_path, capsys, args):
    """Someone else made the folder first (a world-writable tmpfs lets anyone): nothing is written into it."""
    os.chmod(tmp_path, 0o777)
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 65534, 65534)
    os.chmod(out, 0o777)
    rc = cli.main(["--output", str(out), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"python -m sglang_hs.extract: error: --output {out}: owned by uid 65534, not by this user"
    assert os.listdir(out) == []


def test_a_symlinked_output_folder_is_refused(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "out")
    rc = cli.main(["--output", str(tmp_path / "out"), "--format", "safetensors", "--finalize"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"python -m sglang_hs.extract: error: --output {tmp_path / 'out'}: is a symlink; "
                               "give the real folder")


def test_a_symlinked_journal_is_refused_and_its_target_untouched(tmp_path, capsys):
    """harvest.jsonl a symlink (to a file the harvester's user may write): refused before anything is written
    through it, in one line naming it."""
    out, target = tmp_path / "out", tmp_path / "precious"
    out.mkdir(mode=0o700)
    target.write_text("keep\n")
    os.symlink(target, out / "harvest.jsonl")
    rc = cli.main(["--from-dump", str(tmp_path / "no-dump"), "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"python -m sglang_hs.extract: error: {out / 'harvest.jsonl'}: cannot open the harvest "
                               "journal (a symlink: refusing to follow it)")
    assert target.read_text() == "keep\n" and stat.S_IMODE(os.stat(target).st_mode) != 0o600


def test_an_output_group_that_does_not_exist_is_one_line(capsys):
    rc = cli.main(["--output", "/tmp/x", "--data", "d", "--output-group", "no-such-group-hs"])
    assert rc == 2 and capsys.readouterr().err.strip() == ("python -m sglang_hs.extract: error: --output-group "
                                                           "no-such-group-hs: no such group")


def test_the_manifest_is_written_private(tmp_path):
    out = str(tmp_path / "o")
    output.prepare_output(out, None)
    ns = types.SimpleNamespace(data=None, from_dump=None, save_dtype=None, shard="0/1", regenerate=False)
    output.write_manifest(out, MANIFEST, ns, output.Stats(), SpecForgeSink(out), "complete")
    assert stat.S_IMODE(os.stat(os.path.join(out, "manifest.json")).st_mode) == 0o600
    assert json.load(open(os.path.join(out, "manifest.json")))["status"] == "complete"
