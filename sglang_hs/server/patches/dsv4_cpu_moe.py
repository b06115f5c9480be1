"""CPU engine: DeepSeek-V4's clamped SwiGLU (swiglu_limit) in plain torch, for its shared and routed experts.

See the ledger in sglang_hs/server/patches/__init__.py. Applied in CPU mode only:

- `deepseek_v2.silu_and_mul_clamp` (the shared expert's activation when the config has a swiglu_limit; upstream a
  JIT-compiled CUDA kernel, which fails to build on the CPU engine): for CPU tensors
  silu(gate.clamp(max=limit)) * up.clamp(-limit, limit), as HF DeepseekV4MLP; any other device goes to upstream's.
- `fused_moe_native.moe_forward_native` (the CPU engine's routed experts): upstream applies plain SiluAndMul and
  ignores `moe_runner_config.swiglu_limit`; with a limit set, each expert's activation is the same clamped SwiGLU
  (HF DeepseekV4Experts._apply_gate). Without a limit it runs unchanged; a limit beside another activation or a
  gemm1_alpha is refused (NotImplementedError) rather than dropped.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from sglang_hs.version import SGLANG_VERSION

_lock = threading.Lock()


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[.., 2I] -> [.., I]: silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) (HF DeepseekV4)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _silu_and_mul_clamp(original):
    def silu_and_mul_clamp(input, output, swiglu_limit):
        if input.device.type != "cpu":
            return original(input, output, swiglu_limit)
        output.copy_(clamped_swiglu(input, float(swiglu_limit)))

    silu_and_mul_clamp.__wrapped__ = original
    return silu_and_mul_clamp


class _ClampedSiluAndMul(torch.nn.Module):
    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x):
        return clamped_swiglu(x, self.limit)


@contextlib.contextmanager
def _act(module, limit):
    original = module.SiluAndMul
    module.SiluAndMul = lambda: _ClampedSiluAndMul(limit)
    try:
        yield
    finally:
        module.SiluAndMul = original


def _with_limit(original):
    from sglang.srt.layers.moe import fused_moe_native

    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        limit = getattr(moe_runner_config, "swiglu_limit", None)
        if limit is None:
            return original(layer, x, topk_output, moe_runner_config)
        if moe_runner_config.activation != "silu" or moe_runner_config.gemm1_alpha is not None:
            # upstream's native MoE would run without the limit: rows unlike HF's, silently. Refused instead.
            raise NotImplementedError(
                f"sglang-hs dsv4_cpu_moe: swiglu_limit {limit} with activation {moe_runner_config.activation!r} and "
                f"gemm1_alpha {moe_runner_config.gemm1_alpha!r}: the clamped SwiGLU is written for silu without "
                "gemm1_alpha only (HF DeepseekV4); the CPU engine would drop the limit")
        with _lock, _act(fused_moe_native, float(limit)):
            return original(layer, x, topk_output, moe_runner_config)

    moe_forward_native.__wrapped__ = original
    return moe_forward_native


def apply() -> dict:
    import sglang
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.models import deepseek_v2

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch dsv4_cpu_moe targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    originals = {"deepseek_v2.silu_and_mul_clamp": deepseek_v2.silu_and_mul_clamp,
                 "fused_moe_native.moe_forward_native": fused_moe_native.moe_forward_native}
    deepseek_v2.silu_and_mul_clamp = _silu_and_mul_clamp(deepseek_v2.silu_and_mul_clamp)
    fused_moe_native.moe_forward_native = _with_limit(fused_moe_native.moe_forward_native)
    return originals
