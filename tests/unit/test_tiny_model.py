"""The embedded tiny DeepSeek-V3: shipped config/tokenizer, generated weights."""
import json
import os

import pytest

from sglang_hs.tools import tiny_model


@pytest.fixture(scope="module")
def ckpt():
    return tiny_model.ensure()


def test_config_fits_the_default_capture():
    cfg = tiny_model.config()
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_hidden_layers"] >= 8 and cfg["n_routed_experts"] >= 4 and cfg["kv_lora_rank"] > 0
    assert cfg["rope_scaling"]["type"] == "yarn"


def test_checkpoint_has_weight_map_and_is_cached(ckpt):
    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
    shards = set(idx["weight_map"].values())
    assert all(os.path.exists(os.path.join(ckpt, s)) for s in shards)
    assert tiny_model.ensure() == ckpt  # second call: the cache, no regeneration
    assert not ckpt.startswith(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # outside the repo


def test_weights_are_normally_initialised(ckpt):
    from safetensors import safe_open

    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    with safe_open(os.path.join(ckpt, idx["weight_map"][name]), "pt") as f:
        w = f.get_tensor(name).float()
    # N(0, 0.02), not dummy U(-1e-3, 1e-3)
    assert 0.015 < w.std().item() < 0.025


def test_tokenizer_and_chat_template(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
        tokenize=False,
    )
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is two plus two?<｜Assistant｜>Four.<｜end▁of▁sentence｜>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0 and ids[-1] == tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "What is two plus two?Four."
    assert max(ids) < tiny_model.config()["vocab_size"]
