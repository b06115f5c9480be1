"""The embedded tiny DeepSeek-V3: config and tokenizer ship in the package, weights are generated.

Weights are made on first use with HF transformers (seeded, the model's normal initialisation, so
attention and MoE routing really contribute; `--load-format dummy` weights are too small to reveal
numeric or layer-index bugs), saved as sharded safetensors with a `model.safetensors.index.json` weight
map (SpecForge's TargetHead looks for one), and cached outside the repository under
`$SGLANG_HS_CACHE/models/` keyed by the shipped files and the seed. Never committed.

    python -m sglang_hs.tiny_model            # prints the path, generating it if needed
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


def path() -> str:
    """Where the generated checkpoint lives (it may not exist yet)."""
    return os.path.join(envs.SGLANG_HS_CACHE, "models", f"tiny-deepseek-v3-{_key()}")


def ensure() -> str:
    """Return the checkpoint folder, generating it once (a few seconds) if missing."""
    dst = path()
    if os.path.exists(os.path.join(dst, ".complete")):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(dst))
    try:
        _generate(tmp)
        open(os.path.join(tmp, ".complete"), "w").close()
        try:
            os.rename(tmp, dst)
        except OSError:  # another process finished first: keep theirs
            if not os.path.exists(os.path.join(dst, ".complete")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _generate(out: str) -> None:
    import torch
    import transformers

    for name in _FILES:
        shutil.copy(os.path.join(source_dir(), name), os.path.join(out, name))
    cfg = transformers.AutoConfig.from_pretrained(out)
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
    shutil.copy(os.path.join(source_dir(), "config.json"), os.path.join(out, "config.json"))
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json")), "no weight map written"


if __name__ == "__main__":
    print(ensure())
