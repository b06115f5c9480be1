"""CPU engine: resolve a DSA model's server arguments (DeepSeek-V3.2) without a GPU.

See the ledger in sglang_hs/server/patches/__init__.py. SGLang 0.5.23 treats every platform that is neither NPU
nor XPU as a CUDA/ROCm GPU when it resolves a DSA config: it queries `torch.cuda.get_device_capability()`
(RuntimeError "Found no NVIDIA driver"), picks FP8 KV-cache and DSA kernel backends, the "dsa" attention
backend and 64-token pages. On the CPU engine the DSA path is sglang_hs/server/patches/dsa_torch_native.py, which
runs under the torch_native backend; one-token pages keep prefix-cache hits token-exact, as for V3.
"""
from __future__ import annotations

import contextlib

from sglang_hs.version import SGLANG_VERSION


def _cpu_dsa_overrides(server_args, hf_config) -> dict:
    """Declared last for the DSA architectures, so it wins over upstream's "dsa" backend and 64-token pages."""
    from sglang.srt.configs.model_config import is_deepseek_dsa

    if not is_deepseek_dsa(hf_config):
        return {}
    # Whatever the CPU default or the flag (intel_amx has no sparse path either): torch_native.
    return {"attention_backend": "torch_native", "page_size": 1}


@contextlib.contextmanager
def _no_cuda_capability():
    """Within model-specific resolution only: the GPU branch's capability query answers (0, 0)."""
    import torch

    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (0, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original


def _skip(view) -> dict:
    return {}


def apply() -> dict:
    import sglang
    from sglang.srt.arg_groups import model_hook, model_override_base

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch dsa_cpu_server_args targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    from sglang.srt.arg_groups.model_overrides import deepseek_v2 as _registers_upstream_first  # noqa: F401

    for arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
                 "MistralLarge3ForCausalLM"):
        model_override_base.register_model_override(arch)(_cpu_dsa_overrides)
    originals = {"handle_model_specific_adjustments": model_hook.handle_model_specific_adjustments,
                 "_dsa_kv_cache_dtype_default": model_hook._dsa_kv_cache_dtype_default,
                 "_dsa_split_backend_resolution": model_hook._dsa_split_backend_resolution}
    original = model_hook.handle_model_specific_adjustments

    def handle_model_specific_adjustments(server_args):
        with _no_cuda_capability():
            return original(server_args)

    model_hook.handle_model_specific_adjustments = handle_model_specific_adjustments  # imported at call time
    # GPU kernel choices (FP8 KV cache, DSA prefill/decode kernels); skipped on the CPU engine.
    model_hook._dsa_kv_cache_dtype_default = _skip
    model_hook._dsa_split_backend_resolution = _skip
    return originals
