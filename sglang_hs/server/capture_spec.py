"""What to capture: layer ids, the final state, and the architectures that support it.

One convention, recorded in every output: layer id i (0 <= i < n) is the residual stream ENTERING
decoder layer i, which is HF transformers' `output_hidden_states[i]` (the output of layer i-1; id 0 is
the embedding output). The final post-norm state, HF `output_hidden_states[n]`, is not a layer id:
it is captured with `--hs-last` (or `--hs-last post-norm`). `--hs-last pre-norm` captures instead the
final residual stream BEFORE the final norm (the input of HF `model.model.norm`; what vLLM's extraction
stores and speculators trains on: it applies the norm itself), and `--hs-last both` captures the two.
A token's rows are the layers in id order, then the final states in FINAL_ORDER (post-norm, pre-norm).
Ids are set on the model directly, never through SGLang's `set_eagle3_layers_to_capture`, which shifts
every id by one when the first one is 1.

DeepSeek-V4 (manifold hyper-connections, mHC) carries `hc_mult` residual streams per token, HF
`output_hidden_states[i]` of shape [.., hc_mult, H] for i < n. Its default (`--hs-hc-streams mean`) is
SGLang 0.5.23's own answer for its DSpark drafters (`DeepseekV4Model.dspark_layers_to_capture`, captured
with `mhc_stream_mean`): layer id i = the mean over the streams entering layer i = HF
`output_hidden_states[i].mean(-2)`; the final post-norm state is the state after the head's collapse
(`hc_head`) and the final norm = HF `output_hidden_states[n]`; pre-norm is the head's collapse, the input
of HF `model.model.norm`. `--hs-hc-streams full` keeps every stream instead: hc_mult rows of H per layer id,
stream s of layer i = HF `output_hidden_states[i][..., s, :]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

# Architectures whose SGLang class is DeepseekV2ForCausalLM or a subclass the overlay covers
# (DeepSeek-V2/V2.5/V3/R1, Kimi-K2 and other checkpoints declaring these names; Mistral Large 3, text;
# Kimi-K2.5, text only, whose DeepseekV3 language model sits inside a vision-language wrapper).
SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                           "MistralLarge3ForCausalLM", "KimiK25ForConditionalGeneration", "DeepseekV4ForCausalLM")
# Classes whose residual is `hc_mult` parallel streams per token (manifold hyper-connections).
HC_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
# --hs-hc-streams's choices: the streams' mean (SGLang's DSpark convention) or all of them.
STREAMS_CHOICES = ("mean", "full")
# Classes served with DeepSeek Sparse Attention (their configs carry `index_topk`).
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM",)
# Wrappers whose config keeps the language model's sizes in `text_config`.
TEXT_CONFIG_WRAPPERS = ("KimiK25ForConditionalGeneration",)
# DeepSeek-V3-family classes of SGLang 0.5.23 that are refused, and why (one line each).
REFUSED_ARCHITECTURES = {
    "PixtralForConditionalGeneration": "Mistral Large 3 with its vision encoder builds its language model "
                                       "inside the Pixtral wrapper, which sglang-hs does not cover; serve "
                                       "a text-only params.json (MistralLarge3ForCausalLM)",
    **{name: "Kimi-K3's layer input is a learned softmax mixture over a bank of earlier block outputs (Attention "
             "Residuals, attn_res_block_size), not one residual stream per token, its KDA linear-attention layers "
             "have no CPU path in SGLang 0.5.23 and HF transformers 5.19 has no kimi_k3 reference to judge rows "
             "against; not captured" for name in ("KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM")},
}
MIN_LAYERS_FOR_DEFAULT = 8
CONVENTION = (
    "layer id i = residual stream entering decoder layer i = HF output_hidden_states[i]; "
    "last = final post-norm hidden state = HF output_hidden_states[num_hidden_layers]; "
    "pre-norm last = final residual stream before the final norm = the input of HF model.model.norm"
)
HC_CONVENTION = {
    "mean": "hyper-connections (hc_mult streams): layer id i = mean over the hc_mult streams entering decoder layer "
            "i = HF output_hidden_states[i].mean(-2) (SGLang's DeepseekV4Model dspark capture, mhc_stream_mean); "
            "last = after the head's collapse (hc_head) and the final norm = HF output_hidden_states[num_hidden_layers]; "
            "pre-norm last = the head's collapse = the input of HF model.model.norm; layer id num_hidden_layers = mean over "
            "the streams leaving the last decoder layer = the input of HF model.model.hc_head .mean(-2) (no HF "
            "output_hidden_states index: null in hf_output_hidden_states_index)",
    "full": "hyper-connections (hc_mult streams): layer id i = hc_mult rows, row s = stream s entering decoder layer "
            "i = HF output_hidden_states[i][..., s, :]; last = after the head's collapse (hc_head) and the final "
            "norm = HF output_hidden_states[num_hidden_layers]; pre-norm last = the head's collapse = the input of "
            "HF model.model.norm; layer id num_hidden_layers = the streams leaving the last decoder layer = the input "
            "of HF model.model.hc_head (no HF output_hidden_states index: null in hf_output_hidden_states_index)",
}


def hc_mult_of(config) -> int:
    """The residual streams per token: the config's `hc_mult` for a HC_ARCHITECTURES model, else 1."""
    archs = list(_config_value(config, "architectures") or [])
    if not archs or archs[0] not in HC_ARCHITECTURES:
        return 1
    return int(_config_value(config, "hc_mult") or 4)


def parse_streams(value, hc_mult: int) -> str:
    """--hs-hc-streams as "mean" or "full"; None is "mean". Refused for a model without hyper-connections."""
    if value is None:
        return "mean"
    if value not in STREAMS_CHOICES:
        raise CaptureConfigError(f"--hs-hc-streams: {value!r} is not one of {', '.join(STREAMS_CHOICES)}")
    if hc_mult <= 1:
        raise CaptureConfigError(f"--hs-hc-streams: only for models with hyper-connections "
                                 f"({', '.join(HC_ARCHITECTURES)}, hc_mult > 1); this model has one residual stream")
    return value
# --hs-last's choices (a bare --hs-last is post-norm) and the final states each captures, in row order.
LAST_CHOICES = ("post-norm", "pre-norm", "both")
FINAL_ORDER = ("post-norm", "pre-norm")
_FINALS = {"post-norm": ("post-norm",), "pre-norm": ("pre-norm",), "both": FINAL_ORDER}


def parse_last(value) -> tuple:
    """--hs-last / SGLANG_HS_LAST as the final states captured, in row order: None, False or "" -> ();
    True, "1" or "post-norm" -> ("post-norm",); "pre-norm"; "both" -> ("post-norm", "pre-norm")."""
    if value is None or value is False or value == "" or value == "0":
        return ()
    if value is True or value == "1":
        return ("post-norm",)
    if value not in _FINALS:
        raise CaptureConfigError(f"--hs-last: {value!r} is not one of {', '.join(LAST_CHOICES)} (a bare --hs-last "
                                 "is post-norm)")
    return _FINALS[value]


def last_choice(finals: Sequence[str]) -> Optional[str]:
    """The --hs-last value that captures `finals` (None: no final state)."""
    finals = tuple(finals)
    return next((k for k, v in _FINALS.items() if v == finals), None)


def final_states(manifest: dict) -> tuple:
    """The final states a dump (or a manifest written from one) holds, in row order; a manifest of a
    version before --hs-last took a value says only `last` (post-norm)."""
    if "last_states" in manifest:
        return tuple(manifest["last_states"])
    return ("post-norm",) if manifest.get("last") else ()


class CaptureConfigError(ValueError):
    """Bad capture settings; the message is one line naming the flag or file."""


def parse_layer_ids(text: str) -> List[int]:
    """Parse `--hs-layers` ("2,4,5") into ints; only the format is checked here."""
    if text is None or not text.strip():
        raise CaptureConfigError("--hs-layers: empty; give comma-separated layer ids, e.g. --hs-layers 2,30,58")
    ids = []
    for part in text.split(","):
        part = part.strip()
        try:
            ids.append(int(part))
        except ValueError:
            raise CaptureConfigError(
                f"--hs-layers: {part!r} is not an integer; give comma-separated layer ids, e.g. 2,30,58"
            ) from None
    return ids


def default_layer_ids(num_layers: int) -> List[int]:
    """The EAGLE-3 choice [2, n//2, n-3] (61 layers -> [2, 30, 58])."""
    if num_layers < MIN_LAYERS_FOR_DEFAULT:
        raise CaptureConfigError(
            f"--hs-layers: the default [2, n//2, n-3] needs at least {MIN_LAYERS_FOR_DEFAULT} layers, "
            f"the model has {num_layers}; pass --hs-layers explicitly"
        )
    return [2, num_layers // 2, num_layers - 3]


def validate_layer_ids(ids: Sequence[int], num_layers: int, hc_mult: int = 1) -> List[int]:
    """`ids` checked for a model of `num_layers` layers: 0 <= i < n, strictly increasing. With hyper-connections
    (hc_mult > 1) id n is a layer id too: the streams leaving the last decoder layer, hc_head's input (what a
    DSpark draft of the last layer reads, e.g. DeepSeek-V4-Flash's dspark_target_layer_ids [40, 41, 42])."""
    ids = list(ids)
    top = num_layers + 1 if hc_mult > 1 else num_layers
    if not ids:
        raise CaptureConfigError("--hs-layers: empty; give at least one layer id")
    bad = [i for i in ids if i < 0]
    if bad:
        raise CaptureConfigError(f"--hs-layers: negative id {bad[0]}; ids are 0 <= i < {top}")
    big = [i for i in ids if i >= top]
    if big:
        raise CaptureConfigError(
            f"--hs-layers: id {big[0]} is out of range for a model with {num_layers} layers (0 <= i < {top}"
            + (f", id {num_layers} the streams leaving the last layer" if hc_mult > 1 else "")
            + f"); the final post-norm state (HF output_hidden_states[{num_layers}]) is --hs-last"
        )
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise CaptureConfigError(
            f"--hs-layers: duplicate id(s) {dup}; did you mean --hs-layers {','.join(map(str, sorted(set(ids))))}?"
        )
    if ids != sorted(ids):
        raise CaptureConfigError(
            f"--hs-layers: ids must be strictly increasing, got {','.join(map(str, ids))}; "
            f"did you mean --hs-layers {','.join(map(str, sorted(ids)))}?"
        )
    return ids


def _config_value(config, name: str):
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def check_architecture(architectures: Optional[Sequence[str]], where: str = "the model's config.json",
                       config=None) -> str:
    """The architecture to capture, or CaptureConfigError. `config` (the HF config, a dict or an object,
    with its `text_config`) is checked for DeepSeek Sparse Attention too: SGLang 0.5.23 turns DSA on by
    config, not by class (configs/model_config.py `is_deepseek_dsa`: DeepseekV3ForCausalLM and
    MistralLarge3ForCausalLM with `index_topk` set). DSA is served and tested as DeepseekV32ForCausalLM
    (patches/dsa_torch_native.py on the CPU engine); a config with `index_topk` under any other class
    name is refused, in one line naming the reason."""
    archs = list(architectures or [])
    if archs and archs[0] in REFUSED_ARCHITECTURES:
        raise CaptureConfigError(f"unsupported architecture {archs[0]!r} in {where}: "
                                 f"{REFUSED_ARCHITECTURES[archs[0]]}")
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CaptureConfigError(
            f"unsupported architecture {archs[0] if archs else None!r} in {where}: sglang-hs captures "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} models only"
        )
    if archs[0] in DSA_ARCHITECTURES or archs[0] in HC_ARCHITECTURES:  # V4's index_topk is its own CSA indexer
        return archs[0]
    text_config = _config_value(config, "text_config") if config is not None else None
    for part, cfg in (("", config), ("text_config.", text_config)):
        topk = _config_value(cfg, "index_topk") if cfg is not None else None
        if topk is not None:
            raise CaptureConfigError(
                f"unsupported model in {where}: {part}index_topk = {topk!r} makes SGLang serve {archs[0]} with "
                f"DeepSeek Sparse Attention (DSA, as DeepSeek-V3.2); sglang-hs serves and tests DSA as "
                f"{', '.join(DSA_ARCHITECTURES)} only, not under {archs[0]}")
    return archs[0]


@dataclass(frozen=True)
class CaptureSpec:
    layers: tuple
    finals: tuple  # the final states captured, in row order (FINAL_ORDER): () without --hs-last
    hidden_size: int
    num_layers: int
    hc_mult: int = 1  # residual streams per token (DeepSeek-V4's hyper-connections); 1 for every other model
    streams: str = "mean"  # with hc_mult > 1: "mean" (one row per layer id) or "full" (hc_mult rows)
    source: Optional[dict] = field(default=None, compare=False)  # where the layer ids came from (server/layer_source.py), for the manifest

    @property
    def rows_per_layer(self) -> int:
        return self.hc_mult if self.streams == "full" else 1

    @property
    def num_aux(self) -> int:
        """Aux rows per token: the layer ids times rows_per_layer (full streams: stream s of layer k is row
        k*hc_mult + s)."""
        return len(self.layers) * self.rows_per_layer

    @property
    def last(self) -> bool:
        """Any final state captured (--hs-last)."""
        return bool(self.finals)

    @property
    def num_final(self) -> int:
        return len(self.finals)

    @property
    def rows_per_token(self) -> int:
        return self.num_aux + self.num_final

    @property
    def post_norm(self) -> bool:
        return "post-norm" in self.finals

    @property
    def pre_norm(self) -> bool:
        return "pre-norm" in self.finals

    @classmethod
    def resolve(cls, layer_ids: Optional[Sequence[int]], last, num_layers: int, hidden_size: int,
                hc_mult: int = 1, streams: Optional[str] = None, source: Optional[dict] = None):
        """`last`: --hs-last's value (parse_last: a bool, "post-norm", "pre-norm" or "both"); `hc_mult`: the
        model's residual streams (hc_mult_of); `streams`: --hs-hc-streams (parse_streams); `source`: where the
        ids came from (layer_source.py; the launcher passes it to the server in SGLANG_HS_LAYER_SOURCE)."""
        ids = default_layer_ids(num_layers) if layer_ids is None else validate_layer_ids(layer_ids, num_layers, hc_mult)
        return cls(layers=tuple(ids), finals=parse_last(last), hidden_size=int(hidden_size),
                   num_layers=int(num_layers), hc_mult=int(hc_mult), streams=parse_streams(streams, int(hc_mult)),
                   source=source)

    def pack(self, aux, post_norm, pre_norm):
        """The copy's (aux [T, K'*H], last [T, H] or None) for the rows of this capture: the layers, then
        the final states in row order. With both, the post-norm state rides as one more aux row (a
        concatenation, [T, (K+1)*H]), so the copy kernels need no third input."""
        if not self.finals:
            return aux, None
        if self.finals == ("post-norm",):
            return aux, post_norm
        if self.finals == ("pre-norm",):
            return aux, pre_norm
        import torch

        return torch.cat([aux, post_norm], dim=1), pre_norm

    def describe(self) -> dict:
        out = {
            "layer_ids": list(self.layers),
            "last": self.last,
            "last_states": list(self.finals),
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            # null for id n of a hyper-connection model (hc_head's input is no HF output_hidden_states entry)
            "hf_output_hidden_states_index": [i if i < self.num_layers else None for i in self.layers]
            + ([self.num_layers] if self.post_norm else []),
            "convention": CONVENTION,
        }
        if self.source is not None:
            out["layer_source"] = self.source
        if self.hc_mult > 1:
            out.update(hc_mult=self.hc_mult, hc_streams=self.streams, rows_per_layer=self.rows_per_layer,
                       hc_convention=HC_CONVENTION[self.streams],
                       # SGLang 0.5.23's DeepseekV4Model captures dspark id j after decoder layer j (the
                       # stream mean of its output, HF output_hidden_states[j + 1]) unless the config sets
                       # hc_pre_from_prev_sublayer (then before layer j): ids for a checkpoint without it
                       dspark_layer_ids=dspark_layer_ids(self.layers))
        return out


def dspark_layer_ids(layers: Sequence[int], hc_pre_from_prev_sublayer: bool = False) -> Optional[List[int]]:
    """SGLang 0.5.23's `dspark_layers_to_capture` (a DSpark/EAGLE draft config's target_layer_ids for
    DeepSeek-V4) that make SGLang serve a drafter on the rows of these layer ids (states entering layer i):
    its standard path captures after layer j (id i -> j = i - 1), its hc_pre_from_prev_sublayer path before
    layer j (j = i). None when a layer id has no SGLang id (id 0, the embedding, on the standard path)."""
    ids = [i if hc_pre_from_prev_sublayer else i - 1 for i in layers]
    return None if any(i < 0 for i in ids) else ids


def v4_dspark_ids(spec: "CaptureSpec", hc_pre_from_prev_sublayer: bool = False) -> List[int]:
    """SGLang's dspark ids that capture `spec`'s layer ids on DeepSeek-V4 (dspark_layer_ids), or CaptureConfigError:
    id 0 on the standard path (the embedding is no layer's output there), id n on the hc_pre_from_prev_sublayer path
    (no layer n to capture before). The launcher and the V4 overlay."""
    ids = dspark_layer_ids(spec.layers, hc_pre_from_prev_sublayer)
    if ids is None:
        raise CaptureConfigError("--hs-layers: id 0 (the embedding) cannot be captured for DeepSeek-V4: SGLang's "
                                 "capture reads layer outputs there (id i is layer i-1's output); give ids >= 1")
    if hc_pre_from_prev_sublayer and spec.num_layers in spec.layers:
        raise CaptureConfigError(f"--hs-layers: id {spec.num_layers} (the streams leaving the last layer) cannot be "
                                 "captured with hc_pre_from_prev_sublayer: SGLang captures before each layer there, "
                                 f"and no layer {spec.num_layers} follows; give ids < {spec.num_layers}")
    return ids


def from_dspark_ids(ids: Sequence[int], hc_pre_from_prev_sublayer: bool = False) -> List[int]:
    """Our layer ids for SGLang 0.5.23's DSpark/DFlash target ids (`dspark_target_layer_ids`,
    `dflash_config.target_layer_ids`: decoder layer j's output), the inverse of dspark_layer_ids: j + 1
    (DeepseekV2's set_dflash_layers_to_capture adds 1; DeepseekV4's standard path captures after layer j), or j on
    V4's hc_pre_from_prev_sublayer path (captured before layer j)."""
    return [int(j) if hc_pre_from_prev_sublayer else int(j) + 1 for j in ids]


def from_eagle3_ids(ids: Sequence[int]) -> List[int]:
    """Our layer ids for an EAGLE-3 draft's `eagle_aux_hidden_state_layer_ids`, as SGLang 0.5.23's
    DeepseekV2ForCausalLM.set_eagle3_layers_to_capture uses them: the state entering layer i, every id plus 1 when the
    first is 1 (SpecForge's [1, n//2-1, n-4] are HF output_hidden_states [2, n//2, n-3]). The inverse of
    extract.manifest.draft_config's EAGLE-3 ids."""
    ids = [int(i) for i in ids]
    return [i + 1 for i in ids] if ids and ids[0] == 1 else ids


def node_dp_ranks(tp_size: int, dp_size: int, nnodes: int, node_rank: int) -> List[int]:
    """The DP attention ranks whose writer (attention-TP rank 0) runs on node `node_rank` of SGLang's
    --nnodes: node r runs TP ranks [r * tp / nnodes, (r + 1) * tp / nnodes) (SGLang 0.5.23,
    data_parallel_controller.launch_tensor_parallel_group, pp 1) and DP group d's writer is TP rank
    d * tp / dp. Without DP attention (dp_size 1) the one writer is TP rank 0, on node 0."""
    attn_tp = max(tp_size // max(dp_size, 1), 1)
    per_node = max(tp_size // max(nnodes, 1), 1)
    return [r // attn_tp for r in range(node_rank * per_node, (node_rank + 1) * per_node) if r % attn_tp == 0]
