"""DeepSeek-V3.2 under DP attention on the CPU engine: a group with no requests runs IDLE batches padded to the other
group's size, with no prefix or extend lengths (SGLang leaves them None) and no final norm (upstream skips it in IDLE).
Before the fix the first such batch ended the server: dsa_torch_native's request list iterated the missing lengths
(TypeError), then the pre-norm capture refused the padded row. End to end: tests/e2e/test_model_family.py, v32-dp2."""
from types import SimpleNamespace

import pytest
import torch

fbi = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")


def _batch(mode, **kw):
    fields = dict(forward_mode=mode, seq_lens_cpu=torch.tensor([1]), req_pool_indices=torch.tensor([0]),
                  extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None)
    fields.update(kw)
    return SimpleNamespace(**fields)


def test_an_idle_batch_has_no_requests_to_index_or_attend():
    from sglang_hs.server.patches.dsa_torch_native import _requests

    assert _requests(_batch(fbi.ForwardMode.IDLE)) == []
    assert _requests(_batch(fbi.ForwardMode.DECODE, seq_lens_cpu=torch.tensor([5, 1]),
                            req_pool_indices=torch.tensor([3, 0]))) == [(3, 4, 1), (0, 0, 1)]
    assert _requests(_batch(fbi.ForwardMode.EXTEND, extend_prefix_lens_cpu=[2], extend_seq_lens_cpu=[4])) == [(0, 2, 4)]


def test_an_idle_batchs_padded_row_has_no_pre_norm_state_to_capture():
    from sglang_hs.server.models.deepseek_v2 import _CapturingDeepseekModel

    take = _CapturingDeepseekModel.hs_take_pre_norm
    hidden = torch.zeros(1, 8)
    assert take(SimpleNamespace(norm=SimpleNamespace(hs_pre_norm=None)), hidden, "IDLE") is hidden
    with pytest.raises(RuntimeError, match="the final norm did not run in a 1-row EXTEND batch"):
        take(SimpleNamespace(norm=SimpleNamespace(hs_pre_norm=None)), hidden, "EXTEND")
