"""The sglang-hs overlay of SGLang's DeepseekV4ForCausalLM (DeepSeek-V4, V4-Flash).

DeepSeek-V4's residual is `hc_mult` parallel streams per token (manifold hyper-connections). The capture
uses SGLang 0.5.23's own answer for its DSpark drafters (`DeepseekV4Model.dspark_layers_to_capture`,
`mhc_stream_mean`): layer id i is the streams' mean entering decoder layer i (HF
`output_hidden_states[i].mean(-2)`), the final post-norm state the head's collapse (`hc_head`) after the
final norm (HF `output_hidden_states[n]`), the pre-norm state the head's collapse (the final norm's input).
With `--hs-hc-streams full` every stream is kept: hc_mult rows per layer id (runtime patch
sglang_hs/server/patches/hc_full_streams.py widens SGLang's aux packer and writes the streams instead of their
mean). Layer ids are handed to SGLang as its dspark ids (capture_spec.dspark_layer_ids): its standard
path captures after layer j, so id i is j = i - 1 (with `hc_pre_from_prev_sublayer` before layer j: j = i). Id n
(num_hidden_layers) is a layer id here too: the streams leaving the last layer (hc_head's input), SGLang's dspark id
n - 1, which DeepSeek-V4-Flash-DSpark's own dspark_target_layer_ids [40, 41, 42] name (server/layer_source.py).

The inner model returns `((hidden, pre_hc_head), aux)` of one fixed structure on every path, `aux`
[T, num_aux*H] (+ the pre-norm state, [T, H], with --hs-last pre-norm/both), as the V2/V3 overlay does;
the outer forward copies the rows and calls the logits processor as upstream does.

On the CPU engine SGLang 0.5.23 has no V4 forward (its attention is the FlashMLA `dsv4` backend over
DeepSeekV4TokenToKVPool); the runtime patches dsv4_torch_native / dsv4_cpu_moe / dsv4_cpu_server_args serve its
sliding-window, compressed sparse (ratio 4) and heavily compressed (ratio 128) layers there (tests/e2e/test_v4_cpu.py),
and the launcher refuses V4.1's other ratios in one line.
"""
from __future__ import annotations

import sys

import torch
from sglang.srt.models import deepseek_v4 as upstream

from sglang_hs import envs
from sglang_hs.server.capture_spec import CaptureSpec, hc_mult_of, v4_dspark_ids
from sglang_hs.server.models.deepseek_v2 import (_HiddenStateOverlay, _layer_split, _pre_norm_capturing,
                                                 fixed_capture_output, take_layers)

OriginalDeepseekV4ForCausalLM = upstream.DeepseekV4ForCausalLM
OriginalDeepseekV4Model = upstream.DeepseekV4Model


def v4_capture_ids(spec: CaptureSpec, config) -> list:
    """SGLang's dspark ids for `spec`'s layer ids under this config (capture_spec.v4_dspark_ids)."""
    return v4_dspark_ids(spec, bool(getattr(config, "hc_pre_from_prev_sublayer", False)))


class _CapturingDeepseekV4Model(OriginalDeepseekV4Model):
    """The inner model with its output fixed when capture is on (by `__class__` assignment; no state)."""

    hs_spec = None
    # SGLang's dspark ids captured: ours, or ours and a DSpark draft's (set_dspark_layers_to_capture)
    hs_captured = None

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        spec = self.hs_spec
        if spec is not None and spec.pre_norm:
            self.norm.hs_pre_norm = None
        out = super().forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        if spec is None:
            return out
        mode = forward_batch.forward_mode.name
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], tuple) and len(out[0]) == 2):
            raise RuntimeError(f"sglang-hs: unexpected DeepSeek-V4 model output {type(out).__name__} in a {mode} "
                               "batch (expected ((hidden, pre_hc_head), aux))")
        (hidden, pre_hc_head), aux = out
        hidden, aux = fixed_capture_output((hidden, aux), spec, mode, self.hs_captured)
        if spec.pre_norm:  # returned with the layers (see deepseek_v2._CapturingDeepseekModel.forward)
            pre, self.norm.hs_pre_norm = self.norm.hs_pre_norm, None
            if pre is None or pre.shape != hidden.shape:
                if hidden.shape[0] == 0:
                    pre = hidden
                else:
                    raise RuntimeError(f"sglang-hs: no pre-norm final state of shape {tuple(hidden.shape)} in a "
                                       f"{hidden.shape[0]}-row {mode} batch (--hs-last pre-norm/both)")
            aux = torch.cat([aux, pre.to(hidden.dtype)], dim=1)
        return (hidden, pre_hc_head), aux


class DeepseekV4ForCausalLM(_HiddenStateOverlay, OriginalDeepseekV4ForCausalLM):
    def _hs_setup_capture(self, config) -> None:
        from sglang_hs.server.patches import hc_full_streams

        self.hs_spec = CaptureSpec.resolve(envs.SGLANG_HS_LAYERS, envs.SGLANG_HS_LAST, config.num_hidden_layers,
                                           config.hidden_size, hc_mult=hc_mult_of(config),
                                           streams=envs.SGLANG_HS_HC_STREAMS, source=envs.SGLANG_HS_LAYER_SOURCE)
        ids = v4_capture_ids(self.hs_spec, config)
        if self.hs_spec.streams == "full":
            hc_full_streams.apply(self.hs_spec.hc_mult)
        self.capture_aux_hidden_states = True
        self.model.dspark_layers_to_capture = ids
        self.model.__class__ = _CapturingDeepseekV4Model
        self.model.hs_spec = self.hs_spec
        self.model.hs_captured = tuple(ids)
        self.hs_ours = tuple(ids)
        if self.hs_spec.pre_norm:
            _pre_norm_capturing(self.model.norm)

    def set_eagle3_layers_to_capture(self, layer_ids=None):  # upstream V4 has none: EAGLE-3 is not served
        raise RuntimeError("sglang-hs: EAGLE-3 aux capture is not supported for DeepSeek-V4 (SGLang 0.5.23's "
                           "DeepseekV4ForCausalLM has none)")

    hs_dspark = None  # with a DSpark draft: (our layers' places in the capture, its layers' places)

    def set_dspark_layers_to_capture(self, layer_ids):
        """A DSpark draft's target layers beside ours (--speculative-algorithm DSPARK; SGLang's DSparkWorkerV2 reads
        them from the prefill's and each verify pass's logits output, hidden_states, to inject into the draft's KV):
        the model captures the union of its ids and ours (SGLang's dspark ids both), once each, and `forward` hands
        each side its own layers, the draft's in ascending order as upstream packs them, as the streams' mean (under
        --hs-hc-streams full the capture holds the streams: their mean is taken for the draft). Called by SGLang
        (attention_backend_setup.configure_aux_hidden_state_capture) before any forward."""
        if self.hs_spec is None:
            return super().set_dspark_layers_to_capture(layer_ids)
        if not self.pp_group.is_last_rank:
            return None
        n = self.config.num_hidden_layers
        draft = [int(i) for i in (layer_ids or [])]
        if not draft or len(set(draft)) != len(draft) or any(not 0 <= i < n for i in draft):
            raise RuntimeError(f"sglang-hs: DSpark target layer ids {layer_ids}: expected at least one, distinct, each "
                               f"in [0, {n}) (the draft config's dspark_target_layer_ids)")
        ours = self.hs_ours
        captured = tuple(sorted(set(ours) | set(draft)))
        self.model.dspark_layers_to_capture = list(captured)
        self.model.hs_captured = captured
        self.hs_dspark = (_layer_split(captured, list(ours)), _layer_split(captured, sorted(draft)))
        print(f"[sglang-hs] DSpark draft reads the target's layers {sorted(draft)} (SGLang's dspark ids); capturing "
              f"{list(captured)} once: ours {list(ours)}", file=sys.stderr, flush=True)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        if self.hs_spec is None:
            return super().forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        input_ids, input_embeds = self.prepare_language_model_inputs(input_ids, forward_batch, input_embeds)
        with upstream.get_attn_tp_context().maybe_input_scattered(forward_batch):
            (hidden, _pre_hc_head), aux = self.model.forward(input_ids, positions, forward_batch, input_embeds,
                                                             pp_proxy_tensors)
        if getattr(self.model, "late_layer_start", None) is not None:
            raise RuntimeError("sglang-hs: decoder SWA bounded replay is on (late layers run over each request's "
                               "last SWA window only): rows would be missing; turn it off with --hs-dump-dir")
        pre = None
        H, rows = self.hs_spec.hidden_size, self.hs_spec.rows_per_layer
        if self.hs_spec.pre_norm:
            k = len(self.model.hs_captured) * rows * H
            aux, pre = aux[:, :k], aux[:, k:]
        draft_aux = None
        if self.hs_dspark is not None:
            ours, theirs = self.hs_dspark
            aux, draft_aux = take_layers(aux, ours, rows * H), take_layers(aux, theirs, rows * H)
            if rows > 1:  # --hs-hc-streams full: the draft reads each layer's streams' mean, as upstream captures it
                draft_aux = draft_aux.reshape(draft_aux.shape[0], -1, rows, H).mean(2).flatten(1)
        self.hs_status.saw_aux(tuple(aux.shape))
        if self.hs_writer is not None:
            loc = getattr(forward_batch, "out_cache_loc_virtual", None)
            rows, last = self.hs_spec.pack(aux, hidden, pre)
            self.hs_writer.copy(rows, last, forward_batch.out_cache_loc if loc is None else loc)
        # the streams leaving the last layer (hc_head's input) are what SGLang hands a V4 MTP draft
        # (DeepseekV4ModelNextN reads spec_info.hidden_states as [T, hc_mult * H]), as upstream's forward does
        # (with a DSpark draft, as upstream: its layers as the aux states and no pre-hc-head state)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, draft_aux,
                                     hidden_states_before_norm=_pre_hc_head if draft_aux is None else None)


EntryClass = [DeepseekV4ForCausalLM]
