"""Lazy access to the compiled extension sglang_hs._C (csrc/).

Importing sglang_hs never loads it; the first call of `ext()` does, and raises ExtensionNotBuilt with
the reason when it cannot (tests skip on that exception, naming the reason).
"""
from __future__ import annotations

import functools


class ExtensionNotBuilt(ImportError):
    pass


@functools.lru_cache(maxsize=None)
def ext():
    try:
        import torch  # noqa: F401  (the extension links against libtorch, loaded by this import)

        from sglang_hs import _C
    except ImportError as e:
        raise ExtensionNotBuilt(
            f"the sglang_hs._C extension is not available ({e}); build it with "
            "`pip install --no-build-isolation -e .` (unset SGLANG_HS_SKIP_EXT_BUILD)"
        ) from e
    return _C


def available() -> bool:
    try:
        ext()
        return True
    except ExtensionNotBuilt:
        return False
