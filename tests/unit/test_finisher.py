"""The finish worker (sglang_hs/server/store/finisher.py) with SGLang's real KV allocators on the CPU: the
allocator is left as SGLang made it (a freed slot is free at once, a full pool allocates at once, no
allocation ever waits), and instead the NEXT WRITE into a slot a pending gather reads waits for that
gather, and only for it: the CPU engine's forward copy (CaptureWriter.copy) and the staging scatter
thread. Records stay exact when their slots are reused at once; markers and the idle path never make
anything wait; a failed gather is reported, and closing publishes everything handed over.

The worker's gather is held at a gate (a threading.Event the test opens, per request when needed), so
"pending" is a state the test controls, not a race it hopes to win. A write that must wait is run on a
thread, and the test sees it blocked by the worker's own wait (a hook on `_wait_for`), never by a
sleep."""
import os
import threading
import time
import types

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.reader import HiddenStateReader

H, NUM_SLOTS = 8, 64
SPEC = CaptureSpec.resolve([1], True, 3, H)
P = SPEC.rows_per_token
TAKE_S = 30  # a reader's take: only a hang ends there


def _fill(writer):
    s = torch.arange(NUM_SLOTS + 1, dtype=torch.float32)
    writer.store.copy_(s[:, None, None] + torch.arange(H) / 64)  # row of slot s: s + h/64 in every part


@pytest.fixture
def writer(tmp_path):
    from sglang_hs.server.store.writer import CaptureWriter

    w = CaptureWriter(str(tmp_path), SPEC, num_slots=NUM_SLOTS + 1, dtype=torch.float32, ring_bytes=1 << 20)
    _fill(w)
    yield w
    _teardown(w)


@pytest.fixture
def staged_writer(tmp_path):
    from sglang_hs.server.store.writer import CaptureWriter

    w = CaptureWriter(str(tmp_path), SPEC, num_slots=NUM_SLOTS + 1, dtype=torch.float32, ring_bytes=1 << 20,
                      copy="staging", staging_rows=16)
    _fill(w)
    yield w
    _teardown(w)
    w.staging.close()


def _teardown(w):
    """Open every gate a failed test left shut, so that closing the worker publishes and returns."""
    for gate in getattr(w, "_test_gates", ()):
        gate.set()
    if w.finisher is not None:
        w.finisher.__dict__.pop("_wait_for", None)
        w.finisher.close()


class Gate:
    """Wraps writer.publish_gathered: the gather of a request waits until the test opens its gate (one
    gate for all requests, or one per rid named in `rids`)."""

    def __init__(self, writer, rids=()):
        self.open, self.entered = threading.Event(), threading.Event()
        self.per_rid = {rid: threading.Event() for rid in rids}
        self.started = {rid: threading.Event() for rid in rids}
        writer.__dict__.setdefault("_test_gates", []).extend([self.open, *self.per_rid.values()])
        inner = writer.publish_gathered

        def gated(rid, *args, **kwargs):
            self.entered.set()
            if rid in self.started:
                self.started[rid].set()
            (self.per_rid.get(rid) or self.open).wait()
            return inner(rid, *args, **kwargs)

        writer.publish_gathered = gated


def _token_allocator(size=NUM_SLOTS):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(size, torch.float32, "cpu", None, need_sort=False)


def _worker(writer, released=None):
    from sglang_hs.server.store.finisher import FinishWorker

    return FinishWorker(writer, on_done=((lambda rid, ticket: released.append(rid)) if released is not None else None))


def _never_waits(worker):
    """The worker's one wait raises instead: whatever runs next must not wait for a gather."""
    def fail(seq):
        raise AssertionError(f"waited for gather {seq}")

    worker._wait_for = fail


def _watch_waits(worker):
    """Record each seq the worker is asked to wait for, and set an event once a wait has begun."""
    waits, began = [], threading.Event()
    inner = worker._wait_for

    def watched(seq):
        if worker._done_now() < seq:
            waits.append(seq)
            began.set()
        inner(seq)

    worker._wait_for = watched
    return waits, began


def _thread_then(event, fn, *args):
    """Run fn(*args) on a thread that sets `event` when fn returns (as a wait that begins sets it)."""
    def run():
        try:
            fn(*args)
        finally:
            event.set()

    t = threading.Thread(target=run)
    t.start()
    return t


def _rows(value, n):
    """n new rows for the copy: aux [n, K*H] and last [n, H], every element `value`."""
    return torch.full((n, (P - 1) * H), float(value)), torch.full((n, H), float(value))


def _free_set(allocator):
    return set(allocator.free_pages.tolist()) | set(allocator.release_pages.tolist())


def test_the_allocator_is_sglangs_own_and_a_reused_slot_is_written_only_after_its_gather(writer, tmp_path):
    """A finished request's slots go back to the free list at once (SGLang's own allocator, nothing held,
    available_size exact); a full pool allocates at once; the CPU forward's copy into a slot a pending
    gather reads waits for that gather, and the record holds the OLD rows, the store the new ones."""
    alloc = _token_allocator()
    released = []
    worker = _worker(writer, released)
    gate = Gate(writer)
    slots = alloc.alloc(10)
    worker.submit("r0", list(range(10)), slots)
    worker.poll()  # the scheduler's next iteration hands it to the worker
    gate.entered.wait()
    alloc.free(slots)  # SGLang releases the finished request's KV right after the hand-over
    assert set(slots.tolist()) <= _free_set(alloc) and alloc.available_size() == NUM_SLOTS
    _never_waits(worker)
    everything = alloc.alloc(NUM_SLOTS)  # the whole pool, the pending gather's slots included: no wait
    assert everything is not None and set(slots.tolist()) <= set(everything.tolist())
    del worker._wait_for
    waits, began = _watch_waits(worker)
    copier = _thread_then(began, writer.copy, *_rows(-1, 10), slots)
    began.wait()  # the copy waits for gather 1, and has not written (or it returned: the check below fails)
    assert waits == [1] and torch.equal(writer.store[slots, 0, 0], slots.float())
    assert released == [] and worker.pending_rids() == ["r0"]
    gate.open.set()
    copier.join()
    assert (writer.store[slots] == -1).all()  # the new rows, after the gather
    assert writer.stats["write_waits"] == 1 and writer.stats["write_wait_s"] > 0
    with HiddenStateReader(str(tmp_path)) as reader:
        rec = reader.take("r0", timeout=TAKE_S)
    assert torch.equal(rec.aux_hidden_states[:, 0, 0], slots.float())  # each row from its own slot, old
    worker.poll()
    assert released == ["r0"]


def test_a_write_waits_only_for_the_gathers_that_read_its_slots(writer, tmp_path):
    """Per-slot last reader: with gather a done and gather b pending, a write to a's slots (or to slots no
    gather reads) goes straight through, a write to b's waits for b alone; a slot read by both waits
    for the later."""
    worker = _worker(writer)
    gate = Gate(writer, rids=("a", "b"))
    a, b, shared = torch.tensor([1, 2, 3]), torch.tensor([10, 11]), torch.tensor([20])
    worker.submit("a", [0, 0, 0, 0], torch.cat([a, shared]))
    worker.submit("b", [0, 0, 0], torch.cat([b, shared]))
    worker.poll()
    gate.per_rid["a"].set()
    gate.started["b"].wait()  # a is done (the worker is on b)
    assert worker._done_now() == 1
    _never_waits(worker)
    writer.copy(*_rows(-1, 3), a)
    writer.copy(*_rows(-2, 2), torch.tensor([40, 41]))
    assert (writer.store[a] == -1).all() and writer.stats["write_waits"] == 0
    del worker._wait_for
    waits, began = _watch_waits(worker)
    copier = _thread_then(began, writer.copy, *_rows(-3, 1), shared)
    began.wait()
    assert waits == [2]
    gate.per_rid["b"].set()
    copier.join()
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("a", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [1, 2, 3, 20]
        assert reader.take("b", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [10, 11, 20]


def test_a_step_is_handed_over_at_once_and_a_write_hands_over_before_it_waits(writer, tmp_path):
    """submit() only records the job: the requests finished in one step reach the worker together (one
    queue put, one wake-up) at the scheduler's next poll. A write into a slot of a job not handed over
    yet (no poll in between) hands it over first, then waits for its gather: it neither overwrites the
    slot early nor waits for a job the worker never gets."""
    worker = _worker(writer)
    puts = []

    class Watched:  # the worker's queue, each put recorded (the worker's pending get() is on the same queue)
        def __init__(self, q):
            self.q = q

        def put(self, item):
            puts.append(None if item is None else [j.rid for j in item])
            self.q.put(item)

        def get(self):
            return self.q.get()

    worker._q = Watched(worker._q)
    gate = Gate(writer, rids=("c",))  # the others' gathers run as soon as the worker has them
    gate.open.set()
    worker.submit("a", [0, 0], torch.tensor([1, 2]))
    worker.submit_marker("m", "not_sampled")
    worker.submit("b", [0], torch.tensor([3]))
    assert puts == [] and not gate.entered.is_set()
    worker.poll()
    assert puts == [["a", "m", "b"]]
    worker._wait_for(3)
    c = torch.tensor([4, 5])
    worker.submit("c", [0, 0], c)  # finished; SGLang frees its slots, the next step writes them: no poll between
    waits, began = _watch_waits(worker)
    copier = _thread_then(began, writer.copy, *_rows(-1, 2), c)
    assert began.wait(TAKE_S)
    assert waits == [4] and puts[-1] == ["c"] and torch.equal(writer.store[c, 0, 0], c.float())
    gate.per_rid["c"].set()
    copier.join(TAKE_S)
    assert (writer.store[c] == -1).all() and writer.stats["write_waits"] == 1
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("c", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [4, 5]


def test_markers_make_no_write_wait(writer):
    """A marker (a request served without capture) reads no slot: it is never a gather a write waits for,
    even where writes wait for every gather handed over (CUDA: slot ids stay on the device). Before, a
    marker held every KV free behind the whole queue."""
    worker = _worker(writer)
    gate = Gate(writer, rids=("r",))
    marker_gate = threading.Event()
    writer._test_gates.append(marker_gate)
    inner = writer.publish_marker

    def gated_marker(*a, **k):
        marker_gate.wait()
        return inner(*a, **k)

    writer.publish_marker = gated_marker
    worker.submit("r", [0, 0], torch.tensor([1, 2]))
    worker.submit_marker("m", "not_sampled")
    assert worker.gathers_handed() == 1
    gate.per_rid["r"].set()
    worker._wait_for(1)  # the gather is done; the marker is not published
    worker.poll()
    assert worker.pending_rids() == ["m"]
    worker._per_slot = False  # as on CUDA: a write waits for every gather handed over
    _never_waits(worker)
    writer.copy(*_rows(-1, 2), torch.tensor([1, 2]))
    assert worker.wait_before_write(torch.tensor([5])) == 0.0
    marker_gate.set()
    del worker._wait_for
    worker.drain()
    assert writer.stats["markers"] == 1


def test_the_idle_path_and_intake_do_not_wait_for_gathers(writer, monkeypatch):
    """Scheduler.on_idle (SGLang's idle leak check) and request intake take the worker's results without
    waiting: the pool is SGLang's own, so there is nothing to give back first. Before, on_idle drained.
    Each of them hands what was submitted to the worker (the idle path before SGLang sleeps)."""
    from sglang_hs.server.patches import capture_hooks

    worker = _worker(writer)
    gate = Gate(writer)
    _never_waits(worker)
    calls = []
    monkeypatch.setattr(capture_hooks, "_finisher", worker)
    monkeypatch.setitem(capture_hooks.ORIGINALS, "on_idle", lambda self: calls.append("on_idle"))
    monkeypatch.setitem(capture_hooks.ORIGINALS, "get_next_batch_to_run", lambda self: calls.append("next"))
    monkeypatch.setitem(capture_hooks.ORIGINALS, "_pull_raw_reqs", lambda self: calls.append("pull"))
    for hook in (capture_hooks._on_idle, capture_hooks._get_next_batch_to_run, capture_hooks._pull_raw_reqs):
        worker.submit(f"r{len(calls)}", [0], torch.tensor([1]))
        hook(object())
        assert worker._queued == worker._handed, f"{hook.__name__} did not hand the request to the worker"
    gate.entered.wait()
    assert calls == ["on_idle", "next", "pull"] and worker.pending_rids() == ["r0", "r1", "r2"]
    gate.open.set()
    del worker._wait_for
    worker.drain()


def test_staging_scatter_waits_for_the_gather_and_the_scheduler_does_not(staged_writer, tmp_path):
    """--hs-copy staging: the scheduler thread ships the step (no wait), the scatter thread waits for the
    gather reading the slots before it overwrites them; a gather handed over after a chunk was shipped
    does not wait for that chunk (it would wait for its own gather: a cycle)."""
    w = staged_writer
    worker = _worker(w)
    gate = Gate(w, rids=("old", "new"))
    old = torch.tensor([1, 2, 3])
    worker.submit("old", [0, 0, 0], old)
    worker.poll()
    gate.started["old"].wait()
    waits, began = _watch_waits(worker)
    w.copy(*_rows(-1, 3), old)  # a step that overwrites old's slots, shipped with gathers bound 1
    assert began.wait(TAKE_S)  # the scatter thread waits for gather 1 (the scheduler thread shipped and went on)
    assert waits == [1] and w.staging.shipped == 1
    worker.submit("new", [0, 0, 0], old)  # then a request reading those slots (the new rows), handed over
    worker.poll()
    gate.per_rid["new"].set()  # new's gather may run once old's is done and the chunk is in the store
    assert torch.equal(w.store[old, 0, 0], old.float())  # the scatter waits for old's gather
    gate.per_rid["old"].set()
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("old", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [1, 2, 3]
        assert reader.take("new", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [-1, -1, -1]
    assert w.stats["scatter_waits"] == 1 and w.stats["stage_wait_s"] == 0.0 and w.stats["write_waits"] == 0


def test_staging_gather_does_not_wait_for_chunks_shipped_after_its_hand_over(staged_writer, tmp_path):
    """The cycle a plain drain() would make: gather g (pending) reads slot s; a step overwriting s is
    shipped (its scatter waits for g); g must not wait for that chunk."""
    w = staged_writer
    worker = _worker(w)
    waits = []
    inner = w.staging.drain
    w.staging.drain = lambda upto=None: waits.append(upto) or inner(upto)
    gate = Gate(w, rids=("g",))
    s = torch.tensor([5, 6])
    w.copy(*_rows(7, 2), s)  # a step computing g's rows: shipped before g is handed over
    worker.submit("g", [0, 0], s)
    worker.poll()
    gate.started["g"].wait()
    w.copy(*_rows(-1, 2), s)  # the next step overwrites them (chunk 2)
    gate.per_rid["g"].set()
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("g", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [7, 7]
    assert waits == [1]
    worker.drain()
    w.staging.drain()
    assert (w.store[s] == -1).all()


def test_staging_on_cuda_waits_only_for_the_gathers_its_steps_slots_may_be_read_by(staged_writer, tmp_path):
    """CUDA's staging path, run on the CPU: the slot ids are not on the host at hand-over (as on CUDA), the KV
    allocator is watched (free_list_order.py). A step whose slots come from the never-used part of the free
    list is scattered without waiting for the pending gather (before: every chunk waited for every gather
    handed over); the step that takes that gather's slots waits for it, and its record keeps the old rows."""
    w = staged_writer
    worker = _worker(w)
    worker._per_slot = False  # as on CUDA
    alloc = _token_allocator()
    worker.watch_allocator(alloc)
    gate = Gate(w, rids=("a",))
    T = 8

    def step(slots, value):
        w.before_step()
        w.copy(*_rows(value, len(slots)), slots)  # an eager forward ships its chunks itself
        w.after_step(len(slots), False)

    a = alloc.alloc(T)
    step(a, 5)
    worker.submit("a", list(range(T)), a)
    alloc.free(a)  # SGLang frees the finished request's slots right after the hand-over
    worker.poll()
    assert gate.started["a"].wait(TAKE_S)
    asked = []
    worker._wait_for = asked.append  # records what a scatter would wait for, without waiting
    b = alloc.alloc(NUM_SLOTS - T)  # the rest of the never-used slots (4 chunks of the 16-row stage)
    step(b, -2)
    w.staging.drain()
    assert asked == [], "a chunk whose slots no pending gather reads waited for one"
    del worker._wait_for
    waits, began = _watch_waits(worker)
    c = alloc.alloc(T)
    assert sorted(c.tolist()) == sorted(a.tolist())  # now the slots of "a", freed after its hand-over
    step(c, -1)
    assert began.wait(TAKE_S)
    assert waits == [1] and (w.store[a] == 5).all()  # the scatter waits for a's gather, nothing overwritten
    gate.per_rid["a"].set()
    w.staging.drain()
    assert (w.store[a] == -1).all() and (w.store[b] == -2).all()
    with HiddenStateReader(str(tmp_path)) as reader:
        assert (reader.take("a", timeout=TAKE_S).aux_hidden_states == 5).all()


def _nice(tid):
    """The nice value of thread `tid` of this process (field 19 of its /proc stat line)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are read from Linux's /proc")
def test_the_worker_thread_runs_below_the_scheduler_threads_priority(writer, monkeypatch):
    """SGLANG_HS_FINISH_NICE is added to the worker thread's nice value, the scheduler thread's own is left;
    unset (0) the worker runs at the scheduler's; a value outside 0-19 stops the worker's start in one line
    naming the variable."""
    from sglang_hs.envs import EnvError
    from sglang_hs.server.store.finisher import FinishWorker

    me = _nice(threading.get_native_id())
    monkeypatch.delenv("SGLANG_HS_FINISH_NICE", raising=False)
    worker = _worker(writer)
    assert _nice(worker.native_id) == me
    worker.close()
    monkeypatch.setenv("SGLANG_HS_FINISH_NICE", "10")
    worker = _worker(writer)
    assert _nice(worker.native_id) == min(19, me + 10) and _nice(threading.get_native_id()) == me
    worker.close()
    for bad in ("abc", "25", "-1"):
        monkeypatch.setenv("SGLANG_HS_FINISH_NICE", bad)
        with pytest.raises(EnvError, match="SGLANG_HS_FINISH_NICE"):
            FinishWorker(writer)


def test_allocators_checked_and_unknown_ones_refused_with_the_reason():
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from sglang_hs.server.store.finisher import check_allocator

    assert check_allocator(_token_allocator()) is None
    assert check_allocator(PagedTokenToKVPoolAllocator(32, 4, torch.float32, "cpu", None, need_sort=False)) is None

    class Other:
        pass

    why = check_allocator(Other())
    assert why and "Other" in why


def test_a_refused_record_is_counted_logged_and_its_reservation_released(writer, caplog):
    released = []
    worker = _worker(writer, released)
    too_long = writer.ring.capacity // (writer.P * H * 4) + 1  # larger than the whole ring
    slots = torch.ones(too_long, dtype=torch.int64)
    worker.submit("big", [0] * too_long, slots)
    worker.submit("ok", [1, 2], torch.tensor([3, 4]))
    worker.drain()
    assert released == ["big", "ok"]
    assert writer.stats["dropped"] == 1 and writer.stats["finish_failed"] == 1 and writer.stats["records"] == 1
    assert "big NOT published" in caplog.text


def test_each_job_hands_back_the_very_ticket_it_was_submitted_with(writer):
    """Admission releases a published request's reservation by the ticket the finish hook handed over with it
    (before: by rid order, so a request of the same rid handed over with no ticket released another's)."""
    done = []
    from sglang_hs.server.store.finisher import FinishWorker

    worker = FinishWorker(writer, on_done=lambda rid, ticket: done.append((rid, ticket)))
    first, marker = object(), object()
    worker.submit("x", [1, 2], torch.tensor([3, 4]), ticket=first)
    worker.submit("x", [5], torch.tensor([6]))  # a request of the same rid with no ticket left
    worker.submit_marker("x", "not_sampled", ticket=marker)
    worker.drain()
    assert [rid for rid, _ in done] == ["x", "x", "x"]
    assert done[0][1] is first and done[1][1] is None and done[2][1] is marker


def test_an_unexpected_worker_error_stops_the_scheduler_with_it(writer):
    worker = _worker(writer)

    def broken(*a, **k):
        raise OSError("store unmapped")

    writer.publish_gathered = broken
    worker.submit("x", [1], torch.tensor([1]))
    with pytest.raises(RuntimeError, match="store unmapped"):
        worker.drain()
    assert writer.stats["finish_failed"] == 1


def test_a_write_does_not_wait_forever_on_a_worker_that_is_gone(writer):
    worker = _worker(writer)
    gate = Gate(writer)
    worker.submit("x", [1], torch.tensor([1]))
    worker.poll()
    gate.entered.wait()
    worker._thread.join(timeout=0)  # still alive: stop it the hard way by replacing it with a dead one
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    alive, worker._thread = worker._thread, dead
    with pytest.raises(RuntimeError, match="finish worker stopped"):
        writer.copy(*_rows(-1, 1), torch.tensor([1]))
    worker._thread = alive
    gate.open.set()


def test_close_publishes_everything_handed_over(writer, tmp_path):
    alloc = _token_allocator()
    worker = _worker(writer)
    gate = Gate(writer)
    handed = []
    for i in range(5):
        s = alloc.alloc(3 + i)
        worker.submit(f"c{i}", list(range(3 + i)), s)
        handed.append((f"c{i}", s))
        alloc.free(s)
    gate.open.set()
    worker.close()
    assert alloc.available_size() == NUM_SLOTS and writer.stats["records"] == 5
    with HiddenStateReader(str(tmp_path)) as reader:
        for rid, s in handed:
            assert torch.equal(reader.take(rid, timeout=TAKE_S).aux_hidden_states[:, 0, 0], s.float())


def test_hand_over_owns_its_slot_ids(writer, tmp_path):
    """SGLang hands over views of a req_to_token row, which it rewrites for the next request at once: the
    record keeps the ids it was given, and so does the per-slot last reader."""
    worker = _worker(writer)
    gate = Gate(writer)
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[0, :6] = torch.tensor([9, 8, 7, 6, 5, 4], dtype=torch.int32)
    worker.submit("v", list(range(6)), table[0, :6])
    worker.poll()
    gate.entered.wait()
    table[0, :6] = torch.tensor([30, 31, 32, 33, 34, 35], dtype=torch.int32)  # the row reused at once
    assert worker._last_read[[9, 8, 7, 6, 5, 4]].tolist() == [1] * 6 and int(worker._last_read[30]) == 0
    gate.open.set()
    worker.drain()
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("v", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [9, 8, 7, 6, 5, 4]


def test_a_finish_after_close_is_published_at_once(writer, tmp_path):
    """atexit may close the worker before SGLang's last result processing: a later finish must not hang
    and nothing is left pending (a write then never waits)."""
    worker = _worker(writer)
    worker.close()
    worker.submit("late", [1, 2], torch.tensor([3, 4]))
    assert worker.idle() and writer.stats["records"] == 1
    _never_waits(worker)
    writer.copy(*_rows(-1, 2), torch.tensor([3, 4]))
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("late", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [3, 4]


def test_each_iteration_start_marks_the_stream_for_the_hand_overs(writer, monkeypatch):
    """ingest_requests' hook, first in every iteration of SGLang's event loops, marks the iteration's start
    (the writer's SlotIdCopy.mark_iteration: on CUDA the event the slot-id copies of both finish paths wait
    for, tests/gpu/test_finish_overlap_gpu.py), before the intake (a pause_generation(retract) in it
    processes results), and only it: a mark later in the iteration could follow its launch and SGLang's
    barrier. The synchronous path (no worker) is marked too. Without CUDA a mark is nothing."""
    from sglang_hs.server.patches import capture_hooks

    worker = _worker(writer)
    calls = []
    monkeypatch.setattr(writer.slot_ids, "mark_iteration", lambda: calls.append("mark"))
    monkeypatch.setattr(capture_hooks, "_writer", writer)
    for name in ("on_idle", "get_next_batch_to_run", "_pull_raw_reqs", "ingest_requests"):
        monkeypatch.setitem(capture_hooks.ORIGINALS, name, lambda self, n=name: calls.append(n))
    monkeypatch.setattr(capture_hooks, "_finisher", False)  # the synchronous path: marked all the same
    capture_hooks._ingest_requests(object())
    assert calls == ["mark", "ingest_requests"], calls
    calls.clear()
    monkeypatch.setattr(capture_hooks, "_finisher", worker)
    capture_hooks._ingest_requests(object())
    capture_hooks._get_next_batch_to_run(object())
    capture_hooks._on_idle(object())
    capture_hooks._pull_raw_reqs(object())
    assert calls == ["mark", "ingest_requests", "get_next_batch_to_run", "on_idle", "_pull_raw_reqs"]
    monkeypatch.undo()
    worker.mark_iteration()  # no CUDA hand-over yet: no side stream, no event
    assert worker._mark is None
    worker.close()


def test_the_worker_thread_binds_to_the_schedulers_device_not_device_0(writer, monkeypatch):
    """Issue 48, item 1: a new thread's current CUDA device is always 0; the worker resolved it on its own
    thread and set_device'd that, so every writer on another GPU made a CUDA context on GPU 0. The device is
    now the constructing (scheduler) thread's. The CUDA calls are stand-ins: on the scheduler thread the
    current device is 3, on any other thread 0, as CUDA's runtime has it."""
    from sglang_hs.server.store import staging

    scheduler = threading.current_thread()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3 if threading.current_thread() is scheduler else 0)
    bound = []
    monkeypatch.setattr(staging, "_prepare_scatter_thread", lambda device: bound.append(device))
    worker = _worker(writer)
    assert bound == [torch.device("cuda", 3)], bound


def _device_waits(worker, monkeypatch):
    """The CUDA side of order_device_writes as stand-ins (no GPU here): the pinned done word a plain tensor,
    the stream wait recorded; the watchdog's way out recorded instead of signalling the test process."""
    from sglang_hs.server.store import finisher

    waits, tripped = [], []
    worker._done_dev = torch.zeros(1, dtype=torch.int64)
    monkeypatch.setattr(finisher, "_stream_wait_value64", lambda stream, addr, value: waits.append(value))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    worker.on_stuck = tripped.append
    return waits, tripped


def test_a_gather_stuck_under_a_device_wait_stops_the_server_with_its_name(writer, monkeypatch, caplog):
    """Issue 48, item 2: the forward stream waits on the GPU for the worker's counter; if the worker stops
    advancing it (here a gather that never returns), the scheduler blocks behind the stream for good and the
    worker's error is never raised. The watchdog names the stuck gather within SGLANG_HS_FINISH_WATCHDOG_S,
    stops the server (SGLang's way: SIGQUIT to its main process; recorded here), and nothing is published
    after it, not even once the gather wakes."""
    worker = _worker(writer)
    worker.watchdog_s = 0.3
    waits, tripped = _device_waits(worker, monkeypatch)
    gate = Gate(writer, rids=["stuck"])
    worker.submit("stuck", [1, 2], torch.tensor([1, 2]))
    worker.submit("behind", [3], torch.tensor([3]))
    assert worker.order_device_writes() and waits == [2]
    deadline = time.monotonic() + 60
    while not tripped:  # the watchdog's verdict, published through on_stuck
        assert time.monotonic() < deadline, "the watchdog never tripped"
        time.sleep(0.01)
    assert "stuck" in tripped[0] and "gather 1 (request stuck)" in tripped[0] and "waits on the GPU for gather 2" \
        in tripped[0], tripped
    assert "the finish worker is stuck" in caplog.text
    assert int(worker._done_dev[0]) == 0  # the GPU's wait is not released: the step must not overwrite those slots
    with pytest.raises(RuntimeError, match="the finish worker is stuck"):
        worker.poll()
    gate.per_rid["stuck"].set()  # the gather wakes: it publishes (its rows were never overwritten), the next not
    worker._wait_for(2)
    assert writer.stats["records"] == 1 and int(worker._done_dev[0]) == 0, writer.stats
    with pytest.raises(RuntimeError, match="the finish worker is stuck"):
        worker.poll()


def test_a_slow_worker_that_keeps_finishing_jobs_is_not_tripped(writer, monkeypatch):
    """The watchdog counts time without a finished job, not the length of a wait: a worker behind by many
    jobs that finishes one every so often (here each within the limit) never trips it."""
    worker = _worker(writer)
    worker.watchdog_s = 0.4
    waits, tripped = _device_waits(worker, monkeypatch)
    gate = Gate(writer, rids=[f"slow-{i}" for i in range(4)])
    for i in range(4):
        worker.submit(f"slow-{i}", [i], torch.tensor([i + 1]))
    assert worker.order_device_writes() and waits == [4]
    for i in range(4):  # one job finished every ~0.2 s: over 0.8 s in all, twice the limit
        gate.per_rid[f"slow-{i}"].set()
        worker._wait_for(i + 1)
        time.sleep(0.2)
    assert not tripped and writer.stats["records"] == 4 and int(worker._done_dev[0]) == 4
    worker.poll()


def test_a_worker_idle_for_long_before_a_wait_is_not_taken_for_a_stuck_one(writer, monkeypatch):
    """The watchdog counts from the later of the worker's last finished job and the start of the waits
    outstanding: a worker with nothing to do for an hour, then handed a job a step waits for, has its
    whole limit to finish it (it tripped at once when the count ran from its last job)."""
    worker = _worker(writer)
    worker.watchdog_s = 0.5
    waits, tripped = _device_waits(worker, monkeypatch)
    worker._progress_t -= 3600  # its last finished job: an hour ago
    gate = Gate(writer, rids=["fresh"])
    worker.submit("fresh", [1], torch.tensor([1]))
    assert worker.order_device_writes() and waits == [1]
    started = time.monotonic()
    assert gate.started["fresh"].wait(30)
    while time.monotonic() - started < 0.25:  # within the limit the watchdog has looked at least once
        time.sleep(0.01)
    assert not tripped, tripped
    gate.per_rid["fresh"].set()
    worker._wait_for(1)
    worker.poll()



def test_a_held_gather_waits_for_a_write_to_wait_for_it(writer, tmp_path, monkeypatch):
    """The test-only hold (SGLANG_HS_TEST_HOLD_RID, tests/e2e/test_exact_rows.py's slot-reuse proof): the gather
    of a held request starts only once a write into its slots waits for it, which the write then does until
    the gather is done; the record holds the old rows, the store the new. Without such a write the hold ends
    after SGLANG_HS_TEST_HOLD_S; a request of another rid is not held."""
    monkeypatch.setenv("SGLANG_HS_TESTING", "1")
    monkeypatch.setenv("SGLANG_HS_TEST_HOLD_RID", "x-hold-")
    monkeypatch.setenv("SGLANG_HS_TEST_HOLD_S", "60")
    worker = _worker(writer)
    slots = torch.tensor([3, 4, 5])
    worker.submit("x-hold-1", [1, 2, 3], slots)
    worker.poll()
    writer.copy(*_rows(-1, 3), slots)  # waits for the held gather, which starts because a write waits for it
    assert writer.stats["write_waits"] == 1 and (writer.store[slots] == -1).all()
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("x-hold-1", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [3.0, 4.0, 5.0]
    worker.close()
    monkeypatch.setenv("SGLANG_HS_TEST_HOLD_S", "0.5")
    worker = _worker(writer)
    t0 = time.monotonic()
    worker.submit("other", [1], torch.tensor([8]))
    worker.flush()
    with HiddenStateReader(str(tmp_path)) as reader:
        reader.take("other", timeout=TAKE_S)
        not_held = time.monotonic() - t0
        t0 = time.monotonic()
        worker.submit("x-hold-2", [1], torch.tensor([9]))
        worker.flush()
        reader.take("x-hold-2", timeout=TAKE_S)  # published once the hold ran out, no write waiting for it
        held = time.monotonic() - t0
    assert held >= 0.5, (held, not_held)
    worker.close()


def test_a_kv_move_takes_the_rows_along_and_waits_for_gathers_of_its_targets(writer, tmp_path):
    """CaptureWriter.move (SGLang's move_kv_cache after a speculative verify): each target slot gets its
    source's row, read before any is written (a target may be another pair's source), pairs with target ==
    source and SGLang's zero padding move nothing; a target a pending gather reads waits for that gather,
    whose record keeps the row it had."""
    worker = _worker(writer)
    gate = Gate(writer, rids=("held",))
    worker.submit("held", [0, 0], torch.tensor([30, 31]))
    worker.poll()
    gate.started["held"].wait()
    before = writer.store.clone()
    _never_waits(worker)
    tgt, src = torch.tensor([5, 6, 7, 0, 0]), torch.tensor([6, 9, 7, 0, 0])  # 5 <- 6 while 6 <- 9
    writer.move(tgt, src)
    assert torch.equal(writer.store[5], before[6]) and torch.equal(writer.store[6], before[9])
    unchanged = [s for s in range(NUM_SLOTS + 1) if s not in (5, 6)]
    assert torch.equal(writer.store[unchanged], before[unchanged]) and writer.stats["moved_rows"] == 2
    del worker._wait_for
    waits, began = _watch_waits(worker)
    mover = _thread_then(began, writer.move, torch.tensor([31]), torch.tensor([40]))
    began.wait()
    assert waits == [1]
    gate.per_rid["held"].set()
    mover.join()
    assert torch.equal(writer.store[31], before[40]) and writer.stats["write_waits"] == 1
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("held", timeout=TAKE_S).aux_hidden_states[:, 0, 0].tolist() == [30, 31]
    with pytest.raises(RuntimeError, match="a KV move of"):
        writer.move(torch.tensor([1, 2]), torch.tensor([3]))


def test_a_kv_move_waits_for_the_staged_rows_of_its_step(staged_writer):
    """With --hs-copy staging the step's rows reach the store on the scatter thread: a move right after the
    step waits until they have landed and moves the rows that step wrote, not what its slots held before."""
    from test_staging import _blocked, _in_thread, _write_held

    staged_writer.staging.before_step()
    ready, copied = _write_held(staged_writer.staging, *_rows(-9, 2), torch.tensor([12, 13]))
    staged_writer.staging.after_step(2, False)
    ready.fire()  # computed; its host copy has not landed
    mover = _in_thread(lambda: staged_writer.move(torch.tensor([20]), torch.tensor([13])))
    assert _blocked(mover)
    copied.fire()
    mover.join(60)
    assert not mover.is_alive()
    assert (staged_writer.store[20] == -9).all() and (staged_writer.store[12] == -9).all()
