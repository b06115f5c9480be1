"""The overlay's status counts forward steps where they happen on a GPU too: in the ModelRunner.forward
hook, for every step the scheduler makes. A CUDA-graph replay runs none of the model's Python, so the
steps here are replays (the original ModelRunner.forward stand-in never calls the model), and the
status must still count their modes, real rows and request ids; graph capture passes never reach the
hook and are not counted. The stand-in also pads out_cache_loc in place, as SGLang's eager path does
when ranks' token counts are kept equal: the padding is not counted."""
import json
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.server.overlay_status import OverlayStatus


class Mode:
    def __init__(self, name):
        self.name = name


def _batch(mode, rows, rids, virtual=None):
    return SimpleNamespace(forward_mode=Mode(mode), out_cache_loc=torch.arange(1, rows + 1), rids=rids,
                           out_cache_loc_virtual=None if virtual is None else torch.arange(1, virtual + 1))


@pytest.fixture
def runner(tmp_path, monkeypatch):
    from sglang_hs.server.patches import capture_hooks

    status = OverlayStatus(str(tmp_path), "DeepseekV3ForCausalLM", CaptureSpec.resolve([1], True, 4, 8))
    replays = []
    def replay(self, fb, *args, **kwargs):  # as SGLang's eager path may: out_cache_loc padded in place
        replays.append(fb)
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(3, dtype=fb.out_cache_loc.dtype)])
        return SimpleNamespace(can_run_graph=True)

    monkeypatch.setitem(capture_hooks.ORIGINALS, "forward", replay)
    monkeypatch.setattr(capture_hooks, "_writer", None)
    r = SimpleNamespace(model=SimpleNamespace(hs_status=status), is_draft_worker=False)
    r.step = lambda fb: capture_hooks._forward(r, fb)
    r.status_file = lambda: (status._flush(), json.load(open(tmp_path / status.name)))[1]
    r.replays = replays
    yield r
    status.stop()


def test_replayed_steps_are_counted_with_their_real_rows_and_rids(runner):
    runner.step(_batch("EXTEND", 16, ["a", "b"]))
    runner.step(_batch("DECODE", 2, ["a", "b"]))
    runner.step(_batch("DECODE", 3, ["a", "b", "c"]))
    runner.step(_batch("DECODE", 8, ["c"], virtual=1))  # the pool's virtual ids name the real rows
    runner.step(_batch("IDLE", 0, None))
    st = runner.status_file()
    assert len(runner.replays) == 5
    assert st["forwards"] == {"EXTEND": 1, "DECODE": 3, "IDLE": 1}
    assert st["rows"] == {"EXTEND": 16, "DECODE": 6, "IDLE": 0}
    assert st["recent_rids"] == ["a", "b", "c"]


def test_a_draft_worker_step_is_not_counted(runner):
    runner.is_draft_worker = True
    runner.step(_batch("DECODE", 2, ["a", "b"]))
    st = runner.status_file()
    assert len(runner.replays) == 1 and st["forwards"] == {} and st["recent_rids"] == []
