import contextlib
import os
import sys

import pytest

from sglang_hs.server.cpu import stubs_dir


@contextlib.contextmanager
def _cpu_engine_imports():
    """Import SGLang modules the way the CPU engine does (SGLANG_USE_CPU_ENGINE=1, the sgl_kernel
    stand-in first on the path; the flashinfer one counts only where collection has not imported FlashInfer
    already: tests/unit/test_cpu_stand_in.py checks it in a fresh interpreter), then put the environment back."""
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


@pytest.fixture(scope="session", autouse=True)
def sglang_mode_settled():
    """SGLang decides once per process whether it is the CPU engine: is_cpu() is lru_cached and modules
    keep `_is_cpu = is_cpu()` from their import, so SGLANG_USE_CPU_ENGINE counts only at the first call.
    A test that sets the variable for a moment (launch_server.prepare() writes it for the server's
    processes) and imports SGLang meanwhile, with no sgl_kernel stand-in on the path, would leave this
    process in CPU mode for every later test: SGLang then imports sgl_kernel's CPU ops, gets the real
    sgl_kernel, and that import fails without libcuda.so.1 (test_finisher after the launcher's Mistral
    test). Settle it first, for every selection of tests (autouse), from the environment the tests were
    started in, as collecting the whole of tests/unit does (its module-level SGLang imports); tests of the
    CPU engine's code paths then import it under SGLANG_USE_CPU_ENGINE (cpu_engine_imports) with is_cpu()
    already False, as in the whole suite."""
    try:
        from sglang.srt.utils import is_cpu
    except ImportError:  # no SGLang here: nothing to settle
        return
    is_cpu()


@pytest.fixture(scope="session")
def cpu_engine_imports():
    return _cpu_engine_imports


@pytest.fixture(scope="session")
def overlay_module():
    """sglang_hs.server.models.deepseek_v2, imported the way the CPU engine does (it imports SGLang's
    deepseek_v2, which needs the sgl_kernel stand-in on this machine)."""
    with _cpu_engine_imports():
        from sglang_hs.server.models import deepseek_v2
    return deepseek_v2


@pytest.fixture
def clean_env(sglang_mode_settled):
    """prepare() writes the settings into os.environ (the server inherits them): restore it whole. SGLang's
    CPU-mode decision is settled before (sglang_mode_settled): prepare() sets SGLANG_USE_CPU_ENGINE and, for a
    Mistral native folder, imports SGLang, which would otherwise fix this process in CPU mode for good."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith("SGLANG_HS_") or k in ("SGLANG_USE_CPU_ENGINE", "SGLANG_EXTERNAL_MODEL_PACKAGE"):
            del os.environ[k]
    os.environ["PYTHONPATH"] = "/orig"
    yield
    os.environ.clear()
    os.environ.update(saved)
