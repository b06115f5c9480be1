"""The full-pool benchmark's CUDA-path model (benchmarks/bench_full_pool.py, run_overlap) as a check of
the write order under SGLang's overlap scheduler, small enough for the unit suite.

SGLang's real token allocator and radix cache, kept full; each step scheduled and launched before the
previous step's results are processed; the step's writes into the store ordered only by the bound the
real FreeListOrder gives (FinishWorker.step_bound, what order_device_writes hands the GPU); every row
tagged (slot, step) and every record checked by a HiddenStateReader in another process. Every row must
come back as written, and writes that wait for no gather (a bound of 0) must show as bad rows: the
model can see an early write, so its 0 means something.

Neither outcome rests on the clock (issue 43): every gather is held (SGLANG_HS_TEST_HOLD_GATHERS) until
the forward launched after its job's hand-over has written its rows or waits for that gather, as the
device process reports. A write into a slot the gather reads is therefore always issued first: with a
bound of 0 it lands before the gather, on any machine load; with the real bound the forward must wait,
and `waited_steps` (steps that found a gather of their bound pending) shows the order was exercised,
not absent. A hold that nothing releases fails the run after SGLANG_HS_TEST_HOLD_S."""
import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_full_pool  # noqa: E402
from sglang_hs.server.store.finisher import FinishWorker  # noqa: E402

SMALL = ["--slots", "3072", "--step-tokens", "1024", "--max-req", "256", "--doc-len", "384", "--docs", "4",
         "--steps", "6", "--settle", "1", "--step-ms", "20", "--reps", "1", "--ring-mib", "64"]


def _summary(tmp_path, designs):
    assert bench_full_pool.main(SMALL + ["--out", str(tmp_path), "--designs", designs]) in (0, 1)
    with open(tmp_path / "bench_full_pool_summary.csv") as f:
        return {r["design"]: r for r in csv.DictReader(f)}


@pytest.fixture(autouse=True)
def held_gathers(monkeypatch):
    from sglang_hs import envs

    monkeypatch.setenv(envs.TEST_GATE, "1")
    monkeypatch.setenv("SGLANG_HS_TEST_HOLD_GATHERS", "1")
    monkeypatch.setenv("SGLANG_HS_TEST_HOLD_S", "600")  # a limit to fail at, never a pass: a loaded machine is slow


def test_overlap_model_rows_exact(tmp_path):
    s = _summary(tmp_path, "gpu-model,gpu-model-before")
    for design in ("gpu-model", "gpu-model-before"):
        assert int(s[design]["rows_checked"]) > 0 and int(s[design]["records"]) > 0, s[design]
        assert int(s[design]["bad_rows"]) == 0, \
            f"{design}: {s[design]['bad_rows']} rows overwritten before their gather"
        assert int(s[design]["waited_steps"]) > 0, \
            f"{design}: no forward waited for a gather, so no write was ordered after one"


def test_overlap_model_sees_unordered_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(FinishWorker, "step_bound", lambda self: 0)  # the step's writes wait for nothing
    s = _summary(tmp_path, "gpu-model")
    assert int(s["gpu-model"]["waited_steps"]) == 0, s["gpu-model"]
    assert int(s["gpu-model"]["bad_rows"]) > 0, "writes into slots pending gathers read went unseen"
