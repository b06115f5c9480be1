"""CPU engine, --tp > 1: build SGLang's parallel groups without a PyNccl communicator.

SGLang 0.5.23's `init_model_parallel_group` asks for PyNccl on every platform but NPU/XPU
(`use_pynccl = not (_is_npu or _is_xpu or backend == "mooncake")`), and `GroupCoordinator.__init__`
then builds `PyNcclCommunicator(device=cpu)`, which fails at once ("Expected a cuda device, but got:
cpu"). On CPU the coordinator never uses it anyway: `all_reduce` of a CPU tensor takes SGLang's
shared-memory kernel when that is available (AMX / arm64 only) and else `torch.distributed.all_reduce`
on the group's gloo device group; `reduce_scatter_tensor` and `all_gather_into_tensor` take their
`_is_cpu` branches. So the patch only turns `use_pynccl` off for groups whose device is the CPU; every
other argument and the rest of the constructor are SGLang's. One coordinator path does need PyNccl:
`reduce_scatterv`, which DP attention with expert parallel (attention TP 1, ep size = dp size: the
MoE output's return to each DP group, `should_use_dp_reduce_scatterv` in layers/moe/utils.py) calls
with no CPU branch (`pynccl_comm.change_state` on None: AttributeError at warm-up). For a group
without PyNccl and a CPU tensor the patch sends it to SGLang's own `_deterministic_reduce_scatterv`
(a gloo all-reduce of a copy, then this rank's rows), the method's branch under
SGLANG_ENABLE_DETERMINISTIC_INFERENCE; everything else is unchanged. See the ledger in
sglang_hs/server/patches/__init__.py. Applied in every spawned SGLang process, before it builds its groups
(sglang_hs/server/serve.py), and again, as a no-op, with the model's patches.
"""
from __future__ import annotations

import functools

from sglang_hs.version import SGLANG_VERSION

ORIGINALS = {}


def apply():
    """Wrap GroupCoordinator.__init__ and .reduce_scatterv; returns the original __init__ (for tests).
    Idempotent."""
    import sglang
    from sglang.srt.distributed import parallel_state as ps

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch cpu_gloo_groups targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    if "__init__" in ORIGINALS:
        return ORIGINALS["__init__"]
    original = ORIGINALS["__init__"] = ps.GroupCoordinator.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        local_rank = kwargs["local_rank"] if "local_rank" in kwargs else args[1]
        if ps._group_coordinator_device(local_rank).type == "cpu":
            if "use_pynccl" in kwargs:
                kwargs["use_pynccl"] = False
            else:
                args = args[:3] + (False,) + args[4:]  # (group_ranks, local_rank, backend, use_pynccl, ...)
        original(self, *args, **kwargs)

    ps.GroupCoordinator.__init__ = __init__

    rsv = ORIGINALS["reduce_scatterv"] = ps.GroupCoordinator.reduce_scatterv

    @functools.wraps(rsv)
    def reduce_scatterv(self, input_, output=None, sizes=None):
        if self.pynccl_comm is None and input_.device.type == "cpu":
            return self._deterministic_reduce_scatterv(input_, output, sizes)
        return rsv(self, input_, output, sizes)

    ps.GroupCoordinator.reduce_scatterv = reduce_scatterv
    return original
