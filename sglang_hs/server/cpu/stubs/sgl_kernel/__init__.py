"""Import stand-in for `sgl_kernel` on the CPU engine (never used on a GPU).

PyPI's sglang-kernel is CUDA-only (it needs libcuda.so.1), yet five sglang 0.5.23 modules run
`from sgl_kernel import X` at import time on the CPU path. Without AMX, no sgl_kernel op is called
there by a model: every layer takes a plain-PyTorch path. The launcher puts this folder's parent first
on PYTHONPATH in CPU mode only, so these names resolve. The speculative-decoding ops SGLang's workers
call on the CPU engine (NGRAM, EAGLE, EAGLE-3) and the MHA KV pool's move are implemented in plain torch
(spec_ops.py, `sgl_kernel.speculative`); any other name is missing, so a path that needs the real kernel
fails loudly at its import instead of computing garbage.
"""

__version__ = "0.0.0+sglang-hs-cpu-stand-in"
SGLANG_HS_STAND_IN = True

from sgl_kernel.spec_ops import (  # noqa: E402,F401  (plain-torch CPU ops: spec_ops.py)
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)
