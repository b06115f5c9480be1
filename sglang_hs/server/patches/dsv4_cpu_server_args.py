"""CPU engine: resolve DeepSeek-V4's server arguments without a GPU.

See the ledger in sglang_hs/server/patches/__init__.py. SGLang 0.5.23 resolves a DeepseekV4ForCausalLM config for
its CUDA kernels only (arg_groups/model_overrides/deepseek_v4.py, arg_groups/overrides.py
_deepseek_v4_kv_cache_dtype): the "dsv4" attention backend (FlashMLA over DeepSeekV4TokenToKVPool), 256-token
pages, an FP8 (or bf16) KV cache and the hybrid SWA memory pools. On the CPU engine V4's attention is
sglang_hs/server/patches/dsv4_torch_native.py, which reads its keys from SGLang's plain MHA pool (one KV head of
head_dim, in the model's dtype) through req_to_token: so torch_native (its metadata only), one-token pages
(prefix-cache hits token-exact, as for V3), no hybrid SWA pools (every key is kept; the window is applied by the
attention) and the KV cache in the model's dtype ("auto").

`CPU_ENV` are SGLang settings put into this process's environment when SGLang resolves a DeepseekV4ForCausalLM
config (the model override below; unless set already), so that the scheduler processes it spawns read them (some when SGLang's deepseek_v4 module is imported): the TileLang /
DeepGEMM / fused mHC kernels, the fused hash top-k and the FP8 wo_a GEMM are off, so load_weights skips the mHC
prewarm (a CUDA query) and no CUDA-only kernel is chosen. They concern DeepSeek-V4's code paths only.
"""
from __future__ import annotations

import os

from sglang_hs.version import SGLANG_VERSION

ARCH = "DeepseekV4ForCausalLM"
CPU_ENV = {"SGLANG_OPT_USE_TILELANG_MHC_PRE": "0", "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
           "SGLANG_OPT_FUSE_MHC_POST_PRE": "0", "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
           "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0", "SGLANG_OPT_FP8_WO_A_GEMM": "0"}


def _cpu_dsv4_overrides(server_args, hf_config) -> dict:
    """Declared after upstream's for DeepseekV4ForCausalLM, so it wins over "dsv4" and 256-token pages. Puts
    CPU_ENV into the environment the schedulers inherit: a V4 server's only (a V2/V3 server never gets them)."""
    set_cpu_env(os.environ)
    return {"attention_backend": "torch_native", "page_size": 1, "disable_hybrid_swa_memory": True}


def _kv_cache_dtype_on_cpu(original):
    def pass_(view) -> dict:
        if getattr(view, "device", None) == "cpu":
            return {}  # "auto": the model's dtype, which the plain MHA pool takes
        return original(view)

    pass_.__wrapped__ = original
    return pass_


class _DeviceView:
    """A resolving view of the server arguments that answers `device` as "cuda" and everything else as is."""

    def __init__(self, view):
        object.__setattr__(self, "_view", view)

    def __getattr__(self, name):
        return "cuda" if name == "device" else getattr(self._view, name)


def _dspark_on_cpu(original, hook):
    """speculative_hook._handle_dspark refuses every device but CUDA, NPU and XPU in its first line; on the CPU
    engine the rest of it (the draft path, steps 1, top-k 1, gamma from the draft config, the verify window) runs
    as upstream, reading the device as "cuda" (it reads it only for that check and its NPU branches)."""
    def handle(server_args):
        if getattr(hook.resolving_view(server_args), "device", None) != "cpu":
            return original(server_args)
        view = hook.resolving_view
        hook.resolving_view = lambda args: _DeviceView(view(args))
        try:
            return original(server_args)
        finally:
            hook.resolving_view = view

    handle.__wrapped__ = original
    return handle


def set_cpu_env(environ) -> dict:
    """CPU_ENV into `environ` where unset; returns what was set."""
    added = {k: v for k, v in CPU_ENV.items() if k not in environ}
    environ.update(added)
    return added


def apply() -> dict:
    import sglang
    from sglang.srt.arg_groups import deepseek_v4_hook, model_override_base

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch dsv4_cpu_server_args targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    from sglang.srt.arg_groups.model_overrides import deepseek_v4 as _registers_upstream_first  # noqa: F401

    originals = {"deepseek_v4_hook._deepseek_v4_kv_cache_dtype": deepseek_v4_hook._deepseek_v4_kv_cache_dtype}
    model_override_base.register_model_override(ARCH)(_cpu_dsv4_overrides)
    deepseek_v4_hook._deepseek_v4_kv_cache_dtype = _kv_cache_dtype_on_cpu(deepseek_v4_hook._deepseek_v4_kv_cache_dtype)
    from sglang.srt.arg_groups import speculative_hook

    originals["speculative_hook._handle_dspark"] = speculative_hook._handle_dspark
    speculative_hook._handle_dspark = _dspark_on_cpu(speculative_hook._handle_dspark, speculative_hook)
    return originals
