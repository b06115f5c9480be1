"""`sgl_kernel.speculative` on the CPU engine: the op NGRAM's worker imports (spec_ops.py has it)."""
from sgl_kernel.spec_ops import reconstruct_indices_from_tree_mask  # noqa: F401
