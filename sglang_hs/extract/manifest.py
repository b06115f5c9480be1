"""manifest.json, the one file that says what --output holds: written at the end of every run (write_manifest:
the server's capture, the draft model's config fields, the run's flags and counts, the training command) and
read back when a run continues in the same folder (previous: what the files of the run before are)."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

from sglang_hs.server.capture_spec import final_states
from sglang_hs.extract.errors import PROG
from sglang_hs.extract.stats import Stats
from sglang_hs.extract.trainers import training_command

MANIFEST = "manifest.json"


def previous(out_dir: str) -> Optional[dict]:
    """The manifest.json a run before this one left in `out_dir`, or None (there is none, or it cannot be read:
    a run killed before writing one)."""
    try:
        with open(os.path.join(out_dir, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def draft_config(manifest: dict) -> dict:
    """Draft-model config fields for these layers, in SGLang's EAGLE-3 id convention."""
    layers = manifest["layer_ids"]
    note = ("SGLang's set_eagle3_layers_to_capture adds 1 to every id when the first id is 1 (SpecForge "
            "writes [1, n//2-1, n-4] for HF output_hidden_states [2, n//2, n-3]); otherwise ids are used as "
            "given. These ids make SGLang capture exactly HF output_hidden_states "
            f"{layers}, the rows in these files.")
    if layers[0] == 2:
        ids = [i - 1 for i in layers]
    elif layers[0] != 1:
        ids = list(layers)
    else:
        ids, note = None, ("no EAGLE-3 id list makes SGLang capture a first layer of 1 (HF output_hidden_states"
                           "[1]): it adds 1 when the first id is 1; capture other layers to serve this draft")
    out = {}
    if manifest.get("hc_mult", 1) > 1:  # DeepSeek-V4: SGLang 0.5.23 serves DSpark drafters for it, not EAGLE-3
        ids = None
        n = manifest["num_hidden_layers"]
        note = ("SGLang 0.5.23 serves DeepSeek-V4 drafters through DSpark (DeepseekV4ForCausalLM has no "
                "set_eagle3_layers_to_capture): a DSpark draft config's dspark_target_layer_ids (what "
                "parse_dspark_draft_config reads) are its dspark_layers_to_capture, captured after layer j (the state "
                "entering layer j+1, the stream mean), so they make SGLang capture exactly HF output_hidden_states "
                f"{[i for i in layers if i < n]} (.mean(-2))"
                + (f" and, for our id {n}, the streams leaving the last layer (the input of HF model.model.hc_head, "
                   "no output_hidden_states entry)" if n in layers else ""))
        if manifest.get("hc_streams") == "full":
            note += ("; these files hold every stream (hc_mult rows per id), SGLang's DSpark capture serves their "
                     "mean only")
        out["dspark_target_layer_ids"] = manifest.get("dspark_layer_ids")
        out.update(hc_mult=manifest["hc_mult"], hc_streams=manifest.get("hc_streams", "mean"),
                   rows_per_layer=manifest.get("rows_per_layer", 1))
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            **out, "target_hidden_size": manifest["hidden_size"], "sglang_id_convention": note,
            # `speculators train --target-layer-ids` takes the aux ids only (HF output_hidden_states
            # indices, space-separated): the final state is the file's last row, never one of these ids. None
            # when an id has no output_hidden_states index (DeepSeek-V4's id n, hc_head's input)
            "speculators_layer_ids": None if manifest.get("num_hidden_layers") in layers else list(layers)}



def _stored_dtype(save_dtype: Optional[str], server_dtype: str, fmt: str = "") -> str:
    if save_dtype is None:
        return server_dtype
    if fmt == "deepspec":
        from sglang_hs.extract.sinks.deepspec import HIDDEN_DTYPES

        return HIDDEN_DTYPES[save_dtype] + (" (unscaled)" if save_dtype != "bf16" else "")
    return {"bf16": "bfloat16", "fp8": "float8_e4m3fn (a float32 scale per token)",
            "fp8-per-layer": "float8_e4m3fn (a float32 scale per token and layer)"}[save_dtype]


def write_manifest(out_dir: str, server_manifest: dict, facts, stats: Stats, sink, status: str,
                   dataset: Optional[dict] = None) -> None:
    """manifest.json of a run that ends: `server_manifest` the capture's, `facts` the run's flags it records
    (config.RunFacts: data, from_dump, save_dtype, shard, regenerate), `dataset` what sink.finalize() made."""
    from sglang_hs.version import SGLANG_VERSION, __version__

    m = server_manifest
    doc = {
        "status": status, "format": sink.name, "sglang_hs_version": __version__, "sglang_version": SGLANG_VERSION,
        "model_path": m["model_path"], "architecture": m["architecture"], "dtype": m["dtype"],
        "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_hidden_layers"], "layer_ids": m["layer_ids"],
        "last_hidden_state": m["last"], "hf_output_hidden_states_index": m["hf_output_hidden_states_index"],
        "convention": m["convention"], "draft_model_config": draft_config(m),
        # what served the records: target, draft and its settings, chat template (sglang_hs/server/identity.py)
        "served": m.get("served"),
        # where the layer ids came from: --hs-layers, the default, or the checkpoint's drafter (server/layer_source.py)
        "layer_source": m.get("layer_source"),
        # DeepSeek-V4: how its hc_mult streams became rows (capture_spec.HC_CONVENTION)
        **{k: m[k] for k in ("hc_mult", "hc_streams", "rows_per_layer", "hc_convention", "dspark_layer_ids") if k in m},
        "data": (os.path.abspath(facts.data) if os.path.exists(facts.data) else facts.data) if facts.data else None,
        "from_dump": os.path.abspath(facts.from_dump) if facts.from_dump else None,
        "save_dtype": facts.save_dtype, "stored_dtype": _stored_dtype(facts.save_dtype, m["dtype"], sink.name),
        "shard": facts.shard or "0/1", "regenerate": facts.regenerate, "command": [PROG.split()[-1], *sys.argv[1:]],
        "samples_on_disk": sink.existing(), **stats.summary(),
    }
    if m["last"]:
        doc["last_states"] = list(final_states(m))  # the final states the server captured
        doc["final_state_stored"] = sink.final_state  # the one in these files
        doc["train_command"] = training_command(out_dir, m, sink.name, facts.save_dtype)
    if sink.name == "safetensors":
        doc["speculators_dataset_rows"] = (dataset or {}).get("rows")  # None: not written by this run
        # speculators' train --hidden-states-backend: the file backend reads FP8 files without their scales
        doc["speculators_hidden_states_backend"] = "fp8" if (facts.save_dtype or "").startswith("fp8") else "file"
    if sink.name == "deepspec":
        from sglang_hs.extract.sinks.deepspec import CACHE_DIR, LAYER_CONVENTION, deepspec_layer_ids

        doc["deepspec_target_cache"] = {"path": os.path.join(out_dir, CACHE_DIR), "rows": (dataset or {}).get("rows"),
                                        "target_layer_ids": deepspec_layer_ids(m["layer_ids"]),
                                        "layer_id_convention": LAYER_CONVENTION}
    from sglang_hs.fsutil import write_private_file

    write_private_file(out_dir, MANIFEST, json.dumps(doc, indent=1).encode(), getattr(sink, "share_gid", None))
