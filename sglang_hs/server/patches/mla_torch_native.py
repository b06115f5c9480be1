"""CPU engine: dispatch DeepSeek MLA attention under `torch_native` to the absorbed MLA path.

See the ledger in sglang_hs/server/patches/__init__.py. patches/0001-torch-native-mla-dispatch.patch is the
same change as a source patch; where it is applied, this one stands aside.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION

BACKEND = "torch_native"


def handle_attention_torch_native(attn, forward_batch):
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def apply():
    """Register the handler; returns the handler it replaced (None in 0.5.23) for tests to compare."""
    import sglang
    from sglang.srt.models.deepseek_common import attention_backend_handler as abh

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch mla_torch_native targets sglang {SGLANG_VERSION}, found {sglang.__version__}"
        )
    original = abh.AttentionBackendRegistry._handlers.get(BACKEND)
    if getattr(abh, "handle_attention_torch_native", None) is original is not None:
        return original  # sglang's source carries patches/0001: nothing to do
    abh.AttentionBackendRegistry.register(BACKEND, handle_attention_torch_native)
    return original
