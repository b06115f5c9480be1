"""CPU engine, data-parallel attention: the padded sequence length of the torch_native backend.

With DP attention every step pads each group's batch to the same size across groups
(`ForwardBatch.prepare_mlp_sync_batch` -> `_pad_inputs_to_size`), and on CPU it asks the attention
backend for `get_cpu_graph_seq_len_fill_value()`, which in SGLang 0.5.23 only the Intel AMX backend
defines (intel_amx_backend.py: returns 1). Without AMX the CPU engine runs `torch_native`, and DP
attention fails at its first step (AttributeError). The patch gives TorchNativeAttnBackend the same
method with the same value: padded requests get sequence length 1, as on AMX. See the ledger in
sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION

FILL_VALUE = 1  # intel_amx_backend.IntelAMXAttnBackend.get_cpu_graph_seq_len_fill_value in 0.5.23


def get_cpu_graph_seq_len_fill_value(self):
    return FILL_VALUE


def apply():
    """Add the method where it is missing; returns what was there (None in 0.5.23). Idempotent."""
    import sglang
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch torch_native_cpu_pad targets sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}")
    original = getattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value", None)
    if original is None:
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = get_cpu_graph_seq_len_fill_value
    return original
