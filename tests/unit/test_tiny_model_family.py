"""The other tiny shapes of the family (sglang_hs.tiny_model.VARIANTS): their configs, and checkpoints that
HF transformers reads as the intended in-tree class and that hold per-expert weights (SGLang's format)."""
import json
import os

import pytest

from sglang_hs import tiny_model


def test_v3_checkpoint_path_is_unchanged_by_variants():
    assert tiny_model.path("v3") == tiny_model.path() and tiny_model.variant_config("v3") == tiny_model.config()
    paths = {tiny_model.path(v) for v in tiny_model.VARIANTS}
    assert len(paths) == len(tiny_model.VARIANTS)


def test_v2_config_is_v2_lite_shaped():
    cfg = tiny_model.variant_config("v2")
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert cfg["q_lora_rank"] is None and cfg["topk_method"] == "greedy" and cfg["scoring_func"] == "softmax"
    assert cfg["n_group"] == cfg["topk_group"] == 1 and cfg["norm_topk_prob"] is False
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["mscale_all_dim"] == 0.707


def test_kimi_k2_config_has_kimi_specifics():
    cfg = tiny_model.variant_config("kimi-k2")
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_deepseek.DeepseekV3Config"
    assert cfg["n_group"] == cfg["topk_group"] == 1 and cfg["topk_method"] == "noaux_tc"
    assert cfg["routed_scaling_factor"] == 2.827 and cfg["rope_theta"] == 50000.0
    assert cfg["rope_scaling"]["beta_fast"] == cfg["rope_scaling"]["beta_slow"] == 1.0


@pytest.mark.parametrize("variant,cls", [("v2", "DeepseekV2Config"), ("kimi-k2", "DeepseekV3Config")])
def test_checkpoint_reads_as_in_tree_class_with_per_expert_weights(variant, cls):
    ckpt = tiny_model.ensure(variant)
    assert tiny_model.ensure(variant) == ckpt  # cached
    cfg = tiny_model.hf_config(ckpt, variant)
    assert type(cfg).__name__ == cls and cfg.num_hidden_layers == 8
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f) == tiny_model.variant_config(variant)  # as written, not as transformers rewrites it
    names = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names  # not fused: SGLang loads per expert
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in names) == (variant == "kimi-k2")
    assert ("model.layers.1.self_attn.q_proj.weight" in names) == (variant == "v2")  # no query LoRA in V2
