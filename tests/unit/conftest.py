import contextlib
import os
import sys

import pytest

from sglang_hs.cpu import stubs_dir


@contextlib.contextmanager
def _cpu_engine_imports():
    """Import SGLang modules the way the CPU engine does (SGLANG_USE_CPU_ENGINE=1, the sgl_kernel
    stand-in first on the path), then put the environment back."""
    saved = os.environ.get("SGLANG_USE_CPU_ENGINE")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, stubs_dir())
    try:
        yield
    finally:
        sys.path.remove(stubs_dir())
        if saved is None:
            del os.environ["SGLANG_USE_CPU_ENGINE"]
        else:
            os.environ["SGLANG_USE_CPU_ENGINE"] = saved


@pytest.fixture(scope="session")
def cpu_engine_imports():
    return _cpu_engine_imports


@pytest.fixture(scope="session")
def overlay_module():
    """sglang_hs.models.deepseek_v2, imported the way the CPU engine does (it imports SGLang's
    deepseek_v2, which needs the sgl_kernel stand-in on this machine)."""
    with _cpu_engine_imports():
        from sglang_hs.models import deepseek_v2
    return deepseek_v2
