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


@pytest.mark.parametrize("draft", [(2, 5, 7), (2, 4, 5), (0, 1, 3), (4, 5, 6)])
def test_ours_and_an_eagle3_drafts_layers_come_out_of_one_capture(overlay_module, draft):
    """With an EAGLE-3 draft the inner model captures the union of its layers and ours once each, ascending
    (SGLang's packer order); each side gets its own layers back, contiguous (a view) or not (a copy)."""
    m, ours, H, T = overlay_module, (2, 4, 5), 16, 3
    captured = tuple(sorted(set(ours) | set(draft)))
    aux = torch.cat([torch.full((T, H), float(i)) for i in captured], dim=1)
    h, out = m.fixed_capture_output((torch.zeros(T, H), aux), SPEC, "EXTEND", captured)
    assert out is aux
    for want in (ours, draft):
        got = m.take_layers(out, m._layer_split(captured, want), H)
        assert torch.equal(got, torch.cat([torch.full((T, H), float(i)) for i in want], dim=1)), (want, captured)
    with pytest.raises(RuntimeError, match=r"expected \(3, 48\) for layers \[2, 4, 5\]"):
        m.fixed_capture_output((torch.zeros(T, H), aux), SPEC, "EXTEND") if len(captured) != 3 else \
            m.fixed_capture_output((torch.zeros(T, H), aux[:, :-1]), SPEC, "EXTEND")
