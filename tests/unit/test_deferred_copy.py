"""--hs-copy deferred's bookkeeping (sglang_hs/server/store/staging.py: StagedCopy with a host_store), without
a GPU: CUDA's streams and events are stand-ins that record what each stream is given, and the copy kernel a
plain-torch copy into the store by slot that counts the rows it drops, as the kernel does. What runs on the
GPU is tests/gpu (test_writer_gpu, test_write_order_gpu, test_finish_*_gpu) and benchmarks/bench_gpu_copy.py.

Checked here: every step's rows reach the store in step order (slots reused across steps, steps larger than
the stage shipped in chunks); the copy stream gets, per chunk, the device copy, then `freed`, then the wait
for the chunk's gathers (only when there are some), then the kernel, the error counter's copy and `copied`,
and the compute stream waits for `freed` only; drain syncs just the chunks it needs (shipped up to `upto`,
computed) and raises once a row was dropped, at every drain after."""
import contextlib

import pytest
import torch

from reference import copy_rows_ref
from sglang_hs.server.ops import copy_rows as copy_rows_mod
from sglang_hs.server.store.staging import StagedCopy

S, K, H = 40, 2, 8
P = K + 1


class _Event:
    def __init__(self, log, blocking=False, enable_timing=False):
        self.log, self.fired, self.synced = log, log.fire, 0  # log.fire False: the "GPU" has not run it yet

    def record(self, stream=None):
        (stream or self.log.compute).ops.append(("record", self))

    def query(self):
        return self.fired

    def synchronize(self):
        assert self.fired, "synchronised an event that never fires: the test would hang"
        self.synced += 1


class _Stream:
    def __init__(self, name):
        self.name, self.ops = name, []

    def wait_event(self, event):
        self.ops.append(("wait_event", event))

    def synchronize(self):
        pass


class _HostStore:
    def __init__(self, host):
        self.host, self.shape, self.dtype = host, host.shape, host.dtype
        self.errors = type("Errors", (), {"counts": torch.zeros(3, dtype=torch.int64)})()


class _Finisher:
    def __init__(self, copy_stream):
        self.handed, self.bound, self.waits, self.copy_stream = 0, None, [], copy_stream

    def gathers_handed(self):
        return self.handed

    def step_bound(self):
        return self.handed if self.bound is None else self.bound

    def order_device_writes(self, stream=None, upto=None):
        assert stream is self.copy_stream, "the chunk's wait must be on the copy stream, not the forward's"
        stream.ops.append(("wait_gathers", upto))
        self.waits.append(upto)
        return True


@pytest.fixture
def deferred(monkeypatch):
    """A StagedCopy in deferred mode over a CPU store, with stand-ins for CUDA (module docstring)."""
    log = type("Log", (), {})()
    log.compute, log.fire = _Stream("compute"), True
    store = torch.full((S, P, H), float("nan"))
    host_store = _HostStore(store)

    def copy_rows(aux, last, loc, target, errors=None):
        into = target.host if isinstance(target, _HostStore) else target
        rows = aux.reshape(aux.shape[0], -1, into.shape[2])
        if last is not None:
            rows = torch.cat([rows, last[:, None]], 1)
        if isinstance(target, _HostStore):
            torch.cuda.current_stream().ops.append(("kernel", loc.tolist()))
        for t, slot in enumerate(loc.tolist()):
            if 0 <= slot < into.shape[0]:
                into[slot] = rows[t]
            elif isinstance(target, _HostStore):
                c = target.errors.counts
                c[0] += 1
                c[1], c[2] = slot, into.shape[0]

    current = [log.compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(copy_rows_mod, "copy_rows", copy_rows)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _Event(log, **kw))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    made = []

    def make(rows):
        sc = StagedCopy(store, rows, "cpu")  # then made a deferred one on the stand-ins
        sc.close()
        sc.cuda, sc.deferred, sc.host_store, sc._thread, sc.host = True, True, host_store, None, []
        sc.stage2, sc.loc2 = torch.empty_like(sc.stage), torch.empty_like(sc.stage_loc)
        sc.copy_stream = _Stream("copy")
        sc._errors_host = torch.zeros(3, dtype=torch.int64)
        sc.finisher = _Finisher(sc.copy_stream)
        made.append(sc)
        return sc

    make.store, make.log = store, log
    yield make


def _rows(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K * H, generator=g), torch.randn(T, H, generator=g)


def _step(sc, aux, last, loc):
    sc.before_step()
    sc.write(aux, last, loc)
    sc.after_step(aux.shape[0], graph_replayed=False)


def test_steps_land_in_step_order_through_chunks(deferred):
    sc = deferred(4)
    want = torch.full((S, P, H), float("nan"))
    g = torch.Generator().manual_seed(0)
    for i in range(12):
        T = int(torch.randint(1, 11, (1,), generator=g))  # up to 3 chunks of 4 rows
        loc = torch.randperm(12, generator=g)[:T] + 1  # 12 slots: reused from step to step
        aux, last = _rows(T, i)
        _step(sc, aux, last, loc)
        copy_rows_ref(aux, last, loc, want)
    sc.drain()
    assert not sc.pending and sc._scattered == sc.shipped
    assert torch.equal(deferred.store.nan_to_num(7.0), want.nan_to_num(7.0))


def test_each_chunk_is_copied_then_waits_for_its_gathers_then_written(deferred):
    sc = deferred(4)
    log = deferred.log
    aux, last = _rows(6, 1)
    _step(sc, aux, last, torch.arange(1, 7))  # nothing handed over: no wait
    ops = [op for op, _ in sc.copy_stream.ops]
    assert ops == ["wait_event", "record", "kernel", "record"] * 2, ops  # ready, freed, kernel, copied; 2 chunks
    assert sc.finisher.waits == []
    sc.copy_stream.ops.clear()
    log.compute.ops.clear()
    sc.finisher.handed, sc.finisher.bound = 5, 3  # the step's slots may be read by gathers up to 3
    _step(sc, *_rows(2, 2), torch.tensor([7, 8]))
    ops = [op for op, _ in sc.copy_stream.ops]
    assert ops == ["wait_event", "record", "wait_gathers", "kernel", "record"], ops
    assert sc.finisher.waits == [3]
    freed = sc.copy_stream.ops[1][1]
    compute_waits = [e for op, e in log.compute.ops if op == "wait_event"]
    assert compute_waits == [freed], "the compute stream must wait for the device copy only"


def test_drain_syncs_only_the_chunks_it_needs(deferred):
    sc = deferred(4)
    deferred.log.fire = False  # nothing has run on the "GPU" yet
    for i in range(3):
        _step(sc, *_rows(4, i), torch.arange(1, 5) + 4 * i)
    first, second, third = list(sc.pending)
    for s in (first, second, third):
        s.copied.fired = True
    first.ready.fired = third.ready.fired = True  # the second step is still being computed: drain needs none after it
    sc.drain()
    assert first.copied.synced == 1 and second.copied.synced == 0 and third.copied.synced == 0
    assert [s.seq for s in sc.pending] == [2, 3]
    second.ready.fired = True
    sc.drain(upto=2)  # the finish worker's: chunks shipped up to its hand-over
    assert second.copied.synced == 1 and third.copied.synced == 0 and [s.seq for s in sc.pending] == [3]
    deferred.log.fire = True
    _step(sc, *_rows(1, 9), torch.tensor([20]))  # a ship prunes the chunks whose copy has fired
    assert [s.seq for s in sc.pending] == [4] and sc._scattered == 3


def test_a_dropped_row_is_raised_at_every_drain(deferred):
    sc = deferred(4)
    aux, last = _rows(3, 4)
    _step(sc, aux, last, torch.tensor([1, S + 2, 3]))
    _step(sc, *_rows(1, 6), torch.tensor([4]))  # prunes the first chunk: its copy has fired
    with pytest.raises(RuntimeError, match="dropped 1 row"):
        sc.drain(upto=1)  # needs no chunk still pending, and raises all the same
    with pytest.raises(RuntimeError, match=rf"dropped 1 row whose KV slot lay outside the store's \[0, {S}\) "
                                           rf"\(e.g. slot {S + 2}\)"):
        sc.drain()
    assert torch.equal(deferred.store[[1, 3]], torch.cat([aux.view(3, K, H), last[:, None]], 1)[[0, 2]])
    _step(sc, *_rows(1, 5), torch.tensor([5]))
    with pytest.raises(RuntimeError, match="dropped 1 row"):
        sc.drain()


def test_deferred_needs_cuda():
    with pytest.raises(ValueError, match="--hs-copy deferred needs a CUDA device, not cpu"):
        StagedCopy(torch.zeros(4, P, H), 4, "cpu", host_store=object())
