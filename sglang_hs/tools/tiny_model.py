"""The embedded tiny DeepSeek-V3: config and tokenizer ship in the package, weights are generated.

Weights are made on first use with HF transformers (seeded, the model's normal initialisation, so
attention and MoE routing really contribute; `--load-format dummy` weights are too small to reveal
numeric or layer-index bugs; norm weights drawn from U(0.5, 1.5) and biases from N(0, 0.02) instead of
HF's ones and zeros, `randomise_norms`, so a state normalised once and one normalised twice differ),
saved as sharded safetensors with a `model.safetensors.index.json` weight
map (SpecForge's TargetHead looks for one), and cached outside the repository under
`$SGLANG_HS_CACHE/models/` keyed by the shipped files, the seed and the source of the functions that
generate the weights (`_GENERATOR_SOURCES`: a changed generator makes a new folder, never reuses a
stale one). Never committed.

    python -m sglang_hs.tools.tiny_model            # prints the path, generating it if needed
    python -m sglang_hs.tools.tiny_model v2         # another shape (see VARIANTS)

Other shapes of the same family, for tests (`ensure(variant)`), share the tokenizer and differ only in
config.json, which is derived from the shipped one in code (`variant_config`):
- "v2": DeepseekV2ForCausalLM like DeepSeek-V2-Lite: no query LoRA (q_lora_rank null), softmax gating
  with greedy top-k over one group (n_group 1, topk_group 1), no e_score_correction_bias, top-k weights
  not renormalised, routed_scaling_factor 1.0, two shared experts, YaRN mscale 0.707.
- "kimi-k2": DeepseekV3ForCausalLM with Kimi-K2's config specifics: model_type "kimi_k2", an auto_map
  to remote configuration code (a stand-in `configuration_deepseek.py`, served with
  --trust-remote-code), one expert group (n_group 1, topk_group 1, noaux_tc sigmoid routing with a
  correction bias), routed_scaling_factor 2.827, rope_theta 50000 and YaRN factor 32 with
  beta_fast = beta_slow = 1, no MTP layer. Not Kimi-K2's tokenizer (tiktoken-based remote code, not
  available offline): the embedded one.
- "mistral-large-3": MistralLarge3ForCausalLM in Mistral's native format, as Mistral Large 3 ships:
  `params.json` (no config.json; SGLang's own Mistral config parser turns it into a DeepSeek-V3 config)
  and `consolidated.safetensors` with Mistral weight names (`layers.N.attention.wq_a.weight`, ...,
  per-expert `layers.N.experts.E.w1.weight`), which the upstream class remaps on load. Its shape: one
  expert group, softmax routing with renormalised top-k (no correction bias), routed_scale 1.5, YaRN,
  and Llama-4 attention scaling (query x 1 + beta*log(1 + floor(pos / 16))) with a small original
  length so that test prompts cross several scaling steps; routers drawn wider than HF's init (see
  _generate_mistral). The folder name contains "mistral-large-3": SGLang picks its Mistral config
  parser and weight format by that name, as for the released checkpoints. HF transformers has the
  architecture as Mistral4ForCausalLM (the reference: `mistral_reference`); the weights are generated
  with it and renamed (`to_mistral_names`).
- "kimi-k25": KimiK25ForConditionalGeneration (model_type "kimi_k25", read by SGLang's own KimiK25Config,
  no remote code): text_config is the "kimi-k2" shape, the weights are its text model's under
  "language_model." (as in Kimi-K2.5's checkpoint), and vision_config is the smallest MoonViT SGLang
  builds (_KIMI_K25_VISION); no vision weights (served text only, the tower is never loaded or run).
- "v32": DeepseekV32ForCausalLM (model_type "deepseek_v32"): the V3 shape (two expert groups, YaRN) plus
  the DSA indexer on every layer, with 7 indexer heads of 128 dims (16 rotary; SGLang's DSA KV pool asserts 128) and
  index_topk 11, below every test prompt's length, so the sparse selection really drops keys from the
  second chunk of a prompt on (with index_topk >= the length every key is kept and a wrong indexer is
  invisible). HF transformers' DeepseekV32ForCausalLM is the reference.
- "v4-swa": DeepseekV4ForCausalLM (model_type "deepseek_v4") with every layer sliding-window (compress ratio 0), a
  window of 8, 4 hyper-connection streams, random sinks and hyper-connection biases, a hash-routed first layer and a
  swiglu_limit that acts (V4_SWA); saved with the released weight names SGLang loads (_v4_released_name). HF
  transformers' DeepseekV4ForCausalLM is the reference; served on the CPU engine (tests/e2e/test_v4_cpu.py).
- "v4-csa": v4-swa with layers 1 and 3 compressed sparse (ratio 4, HF's compressed_sparse_attention: overlapping
  blocks, an indexer of 16 heads keeping index_topk 8 blocks per query), layer 2 heavily compressed, and its
  experts in two groups (SGLang's grouped top-k, both groups kept).
- "v3-mtp": the V3 checkpoint plus DeepSeek-V3's MTP layer (num_nextn_predict_layers 1, weights under
  model.layers.8.*), which SGLang serves as the draft of --speculative-algorithm EAGLE/NEXTN; built to
  propose the target's last token again (_add_mtp_layer), perturbed by the layer's own attention over its
  earlier positions (MTP_ATTENTION), so drafts are accepted where the target's greedy output repeats a token
  and the attention did not overrule it. HF transformers ignores the layer: the target's reference is the V3
  model's.
- "v32-mtp": the "v32" checkpoint (the same weights: the same generator and seed) plus DeepSeek-V3.2's MTP layer,
  built as v3-mtp's but with its attention output zero (it proposes the last token again), with its own DSA
  indexer (as V3.2's released layer 61 has; SGLang's DeepseekV3ForCausalLMNextN
  builds one for a config with index_topk and runs it in the draft's passes). HF transformers' DeepseekV32ForCausalLM
  ignores the layer: the target's reference is the v32 model's.
- "v3-long": the V3 shape and weights' generator with YaRN factor 64 (max_position_embeddings 65536): SGLang's
  rotary cache ends at original length x factor, 4096 positions for the shipped config; served with long
  prompts (tests/e2e/test_long_context.py).
- "v4-mtp": v4-csa's checkpoint (the same files and weights: HF's reference is v4-csa's) plus DeepSeek-V4's MTP
  layer in its released names (`mtp.0.*`, num_nextn_predict_layers 1), which SGLang serves as the draft of
  --speculative-algorithm EAGLE/NEXTN (DeepseekV4ForCausalLMNextN); built like v3-mtp's to propose about the token
  the target just chose again (_add_v4_mtp_layer), so drafts are accepted where the greedy output repeats a token
  and rejected elsewhere.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
from importlib import resources

from sglang_hs import envs

SEED = 0
_GENERATOR_VERSION = "2"  # bump when the weights change for a reason outside this file (e.g. transformers' init)
NORM_WEIGHT_RANGE = (0.5, 1.5)  # norm weights are drawn from U(lo, hi) (HF initialises them to one)
BIAS_STD = 0.02  # biases from N(0, BIAS_STD) (HF initialises them to zero)
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def source_dir() -> str:
    return str(resources.files("sglang_hs") / "data" / "tiny_deepseek_v3")


def config() -> dict:
    with open(os.path.join(source_dir(), "config.json")) as f:
        return json.load(f)


def _key() -> str:
    h = hashlib.sha256(f"seed={SEED};gen={_GENERATOR_VERSION};norms={NORM_WEIGHT_RANGE};bias={BIAS_STD}".encode())
    for fn in _GENERATOR_SOURCES():
        h.update(inspect.getsource(fn).encode())
    for name in _FILES:
        with open(os.path.join(source_dir(), name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def _v2(cfg: dict) -> dict:
    cfg = dict(cfg, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
               n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1, topk_method="greedy",
               scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], mscale=0.707, mscale_all_dim=0.707)
    return cfg


# Kimi-K2's config.json declares remote code for its config; this stand-in defines the same class
# name and model_type on top of transformers' own DeepseekV3Config (which Kimi-K2's mirrors).
_KIMI_CONFIGURATION_PY = '''"""Stand-in for Kimi-K2's remote `configuration_deepseek.py` (sglang-hs tiny test checkpoint)."""
from transformers import DeepseekV3Config as _DeepseekV3Config


class DeepseekV3Config(_DeepseekV3Config):
    model_type = "kimi_k2"
'''


def _kimi_k2(cfg: dict) -> dict:
    cfg = dict(cfg, model_type="kimi_k2", n_group=1, topk_group=1, routed_scaling_factor=2.827,
               rope_theta=50000.0, num_nextn_predict_layers=0, max_position_embeddings=131072,
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=32.0, original_max_position_embeddings=4096,
                               beta_fast=1.0, beta_slow=1.0)
    return cfg


# Mistral Large 3's native config (params.json), in Mistral's key names, with the tiny V3's sizes.
_MISTRAL_ROUTER_STD = 0.5  # see _generate_mistral
_MISTRAL_LLAMA4_ORIGINAL = 16  # Llama-4 scaling steps every 16 positions; the YaRN original length too
MISTRAL_PARAMS = {
    "dim": 256, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "hidden_dim": 512, "norm_eps": 1e-06,
    "vocab_size": 1024, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tied_embeddings": False,
    "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "moe": {"route_every_n": 1, "first_k_dense_replace": 1, "num_experts": 8, "num_experts_per_tok": 2,
            "expert_hidden_dim": 128, "routed_scale": 1.5, "num_shared_experts": 1, "num_expert_groups": 1,
            "num_expert_groups_per_tok": 1},
    "yarn": {"factor": 32.0, "original_max_position_embeddings": _MISTRAL_LLAMA4_ORIGINAL, "beta": 32.0,
             "alpha": 1.0, "apply_scale": True},
    "llama_4_scaling": {"original_max_position_embeddings": _MISTRAL_LLAMA4_ORIGINAL, "beta": 0.1},
}


def _mistral_config(cfg: dict) -> dict:
    """What the launcher and the tests read for the Mistral variant: its params.json."""
    return json.loads(json.dumps(MISTRAL_PARAMS))


# The smallest vision tower SGLang's KimiK25ForConditionalGeneration builds (MoonViT3d + projector): one
# layer, hidden 32, two heads, a 4x4 position grid. It is constructed but never loaded or run (text only).
_KIMI_K25_VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 1,
                    "pos_emb_type": "divided_fixed", "num_attention_heads": 2, "num_hidden_layers": 1,
                    "hidden_size": 32, "vt_hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2],
                    "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
                    "mm_projector_type": "patchmerger", "mm_hidden_size": 32, "projector_hidden_act": "gelu",
                    "projector_ln_eps": 1e-05, "text_hidden_size": 256}


def _kimi_k25(cfg: dict) -> dict:
    text = _kimi_k2(cfg)  # keeps architectures DeepseekV3ForCausalLM: upstream's wrapper reads it
    text.pop("auto_map")
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "vision_config": dict(_KIMI_K25_VISION, text_hidden_size=text["hidden_size"]),
            "media_placeholder_token_id": text["vocab_size"] - 1, "pad_token_id": 0,
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}


# DeepSeek-V3.2's DSA indexer, tiny: top-k below the test prompts' lengths (see the module docstring).
V32_INDEX = {"index_topk": 11, "index_n_heads": 7, "index_head_dim": 128}


def _v32(cfg: dict) -> dict:
    return dict(cfg, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", **V32_INDEX)


def _v3_mtp(cfg: dict) -> dict:
    return dict(cfg, num_nextn_predict_layers=1)


def _v32_mtp(cfg: dict) -> dict:
    return dict(_v32(cfg), num_nextn_predict_layers=1)


LONG_CONTEXT = 65536  # "v3-long": positions SGLang's rotary cache holds (original length x YaRN factor)


def _v3_long(cfg: dict) -> dict:
    """The V3 shape with a YaRN factor of 64 over its original 1024 positions: SGLang builds its rotary cache
    for original x factor positions, so the shipped factor 4 stops at 4096; this one serves 64K-token prompts."""
    factor = LONG_CONTEXT // cfg["rope_scaling"]["original_max_position_embeddings"]
    return dict(cfg, max_position_embeddings=LONG_CONTEXT, rope_scaling=dict(cfg["rope_scaling"], factor=float(factor)))


# DeepSeek-V4 with sliding-window attention on every layer (compress ratio 0: no compressor, no indexer): HF's
# DeepseekV4Config keys plus the ones SGLang's DeepSeekV4Config reads (compress_ratios, num_hash_layers, window_size,
# qk_rope_head_dim, yarn rope_scaling with its original length, topk_method). A window of 8 keys, so every test
# prompt crosses it several times; 4 hyper-connection streams; the first layer hash-routed; a swiglu_limit of 0.15,
# which clamps about a third of the experts' gate/up entries (at 10, the released value, no clamp would ever act).
V4_SWA = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
          "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
          "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
          "routed_scaling_factor": 1.5, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
          "sliding_window": 8, "window_size": 8, "compress_ratios": [0, 0, 0, 0], "num_hash_layers": 1,
          "n_hash_layers": 1, "swiglu_limit": 0.15, "rope_theta": 10000, "compress_rope_theta": 160000,
          "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                           "beta_slow": 1},
          "max_position_embeddings": 4096, "num_nextn_predict_layers": 0, "index_n_heads": 4, "index_head_dim": 32,
          "index_topk": 8, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          # DSpark's target layers as DeepSeek-V4-Flash-DSpark names them ([40, 41, 42] of 43): the last three layers'
          # outputs, the last one hc_head's input; a capture without --hs-layers takes them (server/layer_source.py)
          "dspark_target_layer_ids": [1, 2, 3]}


def _v4_swa(cfg: dict) -> dict:
    return dict({k: cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "max_position_embeddings")},
                **V4_SWA)


def _v4_csa(cfg: dict) -> dict:
    """v4-swa with layers 1 and 3 compressed sparse (ratio 4: overlapping 8-token blocks, the indexer keeping each
    query's 8 best closed blocks) and layer 2 heavily compressed; 16 index heads (with 4, every head's ReLU score is
    0 for about one block in 16: exact ties for the last kept place, which HF's top-k and a per-chunk one may break
    differently); its experts in two groups of two (n_group 2, topk_group 2): SGLang's grouped top-k runs; every group
    is kept, so the choice is HF's (its V4 router has no groups)."""
    return dict(_v4_swa(cfg), compress_ratios=[0, 4, 128, 4], index_n_heads=16, n_group=2, topk_group=2)


VARIANTS = {"v3": None, "v2": _v2, "kimi-k2": _kimi_k2, "mistral-large-3": _mistral_config, "kimi-k25": _kimi_k25,
            "v32": _v32, "v3-mtp": _v3_mtp, "v32-mtp": _v32_mtp, "v3-long": _v3_long, "v4-swa": _v4_swa,
            "v4-csa": _v4_csa, "v4-mtp": lambda cfg: dict(_v4_csa(cfg), num_nextn_predict_layers=1)}
MTP = ("v3-mtp", "v32-mtp")  # variants that carry DeepSeek's MTP layer (model.layers.<n>.*): _add_mtp_layer
# those whose MTP layer's attention is live (_add_mtp_layer's `attention`): its queries scaled by MTP_QK, its output
# projection drawn N(0, MTP_O^2 / fan-in) instead of zero
MTP_ATTENTION, MTP_QK, MTP_O = ("v3-mtp",), 100.0, 2.0
WRAPPED = ("kimi-k25",)  # variants whose weights are a text model's under "language_model."
MISTRAL_NATIVE = ("mistral-large-3",)  # variants written as params.json + consolidated.safetensors
V4_MTP = {"v4-mtp": "v4-csa"}  # a V4 checkpoint with an MTP layer: the base variant's files plus _add_v4_mtp_layer
V4 = ("v4-swa", "v4-csa")  # DeepSeek-V4 variants: HF's init leaves sinks, hc biases and hash tables trivial (_v4_weights)
_EXTRA_FILES = {"kimi-k2": {"configuration_deepseek.py": _KIMI_CONFIGURATION_PY}}


def variant_config(variant: str = "v3") -> dict:
    """config.json of a variant (the shipped one for "v3")."""
    make = VARIANTS[variant]
    return config() if make is None else make(config())


def path(variant: str = "v3") -> str:
    """Where the generated checkpoint lives (it may not exist yet)."""
    if VARIANTS[variant] is None:
        return os.path.join(envs.SGLANG_HS_CACHE, "models", f"tiny-deepseek-v3-{_key()}")
    h = hashlib.sha256(f"{_key()};variant={variant};".encode())
    h.update(json.dumps(variant_config(variant), sort_keys=True).encode())
    if variant in MISTRAL_NATIVE:
        h.update(f"mistral-router-std={_MISTRAL_ROUTER_STD};".encode())
    for name, text in sorted(_EXTRA_FILES.get(variant, {}).items()):
        h.update(name.encode() + b"\0" + text.encode())
    if variant in MTP:
        h.update(inspect.getsource(_add_mtp_layer).encode())
        if variant in MTP_ATTENTION:
            h.update(f"mtp-attention qk={MTP_QK} o={MTP_O};".encode())
    if variant in V4_MTP:
        h.update(f"base={path(V4_MTP[variant])};".encode() + inspect.getsource(_add_v4_mtp_layer).encode()
                 + inspect.getsource(_v4_donor).encode())
    return os.path.join(envs.SGLANG_HS_CACHE, "models", f"tiny-{variant}-{h.hexdigest()[:16]}")


def ensure(variant: str = "v3") -> str:
    """Return the checkpoint folder, generating it once (a few seconds) if missing."""
    if variant in V4_MTP:
        return build_once(path(variant), lambda tmp: _generate_v4_mtp(tmp, variant))
    return build_once(path(variant), lambda tmp: _generate(tmp, variant))


def build_once(dst: str, generate) -> str:
    """`dst`, made by `generate(folder)` into a temporary sibling folder then renamed into place, unless a
    complete one is there already (a concurrent builder's finished folder wins)."""
    if os.path.exists(os.path.join(dst, ".complete")):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(dst))
    try:
        generate(tmp)
        open(os.path.join(tmp, ".complete"), "w").close()
        try:
            os.rename(tmp, dst)
        except OSError:  # another process finished first: keep theirs
            if not os.path.exists(os.path.join(dst, ".complete")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _write_config(out: str, variant: str) -> None:
    if variant in MISTRAL_NATIVE:
        with open(os.path.join(out, "params.json"), "w") as f:
            json.dump(variant_config(variant), f, indent=2)
    elif VARIANTS[variant] is None:
        shutil.copy(os.path.join(source_dir(), "config.json"), os.path.join(out, "config.json"))
    else:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(variant_config(variant), f, indent=2)


def hf_config(ckpt: str, variant: str = "v3"):
    """The checkpoint's config as an in-tree transformers config. Kimi-K2's is a DeepseekV3Config under
    another model_type; it is read here as "deepseek_v3" (no remote code), which also keeps transformers'
    weight conversions (keyed by model_type) on, so weights are saved and loaded per expert the way
    SGLang reads them."""
    import transformers

    if variant in MISTRAL_NATIVE:
        with open(os.path.join(ckpt, "params.json")) as f:
            return mistral4_config(json.load(f))
    if variant in WRAPPED:  # the language model's config (Kimi-K2.5: a DeepseekV3 with Kimi-K2's specifics)
        with open(os.path.join(ckpt, "config.json")) as f:
            d = json.load(f)["text_config"]
        d.pop("model_type", None)
        return transformers.DeepseekV3Config.from_dict(d)
    if variant == "kimi-k2":
        with open(os.path.join(ckpt, "config.json")) as f:
            d = json.load(f)
        for key in ("model_type", "auto_map"):
            d.pop(key, None)
        return transformers.DeepseekV3Config.from_dict(d)
    return transformers.AutoConfig.from_pretrained(ckpt)


def mistral4_config(params: dict):
    """HF transformers' Mistral4Config for a Mistral-native params.json (the MistralLarge3 shape: MLA,
    softmax routing with renormalised top-k, YaRN, Llama-4 attention scaling). Written from Mistral's key
    names, independently of SGLang's parser; HF reads the Llama-4 scaling's original length from the YaRN
    block, so the two must be equal (they are in the released configs)."""
    import transformers

    moe, yarn, l4 = params["moe"], params["yarn"], params["llama_4_scaling"]
    assert l4["original_max_position_embeddings"] == yarn["original_max_position_embeddings"]
    assert moe.get("route_every_n", 1) == 1 and yarn.get("apply_scale", True)
    return transformers.Mistral4Config(
        vocab_size=params["vocab_size"], hidden_size=params["dim"], intermediate_size=params["hidden_dim"],
        moe_intermediate_size=moe["expert_hidden_dim"], num_hidden_layers=params["n_layers"],
        num_attention_heads=params["n_heads"], num_key_value_heads=params["n_kv_heads"],
        n_shared_experts=moe["num_shared_experts"], n_routed_experts=moe["num_experts"],
        num_experts_per_tok=moe["num_experts_per_tok"], n_group=moe["num_expert_groups"],
        topk_group=moe["num_expert_groups_per_tok"], routed_scaling_factor=moe["routed_scale"],
        first_k_dense_replace=moe["first_k_dense_replace"], norm_topk_prob=True,
        q_lora_rank=params["q_lora_rank"], kv_lora_rank=params["kv_lora_rank"],
        qk_nope_head_dim=params["qk_nope_head_dim"], qk_rope_head_dim=params["qk_rope_head_dim"],
        v_head_dim=params["v_head_dim"], max_position_embeddings=params["max_position_embeddings"],
        rms_norm_eps=params["norm_eps"], tie_word_embeddings=params["tied_embeddings"], rope_interleave=True,
        rope_parameters={"type": "yarn", "rope_theta": params["rope_theta"], "factor": yarn["factor"],
                         "original_max_position_embeddings": yarn["original_max_position_embeddings"],
                         "beta_fast": yarn["beta"], "beta_slow": yarn["alpha"], "mscale": 1.0,
                         "mscale_all_dim": 1.0, "llama_4_scaling_beta": l4["beta"]},
        bos_token_id=0, eos_token_id=1, pad_token_id=None)


# HF Mistral4 parameter name -> Mistral-native name (the inverse of the upstream class's remapping).
_TO_MISTRAL = [
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_a_proj\.weight", r"layers.\1.attention.wq_a.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_a_layernorm\.weight", r"layers.\1.attention.q_a_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_b_proj\.weight", r"layers.\1.attention.wq_b.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.weight", r"layers.\1.attention.wkv_a_with_mqa.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_a_layernorm\.weight", r"layers.\1.attention.kv_a_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight", r"layers.\1.attention.wkv_b.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.weight", r"layers.\1.shared_experts.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.weight", r"layers.\1.shared_experts.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.weight", r"layers.\1.shared_experts.w3.weight"),
]
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def to_mistral_names(state: dict) -> dict:
    """HF Mistral4 state dict -> Mistral-native tensors (experts split per expert: w1 gate, w3 up, w2 down)."""
    out = {}
    for name, t in state.items():
        m = _FUSED_EXPERTS.fullmatch(name)
        if m:
            layer, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    out[f"layers.{layer}.experts.{e}.w2.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"layers.{layer}.experts.{e}.w1.weight"] = gate
                    out[f"layers.{layer}.experts.{e}.w3.weight"] = up
            continue
        out[_renamed(name, _TO_MISTRAL, "no Mistral name for")] = t
    return {k: v.contiguous() for k, v in out.items()}


def _renamed(name: str, table, missing: str) -> str:
    """`name` through the first (pattern, replacement) of `table` that matches all of it; KeyError
    "`missing` `name`" when none does."""
    for pat, rep in table:
        if re.fullmatch(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(f"{missing} {name}")


def from_mistral_names(tensors: dict, num_experts: int) -> dict:
    """The inverse of `to_mistral_names`, for loading a Mistral-native checkpoint into HF's Mistral4."""
    inverse = [(re.escape(rep).replace(re.escape(r"\1"), r"(\d+)"), pat.replace(r"(\d+)", r"\1").replace("\\.", "."))
               for pat, rep in _TO_MISTRAL]
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"layers\.(\d+)\.experts\.(\d+)\.(w[123])\.weight", name)
        if m:
            experts.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3))] = t
            continue
        out[_renamed(name, inverse, "unknown Mistral weight")] = t
    import torch

    for layer, w in experts.items():
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[(e, "w1")], w[(e, "w3")]], dim=0) for e in range(num_experts)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([w[(e, "w2")] for e in range(num_experts)])
    return out


def mistral_reference(ckpt: str, dtype=None):
    """HF transformers' Mistral4ForCausalLM holding a Mistral-native checkpoint's weights (strict load)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    with open(os.path.join(ckpt, "params.json")) as f:
        params = json.load(f)
    cfg = mistral4_config(params)
    model = transformers.Mistral4ForCausalLM(cfg)
    state = from_mistral_names(load_file(os.path.join(ckpt, "consolidated.safetensors")), cfg.n_routed_experts)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model.to(dtype or torch.float32).eval()


def _is_norm_weight(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    return name.endswith(".weight") and len(leaf) >= 2 and "norm" in leaf[-2]


def randomise_norms(model, seed: int) -> dict:
    """Norm weights from U(NORM_WEIGHT_RANGE) and biases from N(0, BIAS_STD), seeded, in place; HF
    initialises them to ones and zeros, under which an RMSNorm applied twice equals one applied once and a
    missing bias goes unseen. Returns how many of each were drawn ({"norm": n, "bias": m})."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lo, hi = NORM_WEIGHT_RANGE
    counts = {"norm": 0, "bias": 0}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_norm_weight(name):
                param.copy_(lo + (hi - lo) * torch.rand(param.shape, generator=gen, dtype=torch.float32))
                counts["norm"] += 1
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * BIAS_STD)
                counts["bias"] += 1
    if not counts["norm"]:
        raise RuntimeError(f"{type(model).__name__}: no norm weight found to randomise")
    return counts


def _generate_mistral(out: str, variant: str) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = mistral4_config(variant_config(variant))
    torch.manual_seed(SEED)
    import transformers

    model = transformers.Mistral4ForCausalLM(cfg).to(torch.float32)
    # Decisive routers, as in trained checkpoints: HF's initialisation leaves the softmax router near-uniform
    # (logits ~0.3 apart), so bf16 rounding (SGLang serves this class in bf16 only) would flip many top-k
    # choices between SGLang and the float32 reference.
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * _MISTRAL_ROUTER_STD)
    randomise_norms(model, SEED + 2)
    state = {k: v.to(torch.bfloat16) for k, v in to_mistral_names(model.state_dict()).items()}
    save_file(state, os.path.join(out, "consolidated.safetensors"), metadata={"format": "pt"})


def _prefix_weights(out: str, prefix: str) -> None:
    """Rename every tensor of the saved shards (and the index) to `prefix + name`, as a wrapper's
    checkpoint holds its language model (Kimi-K2.5: `language_model.model.layers...`)."""
    from safetensors.torch import load_file, save_file

    index = os.path.join(out, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    for shard in sorted(set(idx["weight_map"].values())):
        tensors = load_file(os.path.join(out, shard))
        save_file({prefix + k: v for k, v in tensors.items()}, os.path.join(out, shard), metadata={"format": "pt"})
    idx["weight_map"] = {prefix + k: v for k, v in idx["weight_map"].items()}
    with open(index, "w") as f:
        json.dump(idx, f, indent=2)


def _generate(out: str, variant: str = "v3") -> None:
    import torch
    import transformers

    for name in _FILES:
        if name == "config.json" and variant in MISTRAL_NATIVE:
            continue  # params.json instead
        shutil.copy(os.path.join(source_dir(), name), os.path.join(out, name))
    _write_config(out, variant)
    if variant in MISTRAL_NATIVE:
        _generate_mistral(out, variant)
        return
    cfg = hf_config(out, variant)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # MoE gate bias (noaux_tc routing): HF leaves it at zero; make it non-trivial but small so
    # routing depends on it the way it does in the released checkpoints.
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.01)
    randomise_norms(model, SEED + 2)
    if variant in V4:
        _v4_weights(model, SEED + 3)
    model = model.to(torch.bfloat16)
    # Small shards, so the folder carries the index.json weight map that training tools look for.
    model.save_pretrained(out, safe_serialization=True, max_shard_size="256KB" if variant in V4 else "4MB")
    _write_config(out, variant)
    if variant in WRAPPED:
        _prefix_weights(out, "language_model.")
    if variant in MTP:
        _add_mtp_layer(out, cfg, attention=variant in MTP_ATTENTION)
    if variant in V4:
        _rename_weights(out, _v4_released_name)
    for name, text in _EXTRA_FILES.get(variant, {}).items():
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json")), "no weight map written"


def _v4_released_name(name: str) -> str:
    """DeepSeek-V4's released weight names where HF's save_pretrained writes others, both of which SGLang's loader
    would miss (it logs "not found" and keeps the parameter uninitialised): the attention's kv_norm (HF writes
    `attn.norm`) and the final hyper-connection head (HF writes `model.hc_head.hc_fn`, released `hc_head_fn`). HF
    reads the released names back (its conversion map)."""
    name = re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", name)
    return re.sub(r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)


def _rename_weights(out: str, rename) -> None:
    """Rename every tensor of the saved shards (and the index) by `rename(name)`; a folder without an index holds
    one model.safetensors."""
    from safetensors.torch import load_file, save_file

    index = os.path.join(out, "model.safetensors.index.json")
    if not os.path.exists(index):
        single = os.path.join(out, "model.safetensors")
        save_file({rename(k): v for k, v in load_file(single).items()}, single, metadata={"format": "pt"})
        return
    with open(index) as f:
        idx = json.load(f)
    for shard in sorted(set(idx["weight_map"].values())):
        tensors = load_file(os.path.join(out, shard))
        save_file({rename(k): v for k, v in tensors.items()}, os.path.join(out, shard), metadata={"format": "pt"})
    idx["weight_map"] = {rename(k): v for k, v in idx["weight_map"].items()}
    with open(index, "w") as f:
        json.dump(idx, f, indent=2)


def _v4_weights(model, seed: int) -> None:
    """DeepSeek-V4 parameters HF initialises to constants, drawn so that each one matters: attention sinks N(0, 1)
    (zeros would still weigh, but the same on every head), the hyper-connections' biases N(0, 0.5) and scales
    U(0.5, 1.5), compressors' position biases N(0, 0.5), and the hash-routed layers' token-to-expert table (zeros: every token to expert 0 twice) a seeded
    choice of distinct experts per token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "sinks":
                param.copy_(torch.randn(param.shape, generator=gen))
            elif leaf in ("base", "hc_base"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif leaf in ("scale", "hc_scale"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif leaf == "position_bias":  # a compressor's per-position gate bias (released name `ape`)
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(experts, generator=gen)[:buf.shape[1]]
                                       for _ in range(buf.shape[0])]))


def _add_mtp_layer(out: str, cfg, attention: bool = False) -> None:
    """DeepSeek-V3's MTP (NextN) layer as `model.layers.<n>.*`, the names SGLang's DeepseekV3ForCausalLMNextN
    loads, in a shard of its own. A draft that accepts often enough to test with, by construction: eh_proj
    takes the hnorm half (the target's final hidden state h_t) as is, the decoder layer adds nothing
    (its attention output and MLP down projections are zero, so the residual stream passes through) and
    both norms are ones, so the draft's logits are the target head's on h_t / rms(h_t): it proposes the
    token the target just chose, again. Accepted wherever the target's greedy output repeats a token,
    rejected elsewhere. hnorm and shared_head.norm stay ones (the argmax of the target's head must survive
    both); the layer's other norms and enorm are drawn like every norm (randomise_norms' range), and its
    other weights (query/KV projections, router, up projections) are a normally initialised HF layer's: the
    draft runs all of SGLang's MTP path.

    With `attention` (MTP_ATTENTION: v3-mtp) the layer's attention is live: q_b_proj is scaled by MTP_QK (its
    softmax then picks few of the draft's own earlier positions, by content and rotary position) and o_proj is
    drawn N(0, MTP_O^2 / fan-in) (its own generator: the other weights are the same), so the attention output
    is comparable to the residual stream and overrules the repeated token in many proposals. What the draft
    proposes then hangs on its KV at every earlier position and on its positions: test_speculative judges the
    EAGLE server's accepted drafts against a plain HF reference of the layer (tests/e2e/mtp_reference.py)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    n = cfg.num_hidden_layers
    # V3.2's config class for "v32-mtp": its layer's indexer too; per-layer type lists derived again for n + 1
    deeper = type(cfg).from_dict({k: v for k, v in dict(cfg.to_dict(), num_hidden_layers=n + 1).items()
                                  if k not in ("layer_types", "mlp_layer_types")})
    torch.manual_seed(SEED + 3)
    donor = transformers.AutoModelForCausalLM.from_config(deeper, dtype=torch.float32)
    tmp = tempfile.mkdtemp(prefix=".mtp-", dir=out)
    try:
        donor.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        prefix = f"model.layers.{n}."
        layer = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                layer.update({k: v for k, v in load_file(os.path.join(tmp, name)).items() if k.startswith(prefix)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not layer:
        raise RuntimeError(f"no {prefix}* weights in the donor model")
    H = cfg.hidden_size
    gen = torch.Generator().manual_seed(SEED + 4)
    lo, hi = NORM_WEIGHT_RANGE
    layer[prefix + "enorm.weight"] = torch.ones(H)
    for k in sorted(layer):
        if k.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            layer[k] = torch.zeros_like(layer[k])
        elif _is_norm_weight(k):
            layer[k] = (lo + (hi - lo) * torch.rand(layer[k].shape, generator=gen)).to(torch.bfloat16)
    if attention:
        q_b, o_proj = prefix + "self_attn.q_b_proj.weight", prefix + "self_attn.o_proj.weight"
        layer[q_b] = (layer[q_b].float() * MTP_QK).to(torch.bfloat16)
        o_gen = torch.Generator().manual_seed(SEED + 5)
        fan_in = layer[o_proj].shape[1]
        layer[o_proj] = (torch.randn(layer[o_proj].shape, generator=o_gen) * MTP_O / fan_in ** 0.5).to(torch.bfloat16)
    eh = torch.zeros(H, 2 * H, dtype=torch.bfloat16)
    eh[:, H:] = torch.eye(H, dtype=torch.bfloat16)  # [enorm(embedding); hnorm(h_t)] -> hnorm(h_t)
    ones = torch.ones(H, dtype=torch.bfloat16)
    layer.update({prefix + "hnorm.weight": ones, prefix + "shared_head.norm.weight": ones.clone(),
                  prefix + "eh_proj.weight": eh})
    shard = "model-mtp.safetensors"
    save_file(layer, os.path.join(out, shard), metadata={"format": "pt"})
    index = os.path.join(out, "model.safetensors.index.json")
    with open(index) as f:
        idx = json.load(f)
    idx["weight_map"].update({k: shard for k in layer})
    with open(index, "w") as f:
        json.dump(idx, f, indent=2)


def _generate_v4_mtp(out: str, variant: str) -> None:
    """The base V4 variant's files, byte for byte (so its HF reference holds), its config with
    num_nextn_predict_layers 1, and the MTP layer (_add_v4_mtp_layer)."""
    base = ensure(V4_MTP[variant])
    for name in os.listdir(base):
        if not name.startswith("."):
            shutil.copy(os.path.join(base, name), os.path.join(out, name))
    _write_config(out, variant)
    _add_v4_mtp_layer(out, variant)


def _v4_donor(out: str, donor_cfg: dict, seed: int, prefix: str) -> dict:
    """Every weight, under its released name (bf16), of an HF DeepSeek-V4 model of `donor_cfg` drawn as the tiny
    checkpoints are (torch seed `seed`, randomise_norms seed + 1, _v4_weights seed + 2), built in a scratch folder
    under `out` (named `prefix`...) and removed: the layers a draft (V4's MTP layer, a DSpark draft's stages) takes."""
    import torch
    import transformers
    from safetensors.torch import load_file

    tmp = tempfile.mkdtemp(prefix=prefix, dir=out)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(donor_cfg, f)
        torch.manual_seed(seed)
        donor = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp),
                                                              dtype=torch.float32)
        randomise_norms(donor, seed + 1)
        _v4_weights(donor, seed + 2)
        donor.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        weights = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                weights.update((_v4_released_name(k), v) for k, v in load_file(os.path.join(tmp, name)).items())
        return weights
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _add_v4_mtp_layer(out: str, variant: str) -> None:
    """DeepSeek-V4's MTP layer under its released names (`mtp.0.*`: a V4 decoder layer of compress ratio 0, not
    hash-routed, with e_proj, h_proj, enorm, hnorm, norm and its own hc_head_*), which SGLang's
    DeepseekV4ForCausalLMNextN loads, in a shard of its own. Like v3-mtp's (_add_mtp_layer), a draft that accepts
    often enough to test with: e_proj is zero (enorm drawn, like every norm) and h_proj the identity, hnorm ones, so each
    stream is the target's stream leaving its last layer (hc_head's input, SGLang's pre_hc_head) over its RMS; the decoder layer adds nothing (wo_b and
    every expert's w2 zero) and keeps the streams apart (its hyper-connections' comb mix the identity: zero comb
    weights, a bias of 20 on the diagonal); hc_head and the final norm are the target's. So the draft's logits are
    about the target head's on the state it just chose from: it proposes about the token the target just chose,
    again. The layer's other weights (query/KV projections, sinks, router, up projections) are a normally
    initialised HF V4 layer's, so the draft runs all of SGLang's V4 MTP path."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = variant_config(variant)
    donor_cfg = dict(cfg, num_hidden_layers=2, compress_ratios=[0, 0], num_nextn_predict_layers=0)
    donor_cfg.pop("layer_types", None)
    layer = {"mtp.0." + k[len("model.layers.1."):]: v for k, v in _v4_donor(out, donor_cfg, SEED + 5, ".mtp-").items()
             if k.startswith("model.layers.1.")}
    if not layer:
        raise RuntimeError("no model.layers.1.* weights in the donor model")
    H, hc = cfg["hidden_size"], cfg["hc_mult"]
    gen = torch.Generator().manual_seed(SEED + 8)
    lo, hi = NORM_WEIGHT_RANGE
    for k in sorted(layer):
        if k.endswith(("attn.wo_b.weight", "w2.weight")):
            layer[k] = torch.zeros_like(layer[k])
        elif re.search(r"\.hc_(attn|ffn)_fn$", k):
            layer[k] = layer[k].clone()
            layer[k][2 * hc:] = 0
        elif re.search(r"\.hc_(attn|ffn)_base$", k):
            layer[k] = layer[k].clone()
            layer[k][2 * hc:] = (20 * torch.eye(hc)).flatten().to(layer[k].dtype)
    weights = {}
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    for name in ("model.norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"):
        weights[name] = load_file(os.path.join(out, idx["weight_map"][name]))[name]
    bf16 = torch.bfloat16
    layer.update({"mtp.0.e_proj.weight": torch.zeros(H, H, dtype=bf16), "mtp.0.h_proj.weight": torch.eye(H, dtype=bf16),
                  "mtp.0.enorm.weight": (lo + (hi - lo) * torch.rand(H, generator=gen)).to(bf16),
                  "mtp.0.hnorm.weight": torch.ones(H, dtype=bf16),
                  "mtp.0.norm.weight": weights["model.norm.weight"].clone(),
                  **{f"mtp.0.{k}": weights[k].clone() for k in ("hc_head_fn", "hc_head_base", "hc_head_scale")}})
    shard = "model-mtp.safetensors"
    save_file(layer, os.path.join(out, shard), metadata={"format": "pt"})
    idx["weight_map"].update({k: shard for k in layer})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f, indent=2)


DSPARK_GAMMA = 3  # drafts per block (dspark_block_size): a verify pass of 4 tokens
DSPARK_MASK_TOKEN = 2  # the block's mask token (dspark_noise_token_id), inside the tiny vocabulary
DSPARK_MARKOV_BIAS = 6.0  # the markov head's bias towards the previous token, against the base logits' spread
DSPARK_CONFIDENCE_SPAN = 0.45  # the confidence head's weight on each previous token: uniform in +-this


def dspark_confidence_weights(draft: str):
    """The DSpark draft's confidence head (_generate_dspark_draft) as a [V] float32 tensor w: SGLang's confidence of
    a draft whose previous token (the anchor for the first draft, else the draft before it) is v is
    sigmoid(DSPARK_MARKOV_BIAS * w[v]) (the head reads the markov embedding, DSPARK_MARKOV_BIAS one-hot; its weight
    on the stages' hidden state is zero)."""
    from safetensors.torch import load_file

    proj = load_file(os.path.join(draft, "model.safetensors"))["mtp.0.confidence_head.proj.weight"]
    with open(os.path.join(draft, "config.json")) as f:
        H = json.load(f)["hidden_size"]
    return proj[0, H:].float()


def dspark_draft_path(target: str = "v4-csa") -> str:
    """Where the DSpark draft of the V4 variant `target` lives (it may not exist yet)."""
    h = hashlib.sha256(f"target={path(target)};gamma={DSPARK_GAMMA};mask={DSPARK_MASK_TOKEN};"
                       f"bias={DSPARK_MARKOV_BIAS};confidence={DSPARK_CONFIDENCE_SPAN};".encode()
                       + inspect.getsource(_generate_dspark_draft).encode()
                       + inspect.getsource(_v4_donor).encode() + inspect.getsource(dspark_bigram).encode())
    return os.path.join(envs.SGLANG_HS_CACHE, "models", f"tiny-{target}-dspark-{h.hexdigest()[:16]}")


def ensure_dspark_draft(target: str = "v4-csa") -> str:
    """A DeepSeek-V4 DSpark draft (SGLang's DeepseekV4ForCausalLMDSpark) for the V4 variant `target`, generated
    once: served with --speculative-algorithm DSPARK --speculative-draft-model-path <it>."""
    if target not in V4:
        raise ValueError(f"a DSpark draft is built for a DeepSeek-V4 variant {V4}, not {target!r}")
    return build_once(dspark_draft_path(target), lambda tmp: _generate_dspark_draft(tmp, target))


def dspark_bigram(ckpt: str, model=None) -> list:
    """For each token v, the token HF float32's model of `ckpt` predicts (argmax) for the one-token text [v]: the
    markov head of the DSpark draft (_generate_dspark_draft). `model`: that model, already loaded."""
    import torch
    import transformers

    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.arange(model.config.vocab_size).view(-1, 1)).logits[:, 0].argmax(-1).tolist()


def _generate_dspark_draft(out: str, target: str) -> None:
    """The target's config with the prefixed DSpark keys SGLang's parse_dspark_draft_config reads
    (dspark_block_size, dspark_markov_rank, dspark_noise_token_id; dspark_target_layer_ids as the target's), one
    stage per target layer id (`mtp.<s>.*`, a V4 decoder layer of compress ratio 0 each, as
    DeepseekV4ForCausalLMDSpark._remap_dspark_weight_name loads them): stage 0 with main_proj (the target layers'
    states, side by side, to H) and main_norm, the last with norm and hc_head_*; and the markov head
    (`markov_head.embed` [V, r] and `.head` [V, r], r = V). Built to be accepted and rejected: the markov head is the
    target's own bigram (dspark_bigram: after token v it biases, by DSPARK_MARKOV_BIAS, the token HF's target predicts
    for the one-token text [v]), far above the stages' own logits (the target's head on their output, about 0.2 in
    spread: drawn weights, attention over the injected context), so each draft is the bigram of the one before it,
    starting from the anchor; the tiny target's greedy output follows that bigram about one step in eight (measured
    on test prompts: 12 of 96), so drafts are both accepted and rejected. A confidence head
    (`mtp.0.confidence_head.proj.weight` [1, H + r], enable_confidence_head), which SGLang builds under
    SGLANG_RAGGED_VERIFY_MODE cap-accept or compact only (static, its default, builds none and skips the weight):
    zero on the stages' hidden state, a weight uniform in +-DSPARK_CONFIDENCE_SPAN on each previous token's markov
    embedding, so a draft's confidence is sigmoid(DSPARK_MARKOV_BIAS * w[previous token]) (dspark_confidence_weights),
    between 0.06 and 0.94: a block's survival (their product over its 3 drafts) stays above SGLang's survival_eps
    (1e-6), so under cap-accept with no SPS table the verify budget is every draft and no window is capped."""
    import torch
    from safetensors.torch import save_file

    base = ensure(target)
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    layers = list(cfg["dspark_target_layer_ids"])
    stages = len(layers)
    cfg.update(dspark_block_size=DSPARK_GAMMA, dspark_markov_rank=cfg["vocab_size"],
               dspark_noise_token_id=DSPARK_MASK_TOKEN, num_nextn_predict_layers=stages, enable_confidence_head=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    donor_cfg = dict(cfg, num_hidden_layers=stages + 1, compress_ratios=[0] * (stages + 1), num_nextn_predict_layers=0)
    for key in [k for k in donor_cfg if k.startswith("dspark_")] + ["layer_types"]:
        donor_cfg.pop(key, None)
    weights = {}
    for k, v in _v4_donor(out, donor_cfg, SEED + 9, ".dspark-").items():
        for s in range(stages):  # donor layer s + 1 (layer 0 is hash-routed) -> stage s
            if k.startswith(f"model.layers.{s + 1}."):
                weights[f"mtp.{s}." + k[len(f"model.layers.{s + 1}."):]] = v
        if k in ("model.norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"):
            weights[k] = v
    H, V, last = cfg["hidden_size"], cfg["vocab_size"], stages - 1
    gen = torch.Generator().manual_seed(SEED + 12)
    lo, hi = NORM_WEIGHT_RANGE
    bf16 = torch.bfloat16
    head = {f"mtp.{last}.norm.weight": weights.pop("model.norm.weight"),
            **{f"mtp.{last}.{k}": weights.pop(k) for k in ("hc_head_fn", "hc_head_base", "hc_head_scale")}}
    weights.update(head)
    weights.update({
        "mtp.0.main_proj.weight": (torch.randn(H, H * stages, generator=gen) * (H * stages) ** -0.5).to(bf16),
        "mtp.0.main_norm.weight": (lo + (hi - lo) * torch.rand(H, generator=gen)).to(bf16),
        "mtp.0.markov_head.embed.weight": (DSPARK_MARKOV_BIAS * torch.eye(V)).to(bf16),
        "mtp.0.markov_head.head.weight": torch.eye(V)[dspark_bigram(base)].T.contiguous().to(bf16)})
    confidence = torch.zeros(1, H + V)
    confidence[0, H:] = (2 * torch.rand(V, generator=gen) - 1) * DSPARK_CONFIDENCE_SPAN
    weights["mtp.0.confidence_head.proj.weight"] = confidence
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def _GENERATOR_SOURCES():
    """The functions whose source keys the cache (`_key`): what makes a checkpoint's weights."""
    return (_generate, _generate_mistral, randomise_norms, _v4_weights, _v4_released_name, _rename_weights, _is_norm_weight, _prefix_weights, to_mistral_names,
            mistral4_config, hf_config, _write_config)


if __name__ == "__main__":
    import sys

    print(ensure(*sys.argv[1:2]))
