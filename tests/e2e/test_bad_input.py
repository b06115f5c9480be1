"""Bad input: one-line error naming the flag or architecture, non-zero exit, nothing left running."""
import json
import uuid

import pytest

from helpers import error_lines, leftover_server_processes, processes_matching, run_launcher

pytestmark = pytest.mark.e2e


def _assert_refused(r, message, marker):
    out = r.stdout + r.stderr  # the server's own output is relayed on stdout
    errors = error_lines(out)
    assert r.returncode == 2, out[-2000:]
    assert len(errors) == 1 and message in errors[0], out[-2000:]
    assert not processes_matching(marker)
    assert not leftover_server_processes(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hs-bogus", "1"], "unknown sglang-hs flag --hs-bogus"),
        (["--hs-layers", "2,x"], "--hs-layers: 'x' is not an integer"),
        (["--hs-layers", "2,8"], "--hs-layers: id 8 is out of range for a model with 8 layers"),
        (["--hs-layers", "5,2"], "did you mean --hs-layers 2,5?"),
        (["--hs-ring-size", "lots"], "--hs-ring-size: 'lots' is not a size"),
        (["--hs-ring-size", "1MiB"], "cannot hold one record at the server's maximal context length (4096 tokens"),
        (["--hs-ring-size", "100TiB"], "102400.00GiB does not fit the"),
        (["--hs-admission-timeout", "-5"], "--hs-admission-timeout: must be >= 0"),
    ],
)
def test_refused_before_anything_starts(tmp_path, args, message):
    marker = f"hs-{uuid.uuid4().hex[:8]}"
    r = run_launcher(["--hs-dump-dir", str(tmp_path / marker), *args], timeout=120)
    _assert_refused(r, message, marker)


def test_unsupported_architecture(tmp_path):
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 8,
                                                   "hidden_size": 64}))
    r = run_launcher(["--model-path", str(model), "--hs-dump-dir", str(tmp_path / "hs")], timeout=120)
    _assert_refused(r, "unsupported architecture 'Qwen3ForCausalLM'", str(model))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pp-size", "2"], "--pp-size > 1"),
        (["--speculative-algorithm", "STANDALONE"], "--speculative-algorithm STANDALONE"),
    ],
)
def test_unsupported_combinations(tmp_path, args, message):
    """Checked on SGLang's own resolved arguments, in the server process, before any model loads. Two flags
    here, each a launcher run up to that check (~15 s); every refused flag's message is checked on SGLang's
    own resolution in-process (tests/unit/test_server_arg_refusals.py), and test_kv_load_back_refused is a
    third launcher run."""
    marker = f"hs-{uuid.uuid4().hex[:8]}"
    r = run_launcher(["--hs-dump-dir", str(tmp_path / marker), *args], timeout=300)
    _assert_refused(r, f"unsupported with --hs-dump-dir: {message}", marker)


def test_kv_load_back_refused(tmp_path):
    """A feature that puts KV into a slot without a forward pass (here HiCache's load-back from host
    memory) is refused by the real launcher before any model loads; every such flag is covered in
    tests/unit/test_server_arg_refusals.py."""
    marker = f"hs-{uuid.uuid4().hex[:8]}"
    r = run_launcher(["--hs-dump-dir", str(tmp_path / marker), "--enable-hierarchical-cache"], timeout=300)
    _assert_refused(r, "unsupported with --hs-dump-dir: --enable-hierarchical-cache", marker)
