"""Runtime patch: SGLang's KimiK25ForConditionalGeneration builds the overlay's language model.

`sglang/srt/models/kimi_k25.py` imports `DeepseekV3ForCausalLM` from `deepseek_v2` at module level and
calls that name in `KimiK25ForConditionalGeneration.__init__`, so the model registry's override (by
architecture name) never reaches the language model inside the wrapper. The overlay's wrapper subclass
(sglang_hs/server/models/kimi_k25.py) rebinds that module-level name to the overlay class for the duration of
its own `super().__init__()` and puts the original back afterwards, so nothing else in the process sees
a change. Idempotent and re-entrant-safe (a nested build keeps the outer binding); `ORIGINAL` keeps
upstream's class reachable for tests. See the ledger in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import contextlib
import threading

from sglang.srt.models import kimi_k25 as _target

NAME = "DeepseekV3ForCausalLM"
ORIGINAL = getattr(_target, NAME)
_lock = threading.RLock()


@contextlib.contextmanager
def building(language_model_cls):
    """Within the block, `kimi_k25.DeepseekV3ForCausalLM` is `language_model_cls` (a subclass of it)."""
    if not issubclass(language_model_cls, ORIGINAL):
        raise TypeError(f"{language_model_cls.__name__} is not a subclass of upstream {NAME}")
    with _lock:
        before = getattr(_target, NAME)
        setattr(_target, NAME, language_model_cls)
        try:
            yield
        finally:
            setattr(_target, NAME, before)
