"""FP8 (e4m3) storage of hidden-state rows, in the scheme speculators 0.9.0 reads (hs-connectors 0.9.0's
`FP8Transfer`): a safetensors file whose `hidden_states` [T, L, H] is float8_e4m3fn, beside
`hidden_states_scales`, float32 of the same rank with every dimension after the token one 1 ([T, 1, 1]:
one scale per token over all L layers), and the other tensors as they are. The reader dequantizes as
`hidden_states.to(D) * scales.to(D)` (D: its dequantize dtype, bf16 by default) and passes a file without
a scales tensor through unchanged.

Here a token's scale is its largest magnitude over the scaled dimensions divided by e4m3's largest finite
value (448), rounded UP to a bf16 value: the reader's cast of the scale to bf16 is then exact, and no
quantized value exceeds 448 (e4m3fn has no infinity: an overflow would be NaN). An all-zero row gets
scale 1.

`per_layer=True` gives every (token, layer) its own scale, [T, L, 1]. Not speculators' documented format
(one scale per token); FP8Transfer 0.9.0 reads it through broadcasting, which tests/unit/test_fp8.py
checks with the released reader. A shared scale costs the layers of small norm most: their values fall
toward e4m3's subnormal range, where the relative step grows.

Error bound per element x of a row with scale s (round to nearest): |deq - x| <= |x| * 2^-4 (normal range,
3 mantissa bits) or s * 2^-10 (subnormal range, |x| < s * 2^-6), plus the reader's bf16 rounding of the
product (|deq| * 2^-8 at most): error_bound() sums both terms, with margin.
"""
from __future__ import annotations

from typing import Tuple

import torch

SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
REL_STEP = 2.0 ** -4  # half an e4m3 ulp, relative, in the normal range
ABS_STEP = 2.0 ** -10  # half the subnormal spacing (2^-9), in units of the scale
SAVE_DTYPES = ("bf16", "fp8", "fp8-per-layer", "fp8-e5m2")  # fp8-e5m2: --format deepspec only (an unscaled cast)


class UnstorableRows(ValueError):
    """Hidden states the --save-dtype cannot store: the sample is skipped and counted under `reason`."""
    reason = "unstorable_rows"


class NonFiniteRows(UnstorableRows):
    """Hidden states holding inf or NaN: no FP8 scale stores them (e4m3fn has no infinity)."""
    reason = "non_finite_rows"


class FP8OutOfRange(UnstorableRows):
    """Hidden states beyond an unscaled FP8 dtype's largest finite value (--format deepspec's plain cast)."""
    reason = "fp8_out_of_range"


def skip_detail(err: UnstorableRows, save_dtype) -> str:
    """Why a sample was skipped, as the run reports it."""
    if isinstance(err, NonFiniteRows):
        return f"its hidden states hold inf or NaN, which --save-dtype {save_dtype} cannot store"
    return str(err)


def _ceil_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The least bf16 value >= x, for finite positive float32 x, as float32."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def scales_of(states: torch.Tensor, per_layer: bool = False) -> torch.Tensor:
    """float32 scales of states [T, L, H]: [T, 1, 1], or [T, L, 1] with per_layer."""
    dims = (2,) if per_layer else (1, 2)
    amax = states.float().abs().amax(dim=dims, keepdim=True)
    if not torch.isfinite(amax).all():
        raise NonFiniteRows("hidden states hold inf or NaN: they have no FP8 scale")
    scale = _ceil_to_bf16(amax / FP8_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize(states: torch.Tensor, per_layer: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, float32 scales) of states [T, L, H]."""
    if states.dim() != 3:
        raise ValueError(f"states must be [T, L, H], got shape {tuple(states.shape)}")
    scale = scales_of(states, per_layer)
    return (states.float() / scale).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What the reader hands to training: q.to(dtype) * scale.to(dtype)."""
    return q.to(dtype) * scale.to(dtype)


def error_bound(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the most |dequantize(quantize(states)) - states| may be (bf16 dequantization)."""
    return states.float().abs() * (REL_STEP + 2.0 ** -7) + scale * (ABS_STEP * 1.01)
