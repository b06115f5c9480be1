"""The target checkpoint's tensor names as the trainers look them up. DeepSeek-V4 names its embedding and lm_head
in DeepSeek's own layout (embed.weight, head.weight), which neither SpecForge 0.2.0's defaults nor speculators
0.9.0's lookup finds: SpecForge's run config gets the keys (checkpoint_keys), and speculators a verifier folder
with those tensors renamed (write_speculators_verifier)."""
import json
import os
from typing import Optional

# SpecForge reads the target's embedding and lm_head by these names (its ModelConfig defaults first); DeepSeek-V4's
# checkpoints name them in DeepSeek's own layout (transformers 5.19's conversion_mapping: embed.weight,
# head.weight; HF's save_pretrained of DeepseekV4ForCausalLM writes head.weight too)
CHECKPOINT_KEYS = {"embedding_key": ("model.embed_tokens.weight", "embed.weight", "model.embed.weight"),
                   "lm_head_key": ("lm_head.weight", "head.weight", "model.head.weight")}


def checkpoint_keys(model_path: str) -> dict:
    """SpecForge's model.embedding_key / model.lm_head_key for a local checkpoint whose weights are not named as
    its defaults are ({} when they are, or when the checkpoint cannot be read: a hub name)."""
    names = _weight_names(model_path)
    out = {}
    for key, candidates in CHECKPOINT_KEYS.items():
        found = [c for c in candidates if c in names]
        if found and found[0] != candidates[0]:
            out[key] = found[0]
    return out


def _weight_names(model_path: str) -> set:
    """The tensor names of a local safetensors checkpoint (its index, or its one file); empty when unreadable."""
    try:
        with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
            return set(json.load(f)["weight_map"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        from safetensors import safe_open

        with safe_open(os.path.join(model_path, "model.safetensors"), "pt") as f:
            return set(f.keys())
    except Exception:  # noqa: BLE001 - a hub name, no checkpoint here
        return set()


# speculators 0.9.0 (speculators/utils/loading.py) finds the verifier's tensors by name, a suffix of a name, or an
# alias: with no `lm_head.weight` it takes the embedding as lm_head (tied), silently, and with no `embed_tokens.weight`
# it stops with a KeyError. DeepSeek-V4 names them head.weight and embed.weight (transformers 5.19's
# conversion_mapping; HF's save_pretrained writes head.weight): its teacher would be the embedding's logits.
SPECULATORS_VERIFIER = "speculators_verifier"
# speculators' name -> the names it finds it by (a key equal to or ending with one), then DeepSeek-V4's own
SPECULATORS_NAMES = {"model.embed_tokens.weight": (("embed_tokens.weight", "tok_embeddings.weight"), "embed.weight"),
                     "lm_head.weight": (("lm_head.weight", "output.weight", "llm.unembed.weight"), "head.weight"),
                     "model.norm.weight": (("model.norm.weight",), "norm.weight")}


def speculators_renames(model_path: str) -> dict:
    """{speculators' name: the checkpoint's} when a local checkpoint names its embedding or lm_head as DeepSeek-V4
    does (embed.weight, head.weight), which speculators does not find; {} when it finds them by its own rules,
    or the checkpoint cannot be read."""
    names = _weight_names(model_path)
    out, renamed = {}, False
    for ours, (its, v4) in SPECULATORS_NAMES.items():
        found = sorted((n for n in names if n.endswith(its)), key=len)
        if found:
            out[ours] = found[0]
        elif v4 in names:
            out[ours], renamed = v4, True
    return out if renamed and len(out) == len(SPECULATORS_NAMES) else {}


def write_speculators_verifier(out_dir: str, model_path: str, gid: Optional[int] = None) -> Optional[str]:
    """For a checkpoint speculators would misread (speculators_renames): DIR/speculators_verifier, the checkpoint's
    config, tokenizer and other small files linked, and model.safetensors holding its embedding, lm_head and
    final norm under speculators' names (the vocabulary x hidden twice: ~2.1 GB for DeepSeek-V4-Flash in bf16).
    Returns its path (None: not needed). Written under a temporary name and renamed."""
    renames = speculators_renames(model_path)
    if not renames:
        return None
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from sglang_hs.fsutil import make_private_dirs

    final = os.path.join(out_dir, SPECULATORS_VERIFIER)
    source = os.path.abspath(model_path)
    try:  # a resumed run's, of the same checkpoint: kept
        with safe_open(os.path.join(final, "model.safetensors"), "pt") as f:
            if (f.metadata() or {}).get("source") == source:
                return final
    except Exception:  # noqa: BLE001 - none yet, or cut short: made again
        pass
    tmp = final + f".{os.getpid()}.tmp"
    make_private_dirs(tmp, gid)
    try:
        try:
            with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
                where = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError):
            where = {}
        tensors = {}
        for ours, theirs in renames.items():
            with safe_open(os.path.join(model_path, where.get(theirs, "model.safetensors")), "pt") as f:
                tensors[ours] = f.get_tensor(theirs).contiguous()
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt", "source": source})
        for name in os.listdir(model_path):  # config, tokenizer, generation config, remote code
            if name.endswith((".json", ".model", ".py", ".txt", ".tiktoken")) and name != "model.safetensors.index.json":
                os.symlink(os.path.abspath(os.path.join(model_path, name)), os.path.join(tmp, name))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
