"""The finish worker (sglang_hs/store/finisher.py) with SGLang's real KV allocators on the CPU: slots a
pending gather will read are not handed out again, they come back once it is done, the scheduler's
accounting (available_size) is as if nothing were held, an allocation that finds the free list short
waits for the worker instead of failing, a failed gather is reported, and closing publishes
everything that was handed over.

The worker's gather is held at a gate (a threading.Event the test opens), so "pending" is a state the
test controls, not a race it hopes to win."""
import threading

import pytest
import torch

from sglang_hs.capture_spec import CaptureSpec
from sglang_hs.reader import HiddenStateReader

H, NUM_SLOTS = 8, 64
SPEC = CaptureSpec.resolve([1], True, 3, H)


@pytest.fixture
def writer(tmp_path):
    from sglang_hs.store.writer import CaptureWriter

    w = CaptureWriter(str(tmp_path), SPEC, num_slots=NUM_SLOTS + 1, dtype=torch.float32, ring_bytes=1 << 20)
    s = torch.arange(NUM_SLOTS + 1, dtype=torch.float32)
    w.store.copy_(s[:, None, None] + torch.arange(H) / 64)  # row of slot s: s + h/64 in every part
    return w


class Gate:
    """Wraps writer.publish_gathered: each gather waits until the test opens the gate."""

    def __init__(self, writer):
        self.open, self.entered = threading.Event(), threading.Event()
        inner = writer.publish_gathered

        def gated(*args, **kwargs):
            self.entered.set()
            self.open.wait()
            return inner(*args, **kwargs)

        writer.publish_gathered = gated


def _token_allocator(size=NUM_SLOTS):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(size, torch.float32, "cpu", None, need_sort=False)


def _worker(writer, allocator, released=None):
    from sglang_hs.store.finisher import FinishWorker, hold_frees

    worker = FinishWorker(writer, on_done=((lambda rid, ticket: released.append(rid)) if released is not None else None))
    assert hold_frees(allocator, worker) is None
    return worker


def _free_set(allocator):
    return set(allocator.free_pages.tolist()) | set(allocator.release_pages.tolist())


def test_slots_of_a_pending_gather_are_not_handed_out_again_and_come_back_after(writer, tmp_path):
    alloc = _token_allocator()
    released = []
    worker = _worker(writer, alloc, released)
    gate = Gate(writer)
    slots = alloc.alloc(10)
    other = alloc.alloc(5)
    worker.submit("r0", list(range(10)), slots)
    gate.entered.wait()
    alloc.free(slots)  # SGLang releases the finished request's KV right after the hand-over
    alloc.free_group_begin()  # and frees in groups in result processing: held as well
    alloc.free(other)
    alloc.free_group_end()
    held = set(slots.tolist()) | set(other.tolist())
    assert not held & _free_set(alloc), "slots of a pending gather went back to the free list"
    assert len(_free_set(alloc)) == NUM_SLOTS - 15 and worker.held_tokens == 15
    assert alloc.available_size() == NUM_SLOTS  # what SGLang schedules by: as if nothing were held
    rest = alloc.alloc(len(alloc.free_pages))  # everything the allocator will hand out now
    assert not held & set(rest.tolist())
    assert released == [] and worker.pending_rids() == ["r0"]
    gate.open.set()
    worker.drain()
    assert held <= _free_set(alloc) and worker.held_tokens == 0 and released == ["r0"]
    alloc.free(rest)  # nothing pending: straight through
    assert alloc.available_size() == NUM_SLOTS
    with HiddenStateReader(str(tmp_path)) as reader:
        rec = reader.take("r0", timeout=5)
    assert torch.equal(rec.aux_hidden_states[:, 0, 0], slots.float())  # each row from its own slot
    worker.close()


def test_frees_come_back_at_the_next_poll_once_the_worker_is_done(writer):
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gate = Gate(writer)
    slots = alloc.alloc(4)
    worker.submit("r1", [1, 2, 3, 4], slots)
    gate.entered.wait()
    alloc.free(slots)
    assert len(_free_set(alloc)) == NUM_SLOTS - 4
    gate.open.set()
    worker.drain()  # waits for the worker (the scheduler's idle point); poll() alone would not wait
    assert alloc.available_size() == NUM_SLOTS
    worker.close()


def test_a_short_pool_waits_for_the_worker_instead_of_failing(writer, monkeypatch):
    """Decisions are taken as if nothing were held (check_decode_capacity: no retraction), and an alloc()
    that would fail only because slots are held drains the worker first and then succeeds (no 'out of
    memory')."""
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gate = Gate(writer)
    wait_for = worker._wait_for
    monkeypatch.setattr(worker, "_wait_for", lambda seq: (gate.open.set(), wait_for(seq)))  # done when waited for
    slots = alloc.alloc(NUM_SLOTS)
    worker.submit("r2", list(range(NUM_SLOTS)), slots)
    gate.entered.wait()
    alloc.free(slots)
    assert len(_free_set(alloc)) == 0 and alloc.available_size() == NUM_SLOTS
    assert alloc.check_decode_capacity(num_tokens=3, tree_cache=None)
    assert worker.held_tokens == NUM_SLOTS  # deciding did not wait for the worker
    again = alloc.alloc(NUM_SLOTS)
    assert again is not None and sorted(again.tolist()) == sorted(slots.tolist())
    worker.close()


def test_alloc_drains_when_only_held_slots_would_satisfy_it(writer, monkeypatch):
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gate = Gate(writer)
    wait_for = worker._wait_for
    monkeypatch.setattr(worker, "_wait_for", lambda seq: (gate.open.set(), wait_for(seq)))
    slots = alloc.alloc(NUM_SLOTS - 2)
    worker.submit("r3", list(range(NUM_SLOTS - 2)), slots)
    gate.entered.wait()
    alloc.free(slots)
    out = alloc.alloc(10)
    assert out is not None and len(out) == 10 and worker.held_tokens == 0
    worker.close()


def test_paged_allocator_holds_whole_pages(writer):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from sglang_hs.store.finisher import FinishWorker, hold_frees

    ps = 4
    alloc = PagedTokenToKVPoolAllocator(NUM_SLOTS, ps, torch.float32, "cpu", None, need_sort=False)
    worker = FinishWorker(writer)
    assert hold_frees(alloc, worker) is None
    gate = Gate(writer)
    pages = alloc.free_pages[:3].clone()
    alloc.free_pages = alloc.free_pages[3:]
    slots = (pages[:, None] * ps + torch.arange(ps)).flatten()
    worker.submit("p0", list(range(len(slots))), slots)
    gate.entered.wait()
    alloc.free(slots[:5])  # pages 0 and 1 of the request
    alloc.free_segment(slots[8:], start_pos=8)  # its page 2, through free_page_ids
    assert not set(pages.tolist()) & set(alloc.free_pages.tolist())
    assert worker.held_tokens == 3 * ps
    gate.open.set()
    worker.drain()
    assert set(pages.tolist()) <= set(alloc.free_pages.tolist())
    assert alloc.available_size() == NUM_SLOTS
    worker.close()


def test_unknown_allocators_are_refused_with_the_reason(writer):
    from sglang_hs.store.finisher import FinishWorker, hold_frees

    class Other:
        pass

    worker = FinishWorker(writer)
    why = hold_frees(Other(), worker)
    assert why and "Other" in why
    worker.close()


def test_a_refused_record_is_counted_logged_and_its_reservation_released(writer, caplog):
    alloc = _token_allocator()
    released = []
    worker = _worker(writer, alloc, released)
    too_long = writer.ring.capacity // (writer.P * H * 4) + 1  # larger than the whole ring
    slots = torch.ones(too_long, dtype=torch.int64)
    worker.submit("big", [0] * too_long, slots)
    worker.submit("ok", [1, 2], torch.tensor([3, 4]))
    worker.drain()
    assert released == ["big", "ok"]
    assert writer.stats["dropped"] == 1 and writer.stats["finish_failed"] == 1 and writer.stats["records"] == 1
    assert "big NOT published" in caplog.text
    worker.close()


def test_each_job_hands_back_the_very_ticket_it_was_submitted_with(writer):
    """Admission releases a published request's reservation by the ticket the finish hook handed over with it
    (before: by rid order, so a request of the same rid handed over with no ticket released another's)."""
    alloc = _token_allocator()
    done = []
    from sglang_hs.store.finisher import FinishWorker, hold_frees

    worker = FinishWorker(writer, on_done=lambda rid, ticket: done.append((rid, ticket)))
    assert hold_frees(alloc, worker) is None
    first, marker = object(), object()
    worker.submit("x", [1, 2], torch.tensor([3, 4]), ticket=first)
    worker.submit("x", [5], torch.tensor([6]))  # a request of the same rid with no ticket left
    worker.submit_marker("x", "not_sampled", ticket=marker)
    worker.drain()
    assert [rid for rid, _ in done] == ["x", "x", "x"]
    assert done[0][1] is first and done[1][1] is None and done[2][1] is marker
    worker.close()


def test_an_unexpected_worker_error_stops_the_scheduler_with_it(writer):
    alloc = _token_allocator()
    worker = _worker(writer, alloc)

    def broken(*a, **k):
        raise OSError("store unmapped")

    writer.publish_gathered = broken
    worker.submit("x", [1], torch.tensor([1]))
    with pytest.raises(RuntimeError, match="store unmapped"):
        worker.drain()
    assert writer.stats["finish_failed"] == 1
    worker.close()


def test_close_publishes_everything_handed_over_and_gives_back_held_frees(writer, tmp_path):
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gate = Gate(writer)
    handed = []
    for i in range(5):
        s = alloc.alloc(3 + i)
        worker.submit(f"c{i}", list(range(3 + i)), s)
        handed.append((f"c{i}", s))
    gate.entered.wait()
    for _, s in handed:
        alloc.free(s)
    assert len(_free_set(alloc)) < NUM_SLOTS
    gate.open.set()
    worker.close()
    assert alloc.available_size() == NUM_SLOTS and writer.stats["records"] == 5
    with HiddenStateReader(str(tmp_path)) as reader:
        for rid, s in handed:
            assert torch.equal(reader.take(rid, timeout=5).aux_hidden_states[:, 0, 0], s.float())


def test_hand_over_and_held_frees_own_their_slot_ids(writer, tmp_path):
    """SGLang hands over, and frees, views of a req_to_token row, which it rewrites for the next request
    at once: the record and the held free keep the ids they were given."""
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gate = Gate(writer)
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[0, :6] = alloc.alloc(6).to(torch.int32)
    slots = table[0, :6].tolist()
    worker.submit("v0", list(range(6)), table[0, :6])
    gate.entered.wait()
    alloc.free(table[0, :6])
    table[0, :] = 7  # the row of the next request
    gate.open.set()
    worker.drain()
    assert set(slots) <= _free_set(alloc) and alloc.available_size() == NUM_SLOTS
    with HiddenStateReader(str(tmp_path)) as reader:
        assert reader.take("v0", timeout=5).aux_hidden_states[:, 0, 0].tolist() == [float(s) for s in slots]
    worker.close()


def test_a_short_alloc_waits_only_for_the_oldest_held_free(writer, monkeypatch):
    """The free list is short by less than the oldest held free gives back: the allocation waits for
    the gather that free waits for, not for every gather still pending."""
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gates = {"a": threading.Event(), "b": threading.Event()}
    entered = {"a": threading.Event(), "b": threading.Event()}
    inner = writer.publish_gathered

    def gated(rid, *args, **kwargs):
        entered[rid].set()
        gates[rid].wait()
        return inner(rid, *args, **kwargs)

    writer.publish_gathered = gated
    waited = []
    wait_for = worker._wait_for

    def wait_for_a(seq):  # gather 1 ("a") finishes when waited for; waiting for gather 2 would hang: fail
        waited.append(seq)
        assert seq == 1, f"a short alloc waited for gather {seq}; the oldest held free needs only gather 1"
        gates["a"].set()
        wait_for(seq)

    monkeypatch.setattr(worker, "_wait_for", wait_for_a)
    a, b = alloc.alloc(20), alloc.alloc(30)
    worker.submit("a", list(range(20)), a)
    entered["a"].wait()
    alloc.free(a)  # held until gather 1 is done
    worker.submit("b", list(range(30)), b)
    alloc.free(b)  # held until gather 2 is done
    rest = alloc.alloc(len(alloc.free_pages))
    out = alloc.alloc(15)  # only a's slots can satisfy it
    assert out is not None and set(out.tolist()) <= set(a.tolist())
    assert waited == [1] and worker.held_tokens == 30 and worker.pending_rids() == ["b"]
    monkeypatch.setattr(worker, "_wait_for", wait_for)
    gates["b"].set()
    worker.drain()
    alloc.free(rest)
    alloc.free(out)
    assert alloc.available_size() == NUM_SLOTS and len(_free_set(alloc)) == NUM_SLOTS
    worker.close()


def test_a_finish_after_close_is_published_at_once_and_frees_are_not_held(writer, tmp_path):
    """close() runs at exit; a request finishing after it (or a free) must neither wait on the stopped
    worker nor leave its slots held for good (an allocation would retry forever)."""
    alloc = _token_allocator(8)
    worker = _worker(writer, alloc)
    worker.close()
    s = alloc.alloc(8)
    worker.submit("late", list(range(8)), s)
    alloc.free(s)
    assert worker.held_tokens == 0 and worker.idle() and writer.stats["records"] == 1
    assert alloc.alloc(8) is not None  # every slot is really free
    with HiddenStateReader(str(tmp_path)) as reader:
        assert torch.equal(reader.take("late", timeout=5).aux_hidden_states[:, 0, 0], s.float())


def test_a_free_that_raises_stays_held(writer):
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gate = Gate(writer)
    s = alloc.alloc(4)
    worker.submit("r", list(range(4)), s)
    gate.entered.wait()
    calls = []

    def failing_free(*args):
        calls.append(args)
        raise AssertionError("double free")  # what SGLANG_DEBUG_MEMORY_POOL's check raises

    worker.hold(failing_free, (s,), 4)
    gate.open.set()
    with pytest.raises(AssertionError):
        worker.drain()
    assert calls and worker.held_tokens == 4  # still counted: available_size stays what is really there
    worker._held.clear()
    worker.held_tokens = 0
    worker.close()


class RidGates:
    """Wraps writer.publish_gathered: the gather of request `rid` waits until `open(rid)`."""

    def __init__(self, writer):
        self.events, self.entered = {}, {}
        inner = writer.publish_gathered

        def gated(rid, *args, **kwargs):
            self.entered.setdefault(rid, threading.Event()).set()
            self.events.setdefault(rid, threading.Event()).wait()
            return inner(rid, *args, **kwargs)

        writer.publish_gathered = gated

    def open(self, rid):
        self.events.setdefault(rid, threading.Event()).set()

    def wait_entered(self, rid):
        assert self.entered.setdefault(rid, threading.Event()).wait(10)


def test_a_free_made_before_its_own_hand_over_waits_for_that_gather(writer, tmp_path):
    """Result processing frees in a group, and a request's own slots can be freed before its finish hook
    hands it over (SGLang's beam search frees a leader's decode slots in commit_decode, then runs the
    hook). Such a free must wait for that request's gather, not only for the ones already handed over:
    here r-old is pending when the free comes, r-new (which reads the freed slots) is handed over after
    it in the same group; once r-old is done and r-new is not, the slots must still be held. (Tagged at
    the free, they went back with r-old's gather: fails without the group rule in hold_frees.)"""
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gates = RidGates(writer)
    old, new = alloc.alloc(6), alloc.alloc(8)
    worker.submit("r-old", list(range(6)), old)
    gates.wait_entered("r-old")
    alloc.free_group_begin()  # process_batch_result_decode
    alloc.free(new)  # commit_decode -> _finish_group -> free_member_rows: before the leader's hook
    worker.submit("r-new", list(range(8)), new)  # the leader's finish hook, in the same pass
    alloc.free_group_end()
    gates.open("r-old")
    worker._wait_for(1)  # r-old's gather is done, r-new's is not
    worker.poll()  # the next scheduler iteration gives back what no pending gather reads
    assert not set(new.tolist()) & _free_set(alloc), "slots of r-new's pending gather went back to the free list"
    assert alloc.available_size() == NUM_SLOTS - 6  # r-old's own slots were never freed here
    gates.open("r-new")
    worker.drain()
    assert set(new.tolist()) <= _free_set(alloc) and worker.held_tokens == 0
    with HiddenStateReader(str(tmp_path)) as reader:
        rec = reader.take("r-new", timeout=5)
    assert torch.equal(rec.aux_hidden_states[:, 0, 0], new.float())
    worker.close()


def test_a_free_in_a_group_with_nothing_pending_is_decided_at_the_groups_end(writer):
    """Nothing pending when the group's free comes, the request handed over later in the same group: its
    slots are held from the group's end until its gather is done."""
    alloc = _token_allocator()
    worker = _worker(writer, alloc)
    gates = RidGates(writer)
    slots = alloc.alloc(5)
    alloc.free_group_begin()
    alloc.free(slots)
    worker.submit("r-late", list(range(5)), slots)
    alloc.free_group_end()
    worker.poll()
    assert not set(slots.tolist()) & _free_set(alloc) and worker.held_tokens == 5
    gates.open("r-late")
    worker.drain()
    assert set(slots.tolist()) <= _free_set(alloc)
    worker.close()
