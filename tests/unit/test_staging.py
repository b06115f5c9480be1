"""The staging strategy's bookkeeping (sglang_hs/store/staging.py) on the CPU, against the plain-torch
reference: eager steps shipped in chunks, graph replays shipped after the step, rows reaching the store
in step order, `drain()` stopping at a step still being computed, and a graph too large refused.

On the CPU the copies are synchronous; steps whose copies have not landed are made with events that
have not fired yet (`Pending`), which is all the CUDA path adds to the logic."""
import pytest
import torch

from reference import copy_rows_ref
from sglang_hs.store import staging
from sglang_hs.store.staging import StagedCopy

S, K, H = 40, 3, 24
P = K + 1


class Pending:
    """An event that has not fired: `synchronize()` (waiting for it) fires it."""

    def __init__(self):
        self.fired = False

    def query(self):
        return self.fired

    def synchronize(self):
        self.fired = True


def _store():
    return torch.full((S, P, H), float("nan"), dtype=torch.bfloat16)


def _rows(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K * H, generator=g).bfloat16(), torch.randn(T, H, generator=g).bfloat16()


def _write_held(sc, aux, last, loc):
    """A step whose rows are still being computed and copied when write() returns; returns its events."""
    ready, copied = Pending(), Pending()
    sc._cpu_copy_events = lambda: (ready, copied)
    try:
        sc.write(aux, last, loc)
    finally:
        del sc._cpu_copy_events
    return ready, copied


@pytest.mark.parametrize("T, rows", [(1, 4), (4, 4), (5, 4), (13, 4), (13, 1), (7, 64)])
def test_eager_steps_are_shipped_in_chunks_and_land_exactly(T, rows):
    store, want = _store(), _store()
    sc = StagedCopy(store, rows, "cpu")
    aux, last = _rows(T, T)
    loc = torch.randperm(S - 1)[:T] + 1
    sc.before_step()
    sc.write(aux, last, loc)
    sc.after_step(T, graph_replayed=False)  # shipped by the forward itself: nothing more to do
    sc.drain()
    copy_rows_ref(aux, last, loc, want)
    assert torch.equal(store[loc], want[loc])
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[loc] = False
    assert store[untouched].isnan().all()
    assert sc.stats["staged_rows"] == T and not sc.pending and len(sc.free) == staging.HOST_BUFFERS


def test_without_final_state():
    store = torch.full((S, K, H), float("nan"), dtype=torch.float16)
    sc = StagedCopy(store, 3, "cpu")
    aux = torch.randn(8, K * H).half()
    loc = torch.arange(8, dtype=torch.int32) * 3 + 1  # int32 slots, as SGLang's out_cache_loc may be
    sc.write(aux, None, loc)
    sc.drain()
    want = copy_rows_ref(aux, None, loc, torch.full_like(store, float("nan")))
    assert torch.equal(store.nan_to_num(7.0), want.nan_to_num(7.0))


def test_a_graph_replay_is_shipped_after_the_step_and_only_its_real_rows():
    store = _store()
    sc = StagedCopy(store, 8, "cpu")
    sc._capturing = lambda: True  # the graph's kernels write the stage; no Python of the forward runs
    aux, last = _rows(8, 1)
    loc = torch.tensor([5, 6, 7, 0, 0, 0, 0, 0])  # 3 real rows, padding aimed at slot 0
    sc.before_step()
    sc.write(aux, last, loc)
    assert not sc.pending  # nothing shipped from inside a graph
    sc.after_step(3, graph_replayed=True)
    sc.drain()
    want = copy_rows_ref(aux[:3], last[:3], loc[:3], _store())
    assert torch.equal(store[5:8], want[5:8]) and store[0].isnan().all()


def test_a_step_that_wrote_nothing_ships_nothing():
    """E.g. SGLang's split prefill, which does not run the overlay's forward: stale stage rows must not
    be shipped as if a graph had written them."""
    sc = StagedCopy(_store(), 8, "cpu")
    sc.before_step()
    sc.after_step(5, graph_replayed=False)
    assert not sc.pending and sc.stats["staged_rows"] == 0


def test_a_graph_larger_than_the_stage_is_refused_at_capture():
    sc = StagedCopy(_store(), 4, "cpu")
    sc._capturing = lambda: True
    aux, last = _rows(5, 2)
    with pytest.raises(RuntimeError, match="a CUDA graph of 5 rows does not fit the 4-row staging buffer; raise "
                                           "--hs-staging-rows or lower --cuda-graph-max-bs"):
        sc.write(aux, last, torch.arange(5))


def test_a_reused_slot_ends_with_the_later_steps_row():
    """Two steps write the same slot (freed and reused in between): with both still in host buffers,
    the scatter runs in step order, so the store keeps the later row."""
    store = _store()
    sc = StagedCopy(store, 4, "cpu")
    a, la = _rows(2, 3)
    b, lb = _rows(2, 4)
    ready, _ = _write_held(sc, a, la, torch.tensor([9, 10]))
    sc.write(b, lb, torch.tensor([10, 11]))
    assert len(sc.pending) == 2  # the first has not landed, so the second waits behind it
    ready.fired = True
    sc.drain()
    want = copy_rows_ref(b, lb, torch.tensor([10, 11]), copy_rows_ref(a, la, torch.tensor([9, 10]), _store()))
    assert torch.equal(store[9:12], want[9:12])


def test_drain_stops_at_a_step_still_being_computed():
    store = _store()
    sc = StagedCopy(store, 4, "cpu")
    a, la = _rows(2, 5)
    b, lb = _rows(2, 6)
    ready, copied = _write_held(sc, a, la, torch.tensor([1, 2]))
    sc.write(b, lb, torch.tensor([3, 4]))
    sc.drain()  # the oldest step's rows are not computed: it is later than anything being finished
    assert len(sc.pending) == 2 and store[1:5].isnan().all()
    ready.fired = True  # computed; its host copy has not landed yet: drain waits for it
    sc.drain()
    assert not sc.pending and copied.fired
    assert not store[1:5].isnan().any()


def test_a_third_step_waits_for_the_oldest_host_buffer():
    """Two host buffers: shipping a third step first scatters the oldest, waiting for its copy."""
    assert staging.HOST_BUFFERS == 2
    store = _store()
    sc = StagedCopy(store, 4, "cpu")
    steps = [(_rows(1, 10 + i), torch.tensor([20 + i])) for i in range(3)]
    (a, la), loc = steps[0]
    _, first = _write_held(sc, a, la, loc)
    (b, lb), loc = steps[1]
    second_ready, second = _write_held(sc, b, lb, loc)
    assert not sc.free
    (c, lc), loc = steps[2]
    sc.write(c, lc, loc)
    assert first.fired and not second.fired  # waited for the oldest only
    assert sc.pending[0].copied is second and len(sc.pending) == 2
    assert not store[20].isnan().any() and store[21:23].isnan().all()
    second_ready.fired = True
    sc.drain()
    for (x, lx), loc in steps:
        assert torch.equal(store[loc], copy_rows_ref(x, lx, loc, _store())[loc])
