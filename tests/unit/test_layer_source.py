"""Layer ids from the checkpoint (issue 46, item 4; sglang_hs/server/layer_source.py): with no --hs-layers, the ids a
draft's or the target's config names for its drafter, translated to our convention the way SGLang 0.5.23 captures
them (its own set_*_layers_to_capture methods are the reference here), printed at start-up and kept in the
manifest."""
import argparse
import json
import os
import types

import pytest

from sglang_hs.extract.manifest import draft_config
from sglang_hs.server import layer_source
from sglang_hs.server.capture_spec import (CaptureConfigError, CaptureSpec, dspark_layer_ids, from_dspark_ids,
                                           from_eagle3_ids, v4_dspark_ids)
from sglang_hs.tools import launch_server


@pytest.fixture(scope="module")
def sglang_v2(overlay_module):
    """SGLang's DeepseekV2ForCausalLM, imported as the CPU engine does (overlay_module)."""
    import sys

    return sys.modules["sglang.srt.models.deepseek_v2"].DeepseekV2ForCausalLM


def _sglang_captures(cls, method, ids):
    """The ids SGLang's own `method` sets on the model (a stand-in self: its last pipeline rank, a bare model)."""
    me = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace(),
                               config=types.SimpleNamespace(num_hidden_layers=61))
    getattr(cls, method)(me, list(ids))
    return me.model


@pytest.mark.parametrize("ids", [[1, 29, 57], [2, 30, 58], [0, 5], [3], [1]])
def test_eagle3_ids_are_what_sglang_captures(ids, sglang_v2):
    """Our ids for an EAGLE-3 draft's eagle_aux_hidden_state_layer_ids are SGLang's layers_to_capture (the state
    entering layer i, its capture in DeepseekV2Model.forward), and the extraction's draft config maps them back."""
    ours = from_eagle3_ids(ids)
    assert ours == _sglang_captures(sglang_v2, "set_eagle3_layers_to_capture", ids).layers_to_capture
    back = draft_config({"layer_ids": ours, "hidden_size": 8})["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert back is None or from_eagle3_ids(back) == ours


@pytest.mark.parametrize("ids", [[40, 41, 42], [0, 7], [5]])
def test_dspark_ids_are_what_sglang_captures(ids, sglang_v2):
    """DFlash/DSpark target ids (layer j's output) on a V2/V3 target: SGLang's set_dflash_layers_to_capture gives
    layers_to_capture j + 1; on V4 its standard path captures after layer j (our j + 1), its
    hc_pre_from_prev_sublayer path before layer j (our j). Both are dspark_layer_ids' inverse."""
    assert from_dspark_ids(ids) == _sglang_captures(sglang_v2, "set_dflash_layers_to_capture", ids).layers_to_capture
    assert dspark_layer_ids(from_dspark_ids(ids)) == ids
    assert from_dspark_ids(ids, True) == ids and dspark_layer_ids(ids, True) == ids


def test_v4_flash_dspark_ids_capture_the_last_layer_output():
    """DeepSeek-V4-Flash-DSpark (43 layers) names [40, 41, 42]: our ids 41, 42, 43, id 43 = n the streams leaving the
    last layer (hc_head's input), which hyper-connection models accept and others refuse; SGLang is handed the
    checkpoint's own ids back, and the lagged path refuses id n."""
    found = layer_source.checkpoint_layers({"dspark_target_layer_ids": [40, 41, 42]}, "v4/config.json")
    assert found == {"from": "v4/config.json", "key": "dspark_target_layer_ids", "ids": [40, 41, 42],
                     "layers": [41, 42, 43], "rule": layer_source.DSPARK_RULE}
    spec = CaptureSpec.resolve(found["layers"], "both", 43, 4096, hc_mult=4, source=found)
    d = spec.describe()
    assert d["layer_ids"] == [41, 42, 43] and d["hf_output_hidden_states_index"] == [41, 42, None, 43]
    assert d["layer_source"] == found and d["dspark_layer_ids"] == [40, 41, 42]
    assert v4_dspark_ids(spec) == [40, 41, 42]
    with pytest.raises(CaptureConfigError, match="id 43 .*hc_pre_from_prev_sublayer"):
        v4_dspark_ids(spec, hc_pre_from_prev_sublayer=True)
    with pytest.raises(CaptureConfigError, match="id 43 is out of range.*0 <= i < 43"):
        CaptureSpec.resolve([41, 42, 43], None, 43, 4096)  # one residual stream: the last output is --hs-last pre-norm
    with pytest.raises(CaptureConfigError, match="id 44 is out of range.*id 43 the streams leaving the last layer"):
        CaptureSpec.resolve([44], None, 43, 4096, hc_mult=4)


def test_the_draft_wins_and_every_key_is_read():
    target = {"dspark_target_layer_ids": [1, 2]}
    draft = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}
    assert layer_source.checkpoint_layers(target, "t", draft, "d")["layers"] == [2, 6, 10]
    assert layer_source.checkpoint_layers(target, "t", {"unrelated": 1}, "d")["from"] == "t"
    for config, ours in (({"dflash_config": {"target_layer_ids": [3, 4]}}, [4, 5]),
                         ({"target_layer_ids": [3, 4]}, [4, 5]),
                         ({"dspark_target_layer_ids": [9, 3], "dflash_config": {"target_layer_ids": [1]}}, [4, 10]),
                         ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4]}}, [2, 4])):
        assert layer_source.checkpoint_layers({}, "t", config, "d")["layers"] == ours
    # keys SGLang does not read a drafter's target layers from: not taken
    for config in ({"dspark_config": {"target_layer_ids": [3, 4]}}, {"eagle_aux_hidden_state_layer_ids": [2, 4]},
                   {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4], "use_aux_hidden_state": False}}):
        assert layer_source.checkpoint_layers(config, "t") is None, config
    lagged = layer_source.checkpoint_layers({"hc_pre_from_prev_sublayer": True, "dspark_target_layer_ids": [3, 4]}, "t")
    assert lagged["layers"] == [3, 4] and lagged["rule"] == layer_source.DSPARK_LAGGED_RULE
    assert layer_source.checkpoint_layers({"num_hidden_layers": 8}, "t") is None


@pytest.mark.parametrize("config", [{"dspark_target_layer_ids": [40, 41, 42]},
                                    {"dflash_config": {"target_layer_ids": [1, 20]}},
                                    {"target_layer_ids": [5, 6]},
                                    {"dspark_target_layer_ids": [7], "dflash_config": {"target_layer_ids": [1, 2]}},
                                    {"dspark_config": {"target_layer_ids": [3, 4]}}])
def test_the_dspark_and_dflash_keys_are_the_ones_sglang_parses(config, sglang_v2):
    """The ids layer_source takes from a DSpark/DFlash config are the ones SGLang's own parsers give
    (parse_dspark_draft_config, parse_dflash_draft_config; None where they find none, as for dspark_config's)."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

    found = layer_source.ids_in_config(config)
    taken = found[1] if found else None
    assert parse_dspark_draft_config(draft_hf_config=config).target_layer_ids == taken
    if "dspark_target_layer_ids" not in config:
        assert parse_dflash_draft_config(draft_hf_config=config).target_layer_ids == taken


@pytest.mark.parametrize("bad", [[], "1,2", [1, "2"], [True, 2], 3])
def test_a_malformed_list_is_refused_naming_the_key(bad):
    with pytest.raises(CaptureConfigError, match=r"^dspark_target_layer_ids in t: a non-empty list of integer layer ids"):
        layer_source.checkpoint_layers({"dspark_target_layer_ids": bad}, "t")


def _model(tmp_path, name="model", **config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 12,
                                               "hidden_size": 64, **config}))
    return str(d)


def _prepare(tmp_path, model, *extra):
    dump = tmp_path / f"hs{len(list(tmp_path.glob('hs*')))}"  # a dump dir stays locked by the process that took it
    launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(dump), *extra])
    return json.loads(os.environ["SGLANG_HS_LAYER_SOURCE"]), os.environ["SGLANG_HS_LAYERS"]


def test_the_launcher_takes_the_checkpoints_ids_says_so_and_passes_the_source(tmp_path, clean_env, capsys):
    model = _model(tmp_path, dspark_target_layer_ids=[3, 7, 10])
    source, layers = _prepare(tmp_path, model)
    assert layers == "4,8,11" and source["key"] == "dspark_target_layer_ids" and source["ids"] == [3, 7, 10]
    assert source["from"] == os.path.join(model, "config.json")
    said = capsys.readouterr().err
    assert f"layers from {model}/config.json dspark_target_layer_ids [3, 7, 10] -> our ids [4, 8, 11]" in said
    # --hs-layers wins; no ids anywhere: the default, said as such
    assert _prepare(tmp_path, model, "--hs-layers", "1,2") == ({"from": "--hs-layers"}, "1,2")
    source, layers = _prepare(tmp_path, _model(tmp_path, "plain"))
    assert layers == "2,6,9" and source["from"] == "default"


def test_the_launcher_reads_the_served_drafts_ids(tmp_path, clean_env):
    model = _model(tmp_path, dspark_target_layer_ids=[3, 7, 10])
    draft = _model(tmp_path, "draft", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 8]})
    source, layers = _prepare(tmp_path, model, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                              draft)
    assert layers == "2,6,9" and source["from"] == os.path.join(draft, "config.json")
    # a DSpark draft served beside the target (DSPARK): its own dspark_target_layer_ids, not the target's bundled ones
    dspark = _model(tmp_path, "dspark-draft", dspark_target_layer_ids=[2, 5, 9])
    ns = argparse.Namespace(hs_layers=None)
    raw = json.loads(open(os.path.join(model, "config.json")).read())
    found = launch_server.layers_source(ns, ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                                             dspark], model, raw, raw)
    assert found["layers"] == [3, 6, 10] and found["from"] == os.path.join(dspark, "config.json"), found
    # a draft path without speculative decoding, or of an algorithm whose draft picks no target layers: the target's
    assert _prepare(tmp_path, model, "--speculative-draft-model-path", draft)[1] == "4,8,11"
    assert _prepare(tmp_path, model, "--speculative-algorithm", "NGRAM", "--speculative-draft-model-path",
                    str(tmp_path / "nowhere"))[1] == "4,8,11"


def test_errors_of_other_flags_are_not_blamed_on_the_checkpoints_ids(tmp_path, clean_env):
    model = _model(tmp_path, dspark_target_layer_ids=[3, 7])
    with pytest.raises(CaptureConfigError, match=r"^--hs-hc-streams: only for models with hyper-connections"):
        _prepare(tmp_path, model, "--hs-hc-streams", "full")
    with pytest.raises(CaptureConfigError, match=r"^--hs-last: 'bogus' is not one of"):
        _prepare(tmp_path, model, "--hs-last", "bogus")


def test_ids_the_model_cannot_capture_are_refused_naming_the_file(tmp_path, clean_env):
    model = _model(tmp_path, dflash_config={"target_layer_ids": [3, 11]})  # 11: the last layer's output of 12
    with pytest.raises(CaptureConfigError, match=r"^dflash_config.target_layer_ids \[3, 11\] in .*model/config.json "
                                                 r"\(our ids \[4, 12\]\): id 12 is out of range.*pass --hs-layers$"):
        _prepare(tmp_path, model)
    with pytest.raises(CaptureConfigError, match=r"^--speculative-draft-model-path: cannot read .*nowhere.*config.json"):
        _prepare(tmp_path, model, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                 str(tmp_path / "nowhere"))
