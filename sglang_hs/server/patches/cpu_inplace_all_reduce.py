"""CPU engine, DP attention: give SGLang's `sglang::inplace_all_reduce` op a CPU kernel.

See the ledger in sglang_hs/server/patches/__init__.py. SGLang 0.5.23 registers its custom ops
(`utils/custom_op.py register_custom_op` -> `utils/common.py direct_register_custom_op`) for one dispatch key, CUDA
unless the platform is NPU/XPU/MUSA/out-of-tree: none for the CPU engine. `_dp_gather_via_all_reduce`
(layers/dp_attention.py) gathers integer tensors across the DP-attention ranks with `inplace_all_reduce` (a
floating-point one takes tensor_model_parallel_all_reduce instead), and DeepSeek-V4 gathers its token ids that way
at every forward under DP attention (DeepseekV4Model._forward_impl: input_ids_global, which the hash-routed layers
read), so a V4 server with --enable-dp-attention fails at its first forward ("Could not run
'sglang::inplace_all_reduce' with arguments from the 'CPU' backend"). The patch registers the op's body written out
(`GroupCoordinator._all_reduce_in_place` of the named group: torch.distributed.all_reduce on the group's gloo
device group, as for every other CPU all-reduce) as its CPU kernel. Nothing else changes; CUDA keeps its kernel.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION

OP = "inplace_all_reduce"
ORIGINALS = {}


def apply():
    """Register the CPU kernel once per process; returns the op's Python function."""
    import sglang
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.utils.common import sglang_lib

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch cpu_inplace_all_reduce targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    if OP not in ORIGINALS:
        def inplace_all_reduce_cpu(tensor, group_name: str) -> None:
            # parallel_state.inplace_all_reduce's body, written out: its Python name may be SGLang's kernel-API
            # logging wrapper of the op itself (SGLANG_KERNEL_API_LOGLEVEL), which would recurse
            group = ps._groups[group_name]()
            if group is None:
                raise ValueError(f"sglang-hs cpu_inplace_all_reduce: group {group_name} is destroyed")
            group._all_reduce_in_place(tensor)

        ORIGINALS[OP] = inplace_all_reduce_cpu
        sglang_lib.impl(OP, inplace_all_reduce_cpu, "CPU")
    return ORIGINALS[OP]
