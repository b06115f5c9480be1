"""The full-pool benchmark's CUDA-path model (benchmarks/bench_full_pool.py, run_overlap) as a check of
the write order under SGLang's overlap scheduler, small enough for the unit suite.

SGLang's real token allocator and radix cache, kept full; each step scheduled and launched before the
previous step's results are processed; the step's writes into the store ordered only by the bound the
real FreeListOrder gives (FinishWorker.step_bound, what order_device_writes hands the GPU); every row
tagged (slot, step) and every record checked by a HiddenStateReader in another process. Every row must
come back as written, and writes that wait for no gather (a bound of 0) must show as bad rows: the
model can see an early write, so its 0 means something. Gathers are slowed (SGLANG_HS_TEST_FINISH_DELAY)
so writes into slots they read are always pending somewhere."""
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
def slow_gathers(monkeypatch):
    from sglang_hs import envs

    monkeypatch.setenv(envs.TEST_GATE, "1")
    monkeypatch.setenv("SGLANG_HS_TEST_FINISH_DELAY", "0.02")


def test_overlap_model_rows_exact(tmp_path):
    s = _summary(tmp_path, "gpu-model,gpu-model-before")
    for design in ("gpu-model", "gpu-model-before"):
        assert int(s[design]["rows_checked"]) > 0 and int(s[design]["records"]) > 0, s[design]
        assert int(s[design]["bad_rows"]) == 0, \
            f"{design}: {s[design]['bad_rows']} rows overwritten before their gather"
        assert s[design]["stalled_steps"] != "", "the overlap model reports the forward stream's waits"


def test_overlap_model_sees_unordered_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(FinishWorker, "step_bound", lambda self: 0)  # the step's writes wait for nothing
    s = _summary(tmp_path, "gpu-model")
    assert int(s["gpu-model"]["bad_rows"]) > 0, "writes into slots pending gathers read went unseen"
