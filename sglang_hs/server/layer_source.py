"""Which layers to capture when `--hs-layers` is not given: the ones the checkpoint's own drafter reads.

A checkpoint that ships a drafter, or a draft served beside it, names its target layers in its config, in the
convention of the code that serves it; a capture for the next version of that drafter should default to them.
Looked for, first found wins:

1. the draft's config (`--speculative-draft-model-path` with `--speculative-algorithm EAGLE3` or `DSPARK`, the
   algorithms served with capture whose draft reads target layers of its choice), the drafter being served;
2. the target's config: a bundled DSpark head (DeepSeek-V4-Flash-DSpark's `dspark_target_layer_ids` [40, 41, 42])
   or EAGLE-3 ids kept with the target.

In each config, the keys SGLang 0.5.23 reads a drafter's target layers from (speculative/dspark_components/
dspark_config.py parse_dspark_draft_config, speculative/dflash_utils.py parse_dflash_draft_config,
model_runner_components/spec_aux_hidden_state.py): `dspark_target_layer_ids`, `dflash_config.target_layer_ids`, a
top-level `target_layer_ids` (decoder layer j's output: our id j + 1, capture_spec.from_dspark_ids), then
`eagle_config.eagle_aux_hidden_state_layer_ids` unless `eagle_config.use_aux_hidden_state` is false (as SGLang's
set_eagle3_layers_to_capture takes them: capture_spec.from_eagle3_ids). Ids are captured in ascending order, as
SGLang captures them. Nothing found: the EAGLE-3 default
[2, n//2, n-3]. The result is printed at start-up and kept in the manifest (`layer_source`)."""
from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

from sglang_hs.server.capture_spec import CaptureConfigError, from_dspark_ids, from_eagle3_ids

DSPARK_RULE = "decoder layer j's output (SGLang's DSpark/DFlash target ids): our id j + 1"
DSPARK_LAGGED_RULE = ("decoder layer j's input (DeepSeek-V4 with hc_pre_from_prev_sublayer: SGLang captures before "
                      "layer j): our id j")
EAGLE3_RULE = ("SGLang's set_eagle3_layers_to_capture: the state entering layer i, every id plus 1 when the first is 1 "
               "(SpecForge's [1, n//2-1, n-4])")


def _nested(config: dict, *keys):
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def ids_in_config(config: dict, hc_pre_from_prev_sublayer: bool = False,
                  where: str = "the config") -> Optional[Tuple[str, List[int], List[int], str]]:
    """(key, the config's ids, ours (ascending), the rule) for the first drafter layer list in `config`, or None;
    CaptureConfigError naming the key and `where` for a list that is not one of integers."""
    dspark_rule = DSPARK_LAGGED_RULE if hc_pre_from_prev_sublayer else DSPARK_RULE
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    for path, rule in ((("dspark_target_layer_ids",), dspark_rule), (("dflash_config", "target_layer_ids"), dspark_rule),
                       (("target_layer_ids",), dspark_rule),
                       (("eagle_config", "eagle_aux_hidden_state_layer_ids"), EAGLE3_RULE)):
        raw = _nested(config, *path)
        if raw is None or (rule is EAGLE3_RULE and eagle.get("use_aux_hidden_state", True) is False):
            continue
        key = ".".join(path)
        if not (isinstance(raw, (list, tuple)) and raw and all(isinstance(i, int) and not isinstance(i, bool)
                                                               for i in raw)):
            raise CaptureConfigError(f"{key} in {where}: a non-empty list of integer layer ids was expected, got {raw!r}")
        ours = from_eagle3_ids(raw) if rule is EAGLE3_RULE else from_dspark_ids(raw, hc_pre_from_prev_sublayer)
        return key, list(raw), sorted(set(ours)), rule
    return None


def read_draft_config(path: str, revision: Optional[str]) -> dict:
    """The draft's config.json: a local folder, the hub's cache, else downloaded from the hub as SGLang will (the
    file alone, read as JSON: no transformers class needed for its model_type)."""
    from sglang_hs.server.identity import local_file

    try:
        found = local_file(path, "config.json", revision)
        if found is None:
            from huggingface_hub import hf_hub_download

            found = hf_hub_download(path, "config.json", revision=revision)
        with open(found) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 (any failure to read it is the same one-line error)
        raise CaptureConfigError(f"--speculative-draft-model-path: cannot read {path}'s config.json to pick the captured "
                                 f"layers ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass "
                                 "--hs-layers") from None


def checkpoint_layers(target_config: dict, target_where: str, draft_config: Optional[dict] = None,
                      draft_where: Optional[str] = None) -> Optional[dict]:
    """The manifest's `layer_source` for the layers the draft's config, else the target's, names (the module's
    doc), or None when neither names any: {"from", "key", "ids" (the config's), "layers" (ours), "rule"}."""
    lagged = bool(target_config.get("hc_pre_from_prev_sublayer", False))  # the target captures: its path decides
    for config, where in ((draft_config, draft_where), (target_config, target_where)):
        if not config:
            continue
        found = ids_in_config(config, lagged, where)
        if found is not None:
            key, raw, ours, rule = found
            return {"from": where, "key": key, "ids": raw, "layers": ours, "rule": rule}
    return None


def describe_default(flag_given: bool) -> dict:
    """The `layer_source` of --hs-layers, or of the EAGLE-3 default."""
    return {"from": "--hs-layers"} if flag_given else {"from": "default", "rule": "EAGLE-3's [2, n//2, n-3]"}


def startup_line(source: dict) -> str:
    """How the launcher says where the layers came from."""
    if source.get("key"):
        return (f"layers from {source['from']} {source['key']} {source['ids']} -> our ids {source['layers']} "
                f"({source['rule']})")
    return f"layers from {source['from']}" + (f" ({source['rule']})" if source.get("rule") else "")


def config_where(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else f"{path} (config.json)"
