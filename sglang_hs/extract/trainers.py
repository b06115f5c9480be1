"""The trainer's side of the files a run wrote: SpecForge's run config (`specforge train --config`), the
training command of each format (printed at the end of a run, recorded in manifest.json), and the served
model's vocabulary size it sizes the draft's vocabulary by."""
from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

from sglang_hs.extract.checkpoint_names import (SPECULATORS_VERIFIER, checkpoint_keys, speculators_renames,
                                                 write_speculators_verifier)

SPECFORGE_CONFIG = "specforge_train.json"
DEEPSPEC_CONFIG = "config/dspark/YOUR_DRAFT.py"  # DeepSpec's config of the draft: the user's choice
DRAFT_VOCAB_SIZE = 32000  # the EAGLE-3 drafts' usual draft vocabulary (speculators' converter default)


def specforge_config(out_dir: str, manifest: dict) -> dict:
    """A `specforge train --config` run config (SpecForge 0.2.0's schema) for the files in `out_dir`: an
    offline EAGLE-3 run on them, the target's lm_head and embeddings from the served checkpoint, samples
    up to the server's context length."""
    cfg = {"model": {"target_model_path": manifest["model_path"], "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": out_dir},
           "training": {"strategy": "eagle3"},
           "output_dir": out_dir.rstrip(os.sep) + "-specforge"}
    if manifest.get("context_len"):
        cfg["data"]["max_length"] = int(manifest["context_len"])
    cfg["model"].update(checkpoint_keys(manifest["model_path"]))
    return cfg


def training_command(out_dir: str, manifest: dict, fmt: str, save_dtype: Optional[str]) -> List[str]:
    """The trainer's command line for the files of this run (argv; SpecForge's reads SPECFORGE_CONFIG)."""
    if fmt == "specforge":
        return ["specforge", "train", "--config", os.path.join(out_dir, SPECFORGE_CONFIG)]
    if fmt == "deepspec":  # in a DeepSpec checkout, with its config of the drafter to train (DSpark or EAGLE-3)
        from sglang_hs.extract.sinks.deepspec import CACHE_DIR, deepspec_layer_ids

        ids = ",".join(map(str, deepspec_layer_ids(manifest["layer_ids"])))
        return ["python", "train.py", "--config", DEEPSPEC_CONFIG, "--opts",
                f"data.target_cache_path={os.path.join(out_dir, CACHE_DIR)}", "--opts",
                f"model.target_model_name_or_path={manifest['model_path']}", "--opts",
                f"model.target_layer_ids=[{ids}]"]
    verifier = manifest["model_path"]
    if speculators_renames(verifier):  # written beside the files by print_training_command
        verifier = os.path.join(out_dir, SPECULATORS_VERIFIER)
    cmd = ["speculators", "train", "--speculator-type", "eagle3", "--verifier-name-or-path", verifier,
           "--data-path", out_dir, "--target-layer-ids", *map(str, manifest["layer_ids"]),
           "--hidden-states-backend", "fp8" if (save_dtype or "").startswith("fp8") else "file",
           "--hidden-states-dtype", "bfloat16"]
    vocab = manifest.get("vocab_size")
    if vocab and vocab > DRAFT_VOCAB_SIZE:  # token_freq.pt in --data-path: the draft head's most frequent tokens
        cmd += ["--draft-vocab-size", str(DRAFT_VOCAB_SIZE)]
    return cmd


def print_training_command(out_dir: str, manifest: dict, fmt: str, save_dtype: Optional[str],
                           gid: Optional[int] = None) -> None:
    """Say how to train on the files just written (SpecForge: with the run config written beside them)."""
    import shlex

    if not manifest["last"]:
        return
    if fmt == "specforge":
        with open(os.path.join(out_dir, SPECFORGE_CONFIG), "w") as f:
            json.dump(specforge_config(out_dir, manifest), f, indent=1)
    elif fmt == "safetensors":
        shim = os.path.join(out_dir, SPECULATORS_VERIFIER)
        try:
            if write_speculators_verifier(out_dir, manifest["model_path"], gid):
                print(f"[extract] {manifest['model_path']} names its lm_head (head.weight) or embedding as DeepSeek-V4 "
                      "does, which speculators 0.9.0 does not find (it would take the embedding as lm_head): its "
                      f"verifier is {shim}, those tensors renamed", file=sys.stderr, flush=True)
        except OSError as e:  # a full disk: the files are complete, the trainer's verifier is not
            print(f"[extract] warning: cannot write {shim} ({e}), which the command below names as speculators' "
                  "verifier: free space and rerun the extraction with --resume", file=sys.stderr, flush=True)
    cmd = " ".join(shlex.quote(a) for a in training_command(out_dir, manifest, fmt, save_dtype))
    trainer = {"specforge": "SpecForge 0.2.0", "deepspec": f"DeepSpec (in its checkout; {DEEPSPEC_CONFIG}: your "
               "draft's config)"}.get(fmt, "speculators 0.9.0")
    print(f"[extract] train with {trainer}:\n  {cmd}", file=sys.stderr, flush=True)


def model_vocab_size(model_path: str) -> Optional[int]:
    """The served checkpoint's vocabulary size (config.json, a wrapper's text_config, or Mistral's params.json);
    None when it cannot be read (a hub name, or no path: not the current folder's config.json)."""
    if not model_path:
        return None
    for name, keys in (("config.json", ("vocab_size",)), ("config.json", ("text_config", "vocab_size")),
                       ("params.json", ("vocab_size",))):
        try:
            with open(os.path.join(model_path, name)) as f:
                value = json.load(f)
            for k in keys:
                value = value[k]
            return int(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None

