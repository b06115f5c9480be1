"""The sgl_kernel import stand-in used in CPU mode."""
import importlib
import sys

import pytest

from sglang_hs.server.cpu import stubs_dir


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.syspath_prepend(stubs_dir())
    saved = sys.modules.pop("sgl_kernel", None)
    mod = importlib.import_module("sgl_kernel")
    yield mod
    sys.modules.pop("sgl_kernel", None)
    if saved is not None:
        sys.modules["sgl_kernel"] = saved


def test_names_exist_and_raise_when_called(stand_in):
    assert stand_in.SGLANG_HS_STAND_IN
    for name in stand_in._NAMES:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} was called on the CPU engine"):
            getattr(stand_in, name)(1, 2)
