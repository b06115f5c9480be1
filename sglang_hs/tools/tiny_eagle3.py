"""A tiny EAGLE-3 draft for the embedded tiny DeepSeek-V3, generated at test time (never committed).

The draft SGLang 0.5.23 serves with `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`:
`LlamaForCausalLMEagle3` (sglang/srt/models/llama_eagle3.py), written the way SpecForge saves one (the
`midlayer.*` names, `fc`, `norm`, its own `lm_head`, `d2t`/`t2d`), with `eagle_config.
eagle_aux_hidden_state_layer_ids` naming the target's layers it reads (SGLang adds 1 to every id when the
first is 1, `set_eagle3_layers_to_capture`).

A random draft would almost never be accepted; this one is built so that it is, and so that what it proposes
depends on the target's aux hidden states it is handed:
- the embedding branch proposes the token it is given again: one attention head over the whole hidden
  size (head_dim = hidden_size), whose query, key and value read the normalised embedding half of the
  layer's input ([embedding; target states]). All keys then have (nearly) the same norm, so by Cauchy-Schwarz
  a position's own key scores highest whatever the rotary rotation of the others (the query is scaled by
  QK_SCALE, so the softmax is one-hot on it and the positions holding the same token, which carry the same
  value); the output projection is the identity and the MLP's down projection zero, and the LM head's rows
  are the target's embedding rows, normalised: the argmax of the head on that embedding is the token itself.
- the target branch: `fc` (the concatenated aux states -> hidden) is drawn N(0, (FC_SCALE^2 / in)), large
  enough that for about a third of the tokens the target's aux states outweigh the embedding and choose
  another token. So the draft is accepted where the target's greedy output repeats a token and the aux
  states did not overrule it, and wrong aux states (another layer, a shifted row, zeros) change many
  proposals: SGLang's accept counts then differ from a server that hands the draft the right states.
Norm weights are drawn like every tiny checkpoint's (tiny_model.NORM_WEIGHT_RANGE); d2t is zero (draft id
= target id over the full vocabulary) and t2d all true, as SpecForge writes them for a full draft vocabulary.

    python -m sglang_hs.tools.tiny_eagle3      # prints the path, generating it if needed
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os

from sglang_hs import envs
from sglang_hs.tools import tiny_model

# The target's layers the draft reads, as a SpecForge EAGLE-3 config names them. SGLang shifts them by one
# (first id 1), so the target captures the inputs of its layers 2, 5 and 7: two of test_speculative's
# --hs-layers (2, 4, 5) and one other.
AUX_LAYER_IDS = (1, 4, 6)
QK_SCALE = 4.0  # self-attention scores ~69 on the own position vs ~12 on others: a one-hot softmax
FC_SCALE = 60.0  # |fc(aux)| ~ 4x the embedding branch on the tiny target's states: ~1/3 of proposals change
INTERMEDIATE = 96
SEED = 11


def config() -> dict:
    t = tiny_model.config()
    H = t["hidden_size"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": H, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1, "vocab_size": t["vocab_size"], "draft_vocab_size": t["vocab_size"],
        "target_hidden_size": H, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": t["max_position_embeddings"], "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": t.get("bos_token_id"), "eos_token_id": t.get("eos_token_id"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS), "use_aux_hidden_state": True},
    }


def path() -> str:
    """Where the draft lives: keyed by its target checkpoint and this generator's source."""
    h = hashlib.sha256(f"target={tiny_model.path()};seed={SEED};qk={QK_SCALE};fc={FC_SCALE};".encode())
    h.update(json.dumps(config(), sort_keys=True).encode())
    h.update(inspect.getsource(_generate).encode())
    return os.path.join(envs.SGLANG_HS_CACHE, "models", f"tiny-eagle3-draft-{h.hexdigest()[:16]}")


def ensure() -> str:
    """Return the draft's folder, generating it (and its target) once if missing."""
    return tiny_model.build_once(path(), lambda tmp: _generate(tmp, tiny_model.ensure()))


def _target_embedding(target: str):
    from safetensors import safe_open

    with open(os.path.join(target, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"]["model.embed_tokens.weight"]
    with safe_open(os.path.join(target, shard), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _generate(out: str, target: str) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = config()
    H, V, I, K = cfg["hidden_size"], cfg["vocab_size"], INTERMEDIATE, len(AUX_LAYER_IDS)
    gen = torch.Generator().manual_seed(SEED)
    lo, hi = tiny_model.NORM_WEIGHT_RANGE

    def norm():
        return lo + (hi - lo) * torch.rand(H, generator=gen)

    def normal(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    emb_half = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)  # [embedding; target states] -> embedding
    embed = _target_embedding(target).float()
    w = {
        "fc.weight": normal(H, K * H, std=FC_SCALE / (K * H) ** 0.5),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": QK_SCALE * emb_half,
        "midlayer.self_attn.k_proj.weight": emb_half.clone(),
        "midlayer.self_attn.v_proj.weight": emb_half.clone(),
        "midlayer.self_attn.o_proj.weight": torch.eye(H),
        "midlayer.mlp.gate_proj.weight": normal(I, H, std=0.02),
        "midlayer.mlp.up_proj.weight": normal(I, H, std=0.02),
        "midlayer.mlp.down_proj.weight": torch.zeros(H, I),
        "norm.weight": norm(),
        "lm_head.weight": embed / embed.norm(dim=-1, keepdim=True),
    }
    w = {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}
    w["d2t"] = torch.zeros(V, dtype=torch.int64)
    w["t2d"] = torch.ones(V, dtype=torch.bool)
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


if __name__ == "__main__":
    print(ensure())
