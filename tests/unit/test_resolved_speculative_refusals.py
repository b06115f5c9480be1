"""The speculative refusals hold on SGLang's resolved arguments (serve.check_server_args), not only on the launcher's
reading of the command line: a setting given through SGLang's --config YAML, or left to SGLang's defaults, reaches
the server without the launcher seeing it."""
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from sglang_hs.server.capture_spec import CaptureConfigError
from sglang_hs.server.serve import check_server_args

V4 = "DeepseekV4ForCausalLM"
V32 = "DeepseekV32ForCausalLM"
V3 = "DeepseekV3ForCausalLM"
CHAIN = dict(speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)


def _model(tmp_path, arch: str) -> str:
    path = tmp_path / arch
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(path)


def _resolved(model: str, algorithm: str, **fields) -> SimpleNamespace:
    """What SGLang's resolving view holds for a one-rank CPU server of `model` (the fields check_server_args reads)."""
    base = dict(model_path=model, device="cpu", speculative_algorithm=algorithm, speculative_draft_model_path=None,
                tp_size=1, dp_size=1, attn_dp_size=1, speculative_adaptive=False, enable_multi_layer_eagle=False)
    return SimpleNamespace(**dict(base, **fields))


@pytest.fixture
def capturing(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(tmp_path / "hs"))
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)


def _refusal(cfg) -> str:
    with pytest.raises(CaptureConfigError) as e:
        check_server_args(cfg)
    message = str(e.value)
    print(message)
    assert "\n" not in message and message.startswith("unsupported with --hs-dump-dir: --speculative-algorithm ")
    return message


def test_served_settings_pass(tmp_path, capturing):
    v4, v32, v3 = (_model(tmp_path, arch) for arch in (V4, V32, V3))
    draft = _model(tmp_path, "draft")
    for cfg in (_resolved(v3, "EAGLE3"), _resolved(v3, "NGRAM"),
                _resolved(v3, "EAGLE", speculative_draft_model_path=v3),
                _resolved(v32, "EAGLE", speculative_draft_model_path=v32, tp_size=2, **CHAIN),
                _resolved(v32, "EAGLE", speculative_draft_model_path=v32, tp_size=2, speculative_num_steps=3,
                          speculative_eagle_topk=1, speculative_num_draft_tokens=4),
                _resolved(v4, "EAGLE", speculative_draft_model_path=v4, speculative_num_steps=3,
                          speculative_eagle_topk=1, speculative_num_draft_tokens=4),
                _resolved(v4, "DSPARK", speculative_draft_model_path=draft)):
        check_server_args(cfg)


@pytest.mark.parametrize("arch, algorithm, fields, why", [
    (V3, "DSPARK", {}, "is served for DeepSeek-V4's DSpark draft only"),
    (V32, "DSPARK", {}, "is served for DeepSeek-V4's DSpark draft only"),
    (V4, "EAGLE", dict(CHAIN, device="cuda"), "is not served on a GPU"),
    (V32, "EAGLE", dict(CHAIN, speculative_adaptive=True), "is not served with --speculative-adaptive"),
    (V4, "EAGLE", dict(CHAIN, enable_multi_layer_eagle=True), "is not served with --enable-multi-layer-eagle"),
    (V32, "EAGLE", dict(CHAIN, dp_size=2, attn_dp_size=2), "served without data parallelism only"),
    (V32, "EAGLE", dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4),
     "drafting a chain only"),
    (V4, "EAGLE", dict(CHAIN, tp_size=2), "served on one rank only"),
    (V4, "EAGLE", dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=3),
     "drafting a chain only"),
    (V4, "DSPARK", dict(tp_size=2, speculative_draft_model_path="/draft"), "served on one rank only"),
    (V4, "DSPARK", {}, "needs a draft checkpoint of its own"),
    (V4, "DSPARK", dict(speculative_draft_model_path="<model>"), "bundled in the target's checkpoint"),
    (V4, "DSPARK", dict(speculative_draft_model_path="<model>/dspark"), "bundled in the target's checkpoint"),
])
def test_refused_on_the_resolved_arguments(tmp_path, capturing, arch, algorithm, fields, why):
    """Each architecture-specific speculative refusal of the launcher, from the resolved fields alone."""
    model = _model(tmp_path, arch)
    fields = {k: v.replace("<model>", model) if isinstance(v, str) else v for k, v in fields.items()}
    assert why in _refusal(_resolved(model, algorithm, **fields))


def test_nothing_refused_without_capture(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HS_DUMP_DIR", raising=False)
    check_server_args(_resolved(_model(tmp_path, V3), "DSPARK"))


RESOLVE_FROM_CONFIG_FILE = textwrap.dedent("""
    import os, sys
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang_hs.server.cpu import stubs_dir
    sys.path.insert(0, stubs_dir())
    from sglang_hs.server.patches import dsa_cpu_server_args
    from sglang_hs.server.serve import check_server_args
    from sglang_hs.tools import tiny_model
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    dsa_cpu_server_args.apply()
    server_args = prepare_server_args(["--model-path", tiny_model.ensure("v32-mtp"), "--device", "cpu",
                                       "--max-total-tokens", "4096", "--config", sys.argv[1]])
    server_args.resolve_once()
    check_server_args(resolving_view(server_args))
""")


def test_a_setting_given_through_sglangs_config_file_is_refused(tmp_path):
    """DeepSeek-V3.2 with a 3-step MTP tree (top-k 2), given in a --config YAML the launcher never reads: SGLang's real
    resolution (in a child process: the DSA CPU resolution patch stays out of this one), then check_server_args."""
    config = tmp_path / "server.yaml"
    config.write_text("speculative-algorithm: EAGLE\nspeculative-num-steps: 3\nspeculative-eagle-topk: 2\n"
                      "speculative-num-draft-tokens: 4\n")
    env = dict(os.environ, SGLANG_HS_DUMP_DIR=str(tmp_path / "hs"))
    done = subprocess.run([sys.executable, "-c", RESOLVE_FROM_CONFIG_FILE, str(config)], env=env,
                          capture_output=True, text=True, timeout=300)
    print(done.stderr[-2000:])
    assert done.returncode != 0, "a DSA draft tree from --config was let through"
    assert ("CaptureConfigError: unsupported with --hs-dump-dir: --speculative-algorithm EAGLE with "
            f"{V32}: capture under speculative decoding with DSA's sparse attention is served for the model's MTP "
            "draft drafting a chain only") in done.stderr
