"""The patch registry (sglang_hs/server/patches) applies dsv4_cpu_dspark and dp_controller_idle_wait exactly where
the server needs them, as the launcher's settings say (envs.py SGLANG_HS_SPECULATIVE_ALGORITHM,
SGLANG_HS_DP_CONTROLLER): each patch module is a stand-in that counts its apply() calls, so nothing of SGLang is
patched here."""
import sys
import types

import pytest

from sglang_hs.server import patches
from sglang_hs.tools import launch_server

SPAWNED = ("cpu_gloo_groups", "dsv4_cpu_tp", "dp_controller_idle_wait")


@pytest.fixture
def calls(monkeypatch):
    """{patch name: apply() calls} of stand-in patch modules, a fresh registry, CPU mode, no settings."""
    counted = {}
    for name in set(patches.CPU_PATCHES) | set(SPAWNED):
        def apply(name=name):
            counted[name] = counted.get(name, 0) + 1
            return name
        monkeypatch.setitem(sys.modules, f"sglang_hs.server.patches.{name}", types.SimpleNamespace(apply=apply))
    monkeypatch.setattr(patches, "_applied", {})
    monkeypatch.setenv("SGLANG_HS_CPU_MODE", "1")
    for key in ("SGLANG_HS_SPECULATIVE_ALGORITHM", "SGLANG_HS_DP_CONTROLLER", "SGLANG_HS_DISABLE_PATCHES",
                "SGLANG_HS_DUMP_DIR"):
        monkeypatch.delenv(key, raising=False)
    return counted


def _applied_everywhere() -> set:
    patches.apply()
    patches.apply_spawned()
    return set(patches._applied)


def test_neither_without_its_setting(calls):
    applied = _applied_everywhere()
    assert "dsv4_cpu_dspark" not in applied and "dp_controller_idle_wait" not in applied, applied
    assert {"cpu_gloo_groups", "dsv4_cpu_tp", "dsv4_torch_native", "mla_torch_native"} <= applied


@pytest.mark.parametrize("algorithm, applied", [("DSPARK", True), ("dspark", True), ("EAGLE", False),
                                                ("NGRAM", False)])
def test_dsv4_cpu_dspark_only_on_a_dspark_server(calls, monkeypatch, algorithm, applied):
    monkeypatch.setenv("SGLANG_HS_SPECULATIVE_ALGORITHM", algorithm)
    assert ("dsv4_cpu_dspark" in _applied_everywhere()) is applied
    assert "dp_controller_idle_wait" not in patches._applied


def test_dp_controller_idle_wait_only_with_a_dp_controller(calls, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DP_CONTROLLER", "1")
    patches.apply()
    assert "dp_controller_idle_wait" not in patches._applied  # the DP controller is a spawned process
    patches.apply_spawned()
    assert "dp_controller_idle_wait" in patches._applied and "dsv4_cpu_dspark" not in patches._applied


def test_once_each_and_disable_still_wins(calls, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_SPECULATIVE_ALGORITHM", "DSPARK")
    monkeypatch.setenv("SGLANG_HS_DP_CONTROLLER", "1")
    for _ in range(3):
        _applied_everywhere()
    assert calls["dsv4_cpu_dspark"] == 1 and calls["dp_controller_idle_wait"] == 1, calls
    monkeypatch.setattr(patches, "_applied", {})
    monkeypatch.setenv("SGLANG_HS_DISABLE_PATCHES", "dsv4_cpu_dspark,dp_controller_idle_wait")
    applied = _applied_everywhere()
    assert "dsv4_cpu_dspark" not in applied and "dp_controller_idle_wait" not in applied, applied


def test_none_outside_cpu_mode(calls, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_SPECULATIVE_ALGORITHM", "DSPARK")
    monkeypatch.setenv("SGLANG_HS_DP_CONTROLLER", "1")
    monkeypatch.delenv("SGLANG_HS_CPU_MODE")
    assert _applied_everywhere() == set()


@pytest.mark.parametrize("argv, settings", [
    ([], {}),
    (["--speculative-algorithm", "dspark", "--speculative-draft-model-path", "/d"],
     {"SGLANG_HS_SPECULATIVE_ALGORITHM": "DSPARK"}),
    (["--speculative-algorithm=EAGLE"], {"SGLANG_HS_SPECULATIVE_ALGORITHM": "EAGLE"}),
    (["--tp", "2"], {}),
    (["--dp-size", "2"], {"SGLANG_HS_DP_CONTROLLER": "1"}),
    (["--tp", "2", "--dp", "2", "--enable-dp-attention"], {"SGLANG_HS_DP_CONTROLLER": "1"}),
    (["--tp", "2", "--attn-dp-size", "2"], {"SGLANG_HS_DP_CONTROLLER": "1"}),
    # an elastic-EP scale joiner runs SGLang's DP controller at DP 1 (engine.py use_dp_controller); recover does not
    (["--tp", "2", "--elastic-ep-backend", "mooncake", "--elastic-ep-join-mode", "scale", "--node-rank", "1",
      "--elastic-ep-join-rank-offset", "2"], {"SGLANG_HS_DP_CONTROLLER": "1"}),
    (["--tp", "2", "--elastic-ep-backend", "mooncake", "--elastic-ep-join-mode=scale"], {"SGLANG_HS_DP_CONTROLLER": "1"}),
    (["--tp", "2", "--elastic-ep-backend", "mooncake", "--elastic-ep-join-mode", "recover"], {}),
])
def test_the_launcher_sets_them_from_the_command_line(argv, settings):
    assert launch_server.patch_settings(argv) == settings


def test_prepare_puts_them_in_the_servers_environment(tmp_path, clean_env):
    """prepare() writes what the server needs and drops a value inherited from an earlier launch."""
    import json
    import os

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"],
                                                   "num_hidden_layers": 4, "hidden_size": 64}))
    os.environ["SGLANG_HS_SPECULATIVE_ALGORITHM"] = "DSPARK"
    launch_server.prepare(["--model-path", str(model), "--device", "cpu", "--dp-size", "2"])
    assert os.environ.get("SGLANG_HS_DP_CONTROLLER") == "1" and "SGLANG_HS_SPECULATIVE_ALGORITHM" not in os.environ
