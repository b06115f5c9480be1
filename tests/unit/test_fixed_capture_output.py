"""The overlay's inner model returns one fixed structure on every path, or stops with a clear error."""
import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec


@pytest.fixture(scope="module")
def fixed(overlay_module):
    return overlay_module.fixed_capture_output


SPEC = CaptureSpec.resolve([2, 4, 5], True, 8, 16)


def test_tuple_passes_through(fixed):
    h, a = torch.zeros(3, 16), torch.zeros(3, 48)
    out = fixed((h, a), SPEC, "EXTEND")
    assert out[0] is h and out[1] is a


def test_idle_zero_rows_bare_tensor_becomes_the_fixed_tuple(fixed):
    h, a = fixed(torch.zeros(0, 16), SPEC, "IDLE")
    assert h.shape == (0, 16) and a.shape == (0, 48)


def test_bare_tensor_with_rows_is_an_error_not_a_silent_split(fixed):
    with pytest.raises(RuntimeError, match="captured no aux layer for a 2-row DECODE batch"):
        fixed(torch.zeros(2, 16), SPEC, "DECODE")


@pytest.mark.parametrize("aux_shape", [(3, 32), (2, 48), (3, 64)])
def test_wrong_aux_shape(fixed, aux_shape):
    with pytest.raises(RuntimeError, match=r"expected \(3, 48\)"):
        fixed((torch.zeros(3, 16), torch.zeros(aux_shape)), SPEC, "EXTEND")


def test_other_outputs(fixed):
    with pytest.raises(RuntimeError, match="unexpected inner model output"):
        fixed((torch.zeros(3, 16),), SPEC, "EXTEND")
    with pytest.raises(RuntimeError, match="unexpected inner model output list"):
        fixed([torch.zeros(3, 16), torch.zeros(3, 48)], SPEC, "EXTEND")
