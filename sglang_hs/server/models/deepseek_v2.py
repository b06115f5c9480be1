"""The sglang-hs overlay of SGLang's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM.

Registration: the launcher sets SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_hs.server.models. SGLang's model
registry then imports this module in every process that builds a model and registers `EntryClass` by
class name, external classes winning over built-ins; our classes keep the upstream names, so a
checkpoint declaring DeepseekV3ForCausalLM resolves to the subclass below. We do not use a
`sglang.srt.plugins` entry point for this: the registry is the documented way to provide a model
class. The registry only logs an import error of this module and silently serves the built-in class,
so the overlay announces itself (a `[sglang-hs] overlay ready` line on stderr, a status file in the
dump dir) and the launcher refuses to report the server ready without that announcement.

With capture on (SGLANG_HS_DUMP_DIR set), the inner model returns `(hidden, aux)` of one fixed
structure on every path (warm-up, dummy and idle batches, graph capture, chunked prefill, decode):
`hidden` [T, H] post-norm, `aux` [T, K*H], the K layers in ascending id order. `forward` never unpacks
a plain tensor: anything else stops the server with a clear error instead of a hang. With `--hs-last
pre-norm` or `both` the final norm module is a `_PreNormCapturingNorm`, which keeps the final residual
stream it is handed (its input; with a residual, the sum it returns beside the normed state) for the
forward to copy with the rest of the step's rows.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch
from sglang.srt.models import deepseek_v2 as upstream

from sglang_hs import envs
from sglang_hs.server.capture_spec import CaptureSpec, check_architecture
from sglang_hs.server.overlay_status import OverlayStatus

if envs.SGLANG_HS_TEST_BREAK_OVERLAY:
    raise ImportError("sglang-hs test switch SGLANG_HS_TEST_BREAK_OVERLAY is set")

OriginalDeepseekV2ForCausalLM = upstream.DeepseekV2ForCausalLM
OriginalDeepseekV3ForCausalLM = upstream.DeepseekV3ForCausalLM
OriginalDeepseekV2Model = upstream.DeepseekV2Model


def _maybe_hang(phase: str) -> None:
    """Test-only switch (SGLANG_HS_TEST_HANG_PHASE) that plants a start-up hang: PHASE sleeps (like a
    wait on a lock or a dead peer), PHASE-busy spins a core (like a warm-up retrying a failing forward)."""
    want = envs.SGLANG_HS_TEST_HANG_PHASE
    if want in (phase, f"{phase}-busy"):
        print(f"[sglang-hs] test switch: hanging in phase {want!r}", file=sys.stderr, flush=True)
        busy = want.endswith("-busy")
        while True:
            if not busy:
                time.sleep(1)


def fixed_capture_output(out, spec: CaptureSpec, mode: str, captured=None):
    """Normalise the inner model's output to `(hidden [T, H], aux [T, K*H])`, or raise; K is the number of
    layers the inner model captures (`captured`: ours, or ours and an EAGLE-3 draft's; default ours).

    Upstream returns a bare tensor when no layer appended a capture (0-row idle batches): a 2-row bare
    tensor would then be silently split by `hidden, aux = ...`. Pure shape logic and, for a 0-row
    batch, an empty tensor: safe inside a captured CUDA graph.
    """
    layers = spec.layers if captured is None else captured
    width = len(layers) * spec.rows_per_layer * spec.hidden_size
    if isinstance(out, torch.Tensor):
        if out.shape[0] == 0:
            return out, out.new_empty((0, width))
        raise RuntimeError(
            f"sglang-hs: the model captured no aux layer for a {out.shape[0]}-row {mode} batch "
            f"(layers {list(layers)})"
        )
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise RuntimeError(f"sglang-hs: unexpected inner model output {type(out).__name__} in a {mode} batch")
    hidden, aux = out
    if aux.shape != (hidden.shape[0], width):
        raise RuntimeError(
            f"sglang-hs: aux hidden states of shape {tuple(aux.shape)} in a {mode} batch, expected "
            f"({hidden.shape[0]}, {width}) for layers {list(layers)}"
        )
    return hidden, aux


def _layer_split(captured, wanted):
    """Where the `wanted` layers sit among the `captured` ones (both ascending): a `slice` of layer positions
    when they are contiguous, else the tuple of positions."""
    pos = [captured.index(i) for i in wanted]
    if pos == list(range(pos[0], pos[0] + len(pos))):
        return slice(pos[0], pos[0] + len(pos))
    return tuple(pos)


def take_layers(aux, where, hidden_size: int):
    """The layers at `where` (`_layer_split`) of a [T, K*H] aux tensor: a view for a slice, else a copy."""
    if isinstance(where, slice):
        return aux[:, where.start * hidden_size:where.stop * hidden_size]
    return torch.cat([aux[:, i * hidden_size:(i + 1) * hidden_size] for i in where], dim=1)


class _PreNormCapturingNorm:
    """Mixed in before the final norm's class (by `__class__` assignment, no state of its own but the last
    input): keeps the state entering the norm in `hs_pre_norm`, the final residual stream, which is HF's
    `model.model.norm` input. Upstream calls the final norm as `norm(x)` or, with the residual kept apart,
    `norm(x, residual)`, which returns `(normed, x + residual)` (fused kernels update `residual` in place
    to that sum): the second is the pre-norm state, as the kernel summed it."""

    hs_pre_norm = None

    def forward(self, x, residual=None, *args, **kwargs):
        if residual is None:
            out = super().forward(x, *args, **kwargs)
            self.hs_pre_norm = x
            return out
        out = super().forward(x, residual, *args, **kwargs)
        self.hs_pre_norm = out[1]
        return out


def _pre_norm_capturing(norm) -> None:
    cls = type(norm)
    norm.__class__ = type(f"PreNormCapturing{cls.__name__}", (_PreNormCapturingNorm, cls), {})


class _CapturingDeepseekModel(OriginalDeepseekV2Model):
    """The inner model with its output fixed by `fixed_capture_output` when capture is on.

    Instances get this class by `__class__` assignment in the overlay's constructor (upstream builds
    `self.model` inline); it adds no state. SGLang's prefill graph runner captures this forward.
    """

    hs_spec: Optional[CaptureSpec] = None
    hs_captured: Optional[tuple] = None  # the ids `layers_to_capture` holds, ascending: ours, or ours and EAGLE-3's

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        if self.hs_spec is not None and self.hs_spec.pre_norm:
            self.norm.hs_pre_norm = None  # a batch that skips the norm (idle) must not leave the last one's
        out = super().forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        if self.hs_spec is None:
            return out
        mode = forward_batch.forward_mode.name
        hidden, aux = fixed_capture_output(out, self.hs_spec, mode, self.hs_captured)
        if self.hs_spec.pre_norm:
            # Returned with the layers, [T, (K+1)*H], never left on the norm for the outer forward to pick up:
            # SGLang's prefill CUDA graphs (breakable and full) capture this forward alone and, at replay, hand
            # the outer forward the graph's outputs without running any of this Python (the runner swaps
            # `forward` for its replay), so only what this forward returns is refreshed by a replay.
            aux = torch.cat([aux, self.hs_take_pre_norm(hidden, mode)], dim=1)
        return hidden, aux

    def hs_take_pre_norm(self, hidden: torch.Tensor, mode: str) -> torch.Tensor:
        """The final pre-norm state of the step just run, [T, H] in the model's dtype."""
        pre, self.norm.hs_pre_norm = self.norm.hs_pre_norm, None
        if pre is None:
            # upstream skips the final norm in an IDLE batch (DP attention: this group has no requests); its rows,
            # none or padding (DeepSeek-V3.2's IDLE batches carry a padded row), are never captured
            if hidden.shape[0] == 0 or mode == "IDLE":
                return hidden
            raise RuntimeError(f"sglang-hs: the final norm did not run in a {hidden.shape[0]}-row {mode} batch, "
                               "so there is no pre-norm final state (--hs-last pre-norm/both)")
        if pre.shape != hidden.shape:
            raise RuntimeError(f"sglang-hs: pre-norm final state of shape {tuple(pre.shape)} in a {mode} batch, "
                               f"expected {tuple(hidden.shape)}")
        return pre if pre.dtype == hidden.dtype else pre.to(hidden.dtype)


class _HiddenStateOverlay:
    """Mixed in before the upstream class: runs the patches, the upstream constructor, then ours."""

    hs_check_architecture = True
    hs_eagle3 = None  # with an EAGLE-3 draft: (our layers' places in the capture, its layers' places)

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        from sglang_hs.server import patches

        applied = sorted(patches.apply())
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self._hs_patches = applied
        self._hs_init(config)

    def _hs_init(self, config) -> None:
        dump_dir = envs.SGLANG_HS_DUMP_DIR
        self.hs_spec = None
        self.hs_status = None
        self.hs_writer = None  # set by the capture hooks once the KV pool is sized (writer ranks only)
        if dump_dir:
            if self.hs_check_architecture:  # a wrapper building this as its language model checks its own
                check_architecture(getattr(config, "architectures", None), where="the served model's config",
                                   config=config)
            self._hs_setup_capture(config)
            self.hs_status = OverlayStatus(dump_dir, type(self).__name__, self.hs_spec)
        _maybe_hang("load")
        self._hs_hang_in_warmup = envs.SGLANG_HS_TEST_HANG_PHASE in ("warmup", "warmup-busy")
        print(
            f"[sglang-hs] overlay ready: {type(self).__module__}.{type(self).__name__} pid={os.getpid()} "
            f"capture={'on ' + str(self.hs_spec.describe()['layer_ids']) if self.hs_spec else 'off'}"
            f"{' +last ' + '+'.join(self.hs_spec.finals) if self.hs_spec and self.hs_spec.last else ''} "
            f"runtime-patches={self._hs_patches}",
            file=sys.stderr,
            flush=True,
        )

    def _hs_setup_capture(self, config) -> None:
        """Resolve `hs_spec` and make the inner model capture it (a subclass for another model family
        overrides this alone)."""
        self.hs_spec = CaptureSpec.resolve(
            envs.SGLANG_HS_LAYERS, envs.SGLANG_HS_LAST, config.num_hidden_layers, config.hidden_size,
            source=envs.SGLANG_HS_LAYER_SOURCE)
        # Set on the model directly, before any CUDA-graph capture, never via
        # set_eagle3_layers_to_capture (which shifts ids by one when the first is 1).
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = list(self.hs_spec.layers)
        self.model.__class__ = _CapturingDeepseekModel
        self.model.hs_spec = self.hs_spec
        self.model.hs_captured = tuple(self.hs_spec.layers)
        if self.hs_spec.pre_norm:
            _pre_norm_capturing(self.model.norm)

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        """An EAGLE-3 draft's aux states beside ours: SGLang resolves the draft's ids as it always does (its
        default [2, L // 2, L - 3], or the draft config's ids shifted by one when the first is 1), then the
        model captures the union of those and ours, once each, and `forward` hands each side its own layers
        (the draft's in ascending order, as SGLang packs them). Called by SGLang before any graph capture."""
        if self.hs_spec is None:
            return super().set_eagle3_layers_to_capture(layer_ids)
        ours = tuple(self.hs_spec.layers)
        if not self.pp_group.is_last_rank:  # upstream captures nothing for the draft there either
            return None
        super().set_eagle3_layers_to_capture(layer_ids)
        draft = list(self.model.layers_to_capture)
        n = self.config.num_hidden_layers
        if not draft or len(set(draft)) != len(draft) or any(not 0 <= i < n for i in draft):
            raise RuntimeError(
                f"sglang-hs: EAGLE-3 aux layer ids {layer_ids} resolve to {draft} in SGLang's convention (+1 "
                f"when the first is 1): expected at least one, distinct, each in [0, {n}) (the draft config's "
                "eagle_config.eagle_aux_hidden_state_layer_ids, or --return-aux-hidden-state-layer-ids)")
        captured = tuple(sorted(set(ours) | set(draft)))
        self.model.layers_to_capture = list(captured)
        self.model.hs_captured = captured
        self.hs_eagle3 = (_layer_split(captured, ours), _layer_split(captured, sorted(draft)))
        print(f"[sglang-hs] EAGLE-3 draft reads the target's layers {sorted(draft)} (SGLang's ids); capturing "
              f"{list(captured)} once: ours {list(ours)}", file=sys.stderr, flush=True)

    def set_dflash_layers_to_capture(self, layer_ids):
        if self.hs_spec is not None:  # refused at launch (serve.check_server_args); never take our layers over
            raise RuntimeError("sglang-hs: DFlash aux capture cannot run together with --hs-dump-dir")
        return super().set_dflash_layers_to_capture(layer_ids)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        if self.hs_spec is None:
            return super().forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        with upstream.get_attn_tp_context().maybe_input_scattered(forward_batch):
            hidden, aux = self.model(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        if self._hs_hang_in_warmup and getattr(forward_batch, "rids", None):
            _maybe_hang("warmup")
        pre = None
        H = self.hs_spec.hidden_size
        if self.hs_spec.pre_norm:  # the inner model returned it after the layers (_CapturingDeepseekModel.forward)
            k = len(self.model.hs_captured) * H
            aux, pre = aux[:, :k], aux[:, k:]  # views: the copies take rows of any stride
        draft_aux = None
        if self.hs_eagle3 is not None:
            ours, theirs = self.hs_eagle3
            aux, draft_aux = take_layers(aux, ours, H), take_layers(aux, theirs, H)
        self.hs_status.saw_aux(tuple(aux.shape))  # steps are counted by the ModelRunner.forward hook
        if self.hs_writer is not None:
            loc = getattr(forward_batch, "out_cache_loc_virtual", None)
            rows, last = self.hs_spec.pack(aux, hidden, pre)
            self.hs_writer.copy(rows, last, forward_batch.out_cache_loc if loc is None else loc)
        # Our layers stay ours: the logits processor gets only an EAGLE-3 draft's (None without one, so SGLang's
        # own aux JSON path stays off).
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, draft_aux)


class DeepseekV2ForCausalLM(_HiddenStateOverlay, OriginalDeepseekV2ForCausalLM):
    pass


class DeepseekV3ForCausalLM(_HiddenStateOverlay, OriginalDeepseekV3ForCausalLM):
    pass


class DeepseekV32ForCausalLM(_HiddenStateOverlay, upstream.DeepseekV32ForCausalLM):
    """DeepSeek-V3.2: V3 plus the DSA indexer; capture is V3's (the indexer only picks attention's keys)."""


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM]
