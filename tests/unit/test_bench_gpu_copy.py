"""What the GPU benchmark (benchmarks/bench_gpu_copy.py) concludes from, checked without a GPU.

`row` and `verdict`, on made-up timings: the CUDA default for --hs-copy is the strategy whose eager AND
graph variants meet every target of the GPU issue at 8192 tokens (>= 80% of the pinned-copy bandwidth
back to back, compute-stream hold < 2% of the forward step, every row read back as written), the lower
hold first; none when neither does. `Case.tagged_round`, the row check, on the CPU with stand-in
strategies: a correct one passes, and each way of getting rows wrong that the benchmark claims to catch
(another step's slots, a stage overwritten before its copy, a stale replay, a lost step) is caught.
The benchmark itself needs a GPU (scripts/gpu_check.sh)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from benchmarks.bench_gpu_copy import DT, H, K, P, ROW_BYTES, Case, row, verdict  # noqa: E402

T, STEP, MEMCPY = 8192, 126.0, 10.0


def _row(name, pipelined, hold, bad=0, threads=""):
    r = dict(ms=[pipelined] * 3, pipelined=[pipelined * 0.9, pipelined, pipelined * 1.2], hold=[hold] * 3,
             rows_checked=20 * T, rows_bad=bad, device_MB=0.0, pinned_MB=0.0)
    if threads != "":
        r.update(scatter_ms=1.0, wait_ms=0.5, scatter_threads=threads)
    return row("GPU", T, name, r, STEP, MEMCPY)


def _rows(direct_hold=10.5, staging_bad=0, staging_graph=True, staging_pipelined=12.0):
    rows = [_row("memcpy_d2h_pinned", MEMCPY, MEMCPY),
            _row("direct_eager", 10.5, direct_hold), _row("direct_graph", 10.4, direct_hold),
            _row("staging_eager", staging_pipelined, 0.3, staging_bad, threads=4),
            _row("staging_eager_t1", 40.0, 0.3, threads=1), _row("staging_eager_t2", 20.0, 0.3, threads=2)]
    if staging_graph:
        rows.append(_row("staging_graph", staging_pipelined, 0.25, threads=4))
    return rows


def test_row_arithmetic():
    r = _row("direct_eager", 12.5, 2.52)
    assert r["GBps"] == pytest.approx(T * ROW_BYTES / 12.5 / 1e6, rel=1e-4)
    assert r["bw_of_memcpy"] == pytest.approx(0.8) and r["hold_of_step"] == pytest.approx(0.02)
    assert (r["pipelined_min"], r["pipelined_max"]) == pytest.approx((12.5 * 0.9, 12.5 * 1.2))
    assert r["hold_of_memcpy"] == pytest.approx(0.252) and r["scatter_ms"] == ""


def test_staging_when_direct_holds_the_compute_stream_too_long():
    default, lines = verdict(_rows())
    assert default == "staging", lines
    assert any(l.strip().startswith("direct_eager") and "misses" in l for l in lines)
    assert lines[-1] == "staging scatter threads (bandwidth of memcpy): 1: 25%, 2: 50%, 4: 83%; " \
                        "4 is the fewest reaching 80%"


def test_a_bad_row_or_a_missing_variant_rules_a_strategy_out():
    assert verdict(_rows(staging_bad=1))[0] is None  # and direct misses the hold target
    assert verdict(_rows(staging_graph=False))[0] is None
    assert verdict(_rows(staging_bad=1, direct_hold=2.0))[0] == "direct"


def test_both_meet_the_lower_hold_wins_and_the_boundaries():
    assert verdict(_rows(direct_hold=0.1))[0] == "direct"
    assert verdict(_rows(direct_hold=0.02 * STEP, staging_bad=1))[0] is None  # hold must stay UNDER 2%
    assert verdict(_rows(direct_hold=0.0199 * STEP, staging_bad=1))[0] == "direct"
    assert verdict(_rows(staging_pipelined=MEMCPY / 0.8))[0] == "staging"  # 80% of memcpy is enough
    default, lines = verdict(_rows(staging_pipelined=MEMCPY / 0.79))
    assert default is None and "no strategy meets every target" in lines[-2]


def test_deferred_when_it_meets_every_target_with_the_lowest_hold():
    """--hs-copy deferred: the direct copy's bandwidth at staging's hold; its cost to the forward is shown."""
    rows = _rows(staging_pipelined=MEMCPY / 0.5)  # staging's host scatter at half the bandwidth: misses
    for name in ("deferred_eager", "deferred_graph"):
        r = dict(ms=[11.0] * 3, pipelined=[11.0] * 3, hold=[0.5] * 3, cost=0.9, rows_checked=20 * T, rows_bad=0,
                 device_MB=0.0, pinned_MB=0.0)
        rows.append(row("GPU", T, name, r, STEP, MEMCPY))
    default, lines = verdict(rows)
    assert default == "deferred", lines
    assert rows[-1]["cost_of_step"] == pytest.approx(0.9 / STEP, abs=1e-5) and rows[-1]["scatter_ms"] == ""
    assert any(l.strip().startswith("deferred_graph") and "MEETS" in l and "cost to the forward  0.71%" in l
               for l in lines), lines
    rows[-1]["rows_bad"] = 3  # a bad row in one variant rules it out
    assert verdict(rows)[0] is None


def test_a_copy_that_frees_the_stream_but_slows_the_forward_misses_the_hold_target():
    """Issue 49's H200 run: deferred held the compute stream 0.39% of the step, but the forward after it took
    7.7-12.3% longer (its kernel takes the SMs meanwhile): the hold target is judged on the larger of the two."""
    rows = _rows(staging_pipelined=MEMCPY / 0.5)
    for name in ("deferred_eager", "deferred_graph"):
        r = dict(ms=[11.0] * 3, pipelined=[11.0] * 3, hold=[0.5] * 3, cost=0.10 * STEP, rows_checked=20 * T,
                 rows_bad=0, device_MB=0.0, pinned_MB=0.0)
        rows.append(row("GPU", T, name, r, STEP, MEMCPY))
    default, lines = verdict(rows)
    assert default is None and any(l.strip().startswith("deferred_graph") and "misses" in l for l in lines), lines


def _tagged(fault):
    """rows_bad of a tagged round of 6 steps of 5 rows through a stand-in strategy with `fault`."""
    torch.manual_seed(0)
    store = torch.zeros(64, P, H, dtype=DT)
    case = Case(store, 5, 6, device="cpu")
    aux, last, want = case.new_rows()
    pending = []  # a staging-like strategy: the step's rows are copied out of the stage one step later

    def step(j):
        if fault == "lost" and j == 3:
            return
        case.set_slots(j - 1 if fault == "stale_slots" and j else j)
        rows = torch.cat([aux.view(5, K, H), last[:, None]], 1)
        if fault == "overwritten_stage":
            pending.append(case.slots.clone())
            if len(pending) > 1:  # the previous step's slots get this step's rows: its stage was overwritten
                store[pending.pop(0)] = rows
            return
        store[case.slots] = rows

    def finish():
        if pending:
            store[pending.pop(0)] = torch.cat([aux.view(5, K, H), last[:, None]], 1)

    checked, bad = case.tagged_round(aux, last, want, step, finish)
    assert checked == 6 * 5
    return bad


@pytest.mark.parametrize("fault, bad", [(None, 0), ("stale_slots", 30), ("overwritten_stage", 25), ("lost", 5)])
def test_the_tagged_round_catches_rows_in_the_wrong_place(fault, bad):
    assert _tagged(fault) == bad
