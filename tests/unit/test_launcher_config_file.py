"""The launcher reads SGLang's --config YAML as SGLang does (ConfigArgumentMerger: the file's settings first, the
command line's winning), so what it checks and sets up (the model, the speculative refusals, the patch settings) is
the server SGLang will run, and SGLang gets the merged command line."""
import json
import os

import pytest

from sglang_hs.server.capture_spec import CaptureConfigError
from sglang_hs.tools import launch_server
from sglang_hs.tools.argv import flag_value


def _model(tmp_path, arch="DeepseekV3ForCausalLM") -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "num_hidden_layers": 8, "hidden_size": 64}))
    return str(d)


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    return str(path)


def test_a_speculative_setting_in_the_config_file_is_refused_at_launch(tmp_path, clean_env):
    config = _config(tmp_path, f"model-path: {_model(tmp_path)}\nspeculative-algorithm: DSPARK\n"
                               "speculative-draft-model-path: /draft\n")
    with pytest.raises(CaptureConfigError, match=r"^--speculative-algorithm DSPARK with DeepseekV3ForCausalLM: capture "
                                                 r"under speculative decoding is served for DeepSeek-V4's DSpark draft "
                                                 r"only") as e:
        launch_server.prepare(["--config", config, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs")])
    assert "\n" not in str(e.value)


def test_the_config_files_model_and_settings_are_the_servers(tmp_path, clean_env):
    model = _model(tmp_path)
    config = _config(tmp_path, f"model-path: {model}\nspeculative-algorithm: NGRAM\ntp-size: 2\n"
                               "attn-dp-size: 2\nmax-total-tokens: 2048\n")
    argv, _ = launch_server.prepare(["--config", config, "--device", "cpu"])
    assert "--config" not in argv and flag_value(argv, "--model-path") == model  # not the embedded tiny model
    assert flag_value(argv, "--max-total-tokens") == "2048"  # the file's, not the CPU default
    assert os.environ["SGLANG_HS_SPECULATIVE_ALGORITHM"] == "NGRAM" and os.environ["SGLANG_HS_DP_CONTROLLER"] == "1"


def test_the_command_line_wins_over_the_config_file(tmp_path, clean_env):
    config = _config(tmp_path, f"model-path: {_model(tmp_path)}\ndp-size: 2\n")
    argv, _ = launch_server.prepare(["--config", config, "--device", "cpu", "--dp-size", "1"])
    assert flag_value(argv, "--dp-size") == "1" and "SGLANG_HS_DP_CONTROLLER" not in os.environ


@pytest.mark.parametrize("text, why", [("hs-dump-dir: /dev/shm/hs\n", "--hs-dump-dir is an sglang-hs flag"),
                                       ("- not a mapping\n", "must contain a dictionary")])
def test_a_config_file_it_cannot_take_in_one_line(tmp_path, clean_env, text, why):
    with pytest.raises(CaptureConfigError, match="^--config: ") as e:
        launch_server.prepare(["--config", _config(tmp_path, text), "--device", "cpu"])
    assert why in str(e.value) and "\n" not in str(e.value)


def test_flag_value_takes_the_last_as_argparse_does():
    assert flag_value(["--tp", "2", "--tp-size=4"], "--tp-size", "--tp") == "4"
    assert flag_value(["--tp", "2"], "--dp") is None
