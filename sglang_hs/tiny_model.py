"""The embedded tiny DeepSeek-V3: config and tokenizer ship in the package, weights are generated.

Weights are made on first use with HF transformers (seeded, the model's normal initialisation, so
attention and MoE routing really contribute; `--load-format dummy` weights are too small to reveal
numeric or layer-index bugs), saved as sharded safetensors with a `model.safetensors.index.json` weight
map (SpecForge's TargetHead looks for one), and cached outside the repository under
`$SGLANG_HS_CACHE/models/` keyed by the shipped files and the seed. Never committed.

    python -m sglang_hs.tiny_model            # prints the path, generating it if needed
    python -m sglang_hs.tiny_model v2         # another shape: v2, kimi-k2 (see VARIANTS)

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
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources

from sglang_hs import envs

SEED = 0
_GENERATOR_VERSION = "1"  # bump when the way weights are generated changes
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def source_dir() -> str:
    return str(resources.files("sglang_hs") / "data" / "tiny_deepseek_v3")


def config() -> dict:
    with open(os.path.join(source_dir(), "config.json")) as f:
        return json.load(f)


def _key() -> str:
    h = hashlib.sha256(f"seed={SEED};gen={_GENERATOR_VERSION}".encode())
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


VARIANTS = {"v3": None, "v2": _v2, "kimi-k2": _kimi_k2}
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
    for name, text in sorted(_EXTRA_FILES.get(variant, {}).items()):
        h.update(name.encode() + b"\0" + text.encode())
    return os.path.join(envs.SGLANG_HS_CACHE, "models", f"tiny-{variant}-{h.hexdigest()[:16]}")


def ensure(variant: str = "v3") -> str:
    """Return the checkpoint folder, generating it once (a few seconds) if missing."""
    dst = path(variant)
    if os.path.exists(os.path.join(dst, ".complete")):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(dst))
    try:
        _generate(tmp, variant)
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
    if VARIANTS[variant] is None:
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

    if variant == "kimi-k2":
        with open(os.path.join(ckpt, "config.json")) as f:
            d = json.load(f)
        for key in ("model_type", "auto_map"):
            d.pop(key, None)
        return transformers.DeepseekV3Config.from_dict(d)
    return transformers.AutoConfig.from_pretrained(ckpt)


def _generate(out: str, variant: str = "v3") -> None:
    import torch
    import transformers

    for name in _FILES:
        shutil.copy(os.path.join(source_dir(), name), os.path.join(out, name))
    _write_config(out, variant)
    cfg = hf_config(out, variant)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # MoE gate bias (noaux_tc routing): HF leaves it at zero; make it non-trivial but small so
    # routing depends on it the way it does in the released checkpoints.
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.01)
    model = model.to(torch.bfloat16)
    # Small shards, so the folder carries the index.json weight map that training tools look for.
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4MB")
    _write_config(out, variant)
    for name, text in _EXTRA_FILES.get(variant, {}).items():
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json")), "no weight map written"


if __name__ == "__main__":
    import sys

    print(ensure(*sys.argv[1:2]))
