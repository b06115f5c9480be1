"""The other tiny shapes of the family (sglang_hs.tools.tiny_model.VARIANTS): their configs, and checkpoints that
HF transformers reads as the intended in-tree class and that hold per-expert weights (SGLang's format)."""
import json
import os

import pytest
import torch

from sglang_hs.tools import tiny_model


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


def test_v32_checkpoint_is_deepseek_v32_with_an_indexer_that_drops_keys():
    """DeepSeek-V3.2: read by HF as DeepseekV32Config, indexer weights on every layer, per-expert weights, and
    an index_topk below the e2e prompts' lengths (otherwise the sparse selection keeps every key)."""
    ckpt = tiny_model.ensure("v32")
    cfg = tiny_model.hf_config(ckpt, "v32")
    assert type(cfg).__name__ == "DeepseekV32Config" and cfg.architectures == ["DeepseekV32ForCausalLM"]
    assert cfg.index_topk == 11 and cfg.index_n_heads == 7 and cfg.n_group == 2
    assert cfg.index_head_dim == 128  # SGLang's DSA KV pool asserts it (memory_pool.py DSATokenToKVPool)
    names = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    for layer in range(cfg.num_hidden_layers):
        for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
            assert f"model.layers.{layer}.self_attn.indexer.{w}" in names
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names


def test_mistral_large_3_is_mistral_native_and_parsed_by_sglang_as_such():
    """params.json + consolidated.safetensors with Mistral names, in a folder SGLang's name heuristic
    sends to its Mistral config parser; the parsed config is the MistralLarge3 shape."""
    from sglang.srt.utils.hf_transformers.mistral_utils import MistralConfigParser, is_mistral_model

    ckpt = tiny_model.ensure("mistral-large-3")
    assert sorted(f for f in os.listdir(ckpt) if f.endswith((".json", ".safetensors"))) == [
        "consolidated.safetensors", "generation_config.json", "params.json", "tokenizer.json",
        "tokenizer_config.json"]
    assert is_mistral_model(ckpt)
    d, _ = MistralConfigParser().parse(ckpt)
    assert d["architectures"] == ["MistralLarge3ForCausalLM"] and d["model_type"] == "deepseek_v3"
    assert d["num_hidden_layers"] == 8 and d["n_group"] == d["topk_group"] == 1 and d["topk_method"] is None
    assert d["scoring_func"] == "softmax" and d["routed_scaling_factor"] == 1.5
    assert d["llama_4_scaling"] == {"original_max_position_embeddings": 16, "beta": 0.1}
    assert d["rope_scaling"]["rope_type"] == "deepseek_yarn"


def test_mistral_names_round_trip_and_match_upstream_remapping():
    """Our HF->Mistral names invert exactly, and SGLang's own remapping sends every Mistral name to the
    HF DeepSeek name it came from (experts per expert), with none skipped."""
    import re

    import torch
    from safetensors import safe_open
    from sglang.srt.models.mistral_large_3 import MistralLarge3ForCausalLM

    ckpt = tiny_model.ensure("mistral-large-3")
    with safe_open(os.path.join(ckpt, "consolidated.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "layers.1.experts.7.w3.weight" in names and "layers.0.feed_forward.w1.weight" in names
    assert not any(n.startswith("model.") for n in names)
    model = tiny_model.mistral_reference(ckpt)
    state = model.state_dict()
    back = tiny_model.from_mistral_names(tiny_model.to_mistral_names(state), 8)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    remapped = []
    for name in names:
        hits = [re.sub(k, v, name) for k, v in MistralLarge3ForCausalLM.remapping.items() if re.fullmatch(k, name)]
        assert hits, name
        remapped.append(hits[0])
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in remapped
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in remapped and "lm_head.weight" in remapped


def test_kimi_k25_is_a_wrapper_config_sglang_reads_without_remote_code():
    """KimiK25ForConditionalGeneration: SGLang's own KimiK25Config (no auto_map), the Kimi-K2 text shape in
    text_config, a tiny vision_config, and only "language_model."-prefixed (text) weights."""
    import transformers
    import sglang.srt.configs  # noqa: F401  (registers SGLang's KimiK25Config with transformers)

    cfg = tiny_model.variant_config("kimi-k25")
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and "auto_map" not in cfg
    assert cfg["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]  # upstream's wrapper reads it
    assert cfg["text_config"]["model_type"] == "kimi_k2" and cfg["vision_config"]["num_hidden_layers"] == 1
    ckpt = tiny_model.ensure("kimi-k25")
    loaded = transformers.AutoConfig.from_pretrained(ckpt)
    assert type(loaded.text_config).__name__ == "DeepseekV3Config" and loaded.text_config.num_hidden_layers == 8
    names = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    assert names and all(n.startswith("language_model.") for n in names)
    assert "language_model.model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert type(tiny_model.hf_config(ckpt, "kimi-k25")).__name__ == "DeepseekV3Config"


def _norm_weights(ckpt: str) -> dict:
    """Every norm weight of a generated checkpoint (HF or Mistral names), float32."""
    import glob

    from safetensors import safe_open

    out = {}
    for shard in glob.glob(os.path.join(ckpt, "*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    out[name] = f.get_tensor(name).float()
    return out


@pytest.mark.parametrize("variant", list(tiny_model.VARIANTS))
def test_every_norm_weight_is_drawn_not_one(variant):
    """HF initialises norm weights to one, where RMSNorm(RMSNorm(x)) == RMSNorm(x): a state normalised twice
    would pass every row judge. Every tiny checkpoint draws them from U(0.5, 1.5), per element, seeded."""
    ckpt = tiny_model.ensure(variant)
    norms = _norm_weights(ckpt)
    layers = tiny_model.hf_config(ckpt, variant).num_hidden_layers
    if variant in tiny_model.MTP:  # the MTP layer: hnorm and shared_head.norm ones by design, the rest drawn
        mtp = {k[len(f"model.layers.{layers}."):]: norms.pop(k) for k in list(norms)
               if k.startswith(f"model.layers.{layers}.")}
        assert all((mtp.pop(k) == 1).all() for k in ("hnorm.weight", "shared_head.norm.weight")), sorted(mtp)
        assert sorted(mtp) == ["enorm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                               *(["self_attn.indexer.k_norm.weight"] if variant == "v32-mtp" else []),
                               "self_attn.kv_a_layernorm.weight", "self_attn.q_a_layernorm.weight"]
        norms.update({f"mtp.{k}": w for k, w in mtp.items()})  # checked below with the others
    if variant in tiny_model.V4_MTP:  # the MTP layer: hnorm ones by design, its final norm the target's, the rest drawn
        mtp = {k[len("mtp.0."):]: norms.pop(k) for k in list(norms) if k.startswith("mtp.0.")}
        assert (mtp.pop("hnorm.weight") == 1).all() and torch.equal(mtp.pop("norm.weight"), norms["model.norm.weight"])
        assert sorted(mtp) == ["attn.kv_norm.weight", "attn.q_norm.weight", "attn_norm.weight", "enorm.weight",
                               "ffn_norm.weight"], sorted(mtp)
        norms.update({f"mtp.{k}": w for k, w in mtp.items()})  # checked below with the others
    # per layer: input, post-attention, query LoRA (none in V2) and kv LoRA norms (V3.2: and its DSA
    # indexer's key norm); and the final norm
    per_layer = {"v2": 3, "v32": 5, "v32-mtp": 5}.get(variant, 4)
    # DeepSeek-V4: a compressed layer's compressor has a norm, and a ratio-4 layer's indexer its own compressor's
    config = os.path.join(ckpt, "config.json")  # Mistral's native checkpoint has params.json instead
    ratios = json.load(open(config)).get("compress_ratios") or [] if os.path.exists(config) else []
    compressors = sum(1 for r in ratios if r) + sum(1 for r in ratios if r == 4)
    mtp_norms = 6 if variant == "v32-mtp" else 5 if variant in tiny_model.MTP or variant in tiny_model.V4_MTP else 0
    assert len(norms) == layers * per_layer + 1 + mtp_norms + compressors, sorted(norms)
    final = norms["norm.weight" if variant in tiny_model.MISTRAL_NATIVE else
                  "language_model.model.norm.weight" if variant in tiny_model.WRAPPED else "model.norm.weight"]
    x = torch.randn(4, final.shape[0])
    once = torch.nn.functional.rms_norm(x, final.shape, final, 1e-6)
    twice = torch.nn.functional.rms_norm(once, final.shape, final, 1e-6)
    print(variant, "final norm weight", final.min().item(), final.max().item(), "twice vs once",
          ((twice - once).norm(dim=-1) / once.norm(dim=-1)).min().item())
    assert ((twice - once).norm(dim=-1) / once.norm(dim=-1)).min() > 0.05  # a double norm is visible
    for name, w in norms.items():
        lo, hi = tiny_model.NORM_WEIGHT_RANGE
        assert w.min() >= lo - 0.01 and w.max() <= hi + 0.01 and w.std() > 0.2, (name, w.min(), w.max(), w.std())


def test_a_changed_generator_makes_a_new_cache_entry(monkeypatch):
    """The cache is keyed by the generating functions' source (and the drawing ranges): a checkpoint of an
    older generator is never picked up by a newer one."""
    before = {v: tiny_model.path(v) for v in tiny_model.VARIANTS}
    monkeypatch.setattr(tiny_model, "NORM_WEIGHT_RANGE", (0.9, 1.1))
    assert all(tiny_model.path(v) != p for v, p in before.items())
    monkeypatch.undo()
    assert {v: tiny_model.path(v) for v in tiny_model.VARIANTS} == before
    sources = tiny_model._GENERATOR_SOURCES
    monkeypatch.setattr(tiny_model, "_GENERATOR_SOURCES", lambda: sources()[1:])  # as if _generate changed
    assert all(tiny_model.path(v) != p for v, p in before.items())


@pytest.mark.parametrize("variant", tiny_model.MTP)
def test_mtp_layer_attention_is_live_where_asked(variant):
    """_add_mtp_layer: the MTP layer's MLP adds nothing (down projections zero) in every MTP variant; its attention
    output is live (o_proj drawn N(0, MTP_O^2 / fan-in), queries scaled by MTP_QK) in MTP_ATTENTION's (v3-mtp, whose
    proposals test_speculative judges against a reference of the layer) and zero elsewhere (v32-mtp proposes the
    last token again)."""
    from safetensors import safe_open

    ckpt = tiny_model.ensure(variant)
    prefix = f"model.layers.{tiny_model.hf_config(ckpt, variant).num_hidden_layers}."
    with safe_open(os.path.join(ckpt, "model-mtp.safetensors"), "pt") as f:
        w = {k[len(prefix):]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)}
    downs = [k for k in w if k.endswith("down_proj.weight")]
    assert downs and not any(w[k].any() for k in downs)
    o = w["self_attn.o_proj.weight"]
    if variant in tiny_model.MTP_ATTENTION:
        std = o.std().item() * o.shape[1] ** 0.5
        q_b = w["self_attn.q_b_proj.weight"].std()
        print(f"{variant}: o_proj std x sqrt(fan-in) {std:.3f}, q_b_proj std {q_b:.3f}")
        assert abs(std - tiny_model.MTP_O) < 0.1 * tiny_model.MTP_O
        assert w["self_attn.q_b_proj.weight"].std() > tiny_model.MTP_QK * 0.02 / 2  # HF's init: std 0.02
    else:
        assert not o.any()
