"""Records in parts (--hs-record-part-size) on the finish worker's side: a record of more row bytes than the part
bound is gathered into the ring a part at a time as a reader makes room, through a ring smaller than the record;
a job held (its request's KV slots kept by hold_finished_kv until it is done) never counts in the bound a write
waits for, so no write into the store waits for a record that waits for the reader; a job behind an unfinished
record in parts is held too; and the hold patch keeps SGLang's own release call until then.

The reader here is the ring's own (RingReader), which sees the parts; sglang_hs.reader assembles them (its tests)."""
import types

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.server.store.ring import RingReader, record_bytes

H, NUM_SLOTS = 8, 64
SPEC = CaptureSpec.resolve([1], True, 3, H)
P = SPEC.rows_per_token
ROW = P * H * 4  # float32
PART_ROWS, N = 4, 40
RING = 2048  # ~3 parts of PART_ROWS rows, less than one record of N rows
TAKE_S = 30


@pytest.fixture
def writer(tmp_path):
    from sglang_hs.server.store.writer import CaptureWriter

    w = CaptureWriter(str(tmp_path), SPEC, num_slots=NUM_SLOTS + 1, dtype=torch.float32, ring_bytes=RING)
    s = torch.arange(NUM_SLOTS + 1, dtype=torch.float32)
    w.store.copy_(s[:, None, None] + torch.arange(H) / 64)  # row of slot s: s + h/64 in every part
    yield w
    if w.finisher is not None:
        import sglang_hs.server.store.finisher as finisher

        finisher.PART_GIVE_UP_S, give_up = 0.0, finisher.PART_GIVE_UP_S  # a test that failed midway: at once
        try:
            w.finisher.close()
        finally:
            finisher.PART_GIVE_UP_S = give_up


def _worker(writer):
    from sglang_hs.server.store.finisher import FinishWorker

    worker = FinishWorker(writer)
    worker.enable_parts(PART_ROWS * ROW)
    return worker


def _read(writer, tmp_path, want, timeout=TAKE_S):
    """Read `want` records' worth of ring records (parts and whole ones) as they come, releasing each at once;
    returns them in order."""
    import time

    reader = RingReader.open(str(tmp_path), writer.ring.r.name)
    out, deadline = [], time.monotonic() + timeout
    try:
        while sum(1 for r in out if not r.total_rows or r.first_row + r.rows.shape[0] == r.total_rows) < want:
            for rec in reader.read_ahead():
                out.append(rec)
                reader.release(rec.seq)
            assert time.monotonic() < deadline, [(r.rid, r.first_row, r.total_rows) for r in out]
    finally:
        reader.close()
    return out


def test_a_long_record_leaves_in_parts_through_a_ring_smaller_than_it_and_no_write_waits(writer, tmp_path):
    assert record_bytes(N, P, H, 4, len("long")) > writer.ring.capacity  # never whole in this ring
    worker = _worker(writer)
    slots = torch.arange(1, N + 1)
    assert worker.holds(N) and not worker.holds(PART_ROWS)  # nothing in parts pending: a short record is not held
    seq = worker.submit("long", list(range(100, 100 + N)), slots, held=True, prompt_len=30, next_token=7)
    assert worker.holds(3)  # behind a record in parts not yet published: held too
    worker.submit("short", [5, 6, 7], torch.tensor([50, 51, 52]), held=True)
    worker.poll()
    assert worker.gathers_handed() == 0  # held jobs are not in the bound later writes wait for

    def fail(seq):
        raise AssertionError(f"a write waited for gather {seq}")

    worker._wait_for = fail  # no write may wait: the held slots cannot be written before their gather
    writer.copy(torch.full((3, (P - 1) * H), -1.0), torch.full((3, H), -1.0), torch.tensor([60, 61, 62]))
    del worker._wait_for
    recs = _read(writer, tmp_path, want=2)
    parts = [r for r in recs if r.rid == "long"]
    assert [(r.first_row, r.rows.shape[0]) for r in parts] == [(i, PART_ROWS) for i in range(0, N, PART_ROWS)]
    assert parts[0].input_ids.tolist() == list(range(100, 100 + N)) and all(not len(r.input_ids) for r in parts[1:])
    assert all((r.total_rows, r.prompt_len, r.next_token) == (N, 30, 7) for r in parts)
    rows = torch.cat([r.rows for r in parts])
    assert torch.equal(rows, writer.store[slots])  # each row from its own slot, in order
    assert recs[-1].rid == "short" and not recs[-1].total_rows and recs[-1].rows[:, 0, 0].tolist() == [50, 51, 52]
    worker.drain()
    assert worker.done(seq) and not worker.holds(3)  # published: the next short record is not held
    assert writer.stats["parts"] == N // PART_ROWS and writer.stats["records"] == 2


def test_a_record_cut_short_at_shutdown_stops_what_follows(writer, tmp_path, monkeypatch):
    """At shutdown (close) a record in parts waits PART_GIVE_UP_S for the reader, then is given up: counted as
    dropped, and every job after it refused (a reader would take a record after an unfinished one as torn)."""
    import sglang_hs.server.store.finisher as finisher

    monkeypatch.setattr(finisher, "PART_GIVE_UP_S", 0.0)
    worker = _worker(writer)
    worker.submit("long", list(range(N)), torch.arange(1, N + 1), held=True)
    worker.submit("after", [1, 2], torch.tensor([50, 51]), held=True)
    worker.close()  # no reader: the ring fills with the first parts, then the record is given up
    assert writer.stats["dropped"] == 2 and writer.stats["records"] == 0 and writer.stats["parts"] >= 1
    recs = _read(writer, tmp_path, want=0)
    assert recs == [] or all(r.rid == "long" for r in recs)


class _Finisher:
    def __init__(self):
        self.finished = set()

    def done(self, seq):
        return seq in self.finished


def test_the_hold_patch_keeps_sglangs_release_until_the_job_is_done(monkeypatch):
    from sglang_hs.server.patches import hold_finished_kv as hold

    calls = []
    monkeypatch.setattr(hold, "ORIGINALS", {
        "release_kv_cache": lambda req, tree, *, checkpoint: calls.append((req.rid, tree, checkpoint)),
        "is_fully_idle": lambda self, for_health_check=False, ignore_waiting=False: True,
        "_requests_owning_rows": lambda self: [],
    })
    monkeypatch.setattr(hold, "_held", [])
    fin, stats = _Finisher(), {}

    def req(rid, seq=None):
        r = types.SimpleNamespace(rid=rid, kv=types.SimpleNamespace(holds_kv=True, kv_allocated_len=10))
        if seq is not None:
            hold.hold(r, seq, fin, stats)
        return r

    a, b, plain = req("a", 1), req("b", 2), req("plain")
    hold._release_kv_cache(a, "tree", checkpoint=True)
    hold._release_kv_cache(plain, "tree", checkpoint=False)  # not held: SGLang's release at once
    hold._release_kv_cache(b, "tree", checkpoint=True)
    assert calls == [("plain", "tree", False)] and stats == {"held_requests": 2, "held_tokens": 20}
    assert hold._is_fully_idle(None) is False and hold._is_fully_idle(None, for_health_check=True) is True
    assert [r.rid for r in hold._requests_owning_rows(None)] == ["a", "b"]
    fin.finished.add(2)
    assert hold.release_done() == 1 and calls[-1] == ("b", "tree", True)  # b's job is done, a's not yet
    fin.finished.add(1)
    assert hold.release_done() == 0 and calls[-1] == ("a", "tree", True) and stats["held_requests"] == 0
    assert hold._is_fully_idle(None) is True
    c = req("c", 3)
    fin.finished.add(3)
    hold._release_kv_cache(c, "tree", checkpoint=True)  # its job already done: released at once
    assert calls[-1] == ("c", "tree", True) and hold.held() == 0


def test_a_failure_after_a_part_is_out_gives_its_room_back_and_cuts_the_record_short(writer, tmp_path, monkeypatch):
    """Any failure while a later part is published (not only shutdown's timeout) gives back the room the part took
    (admission's part_room_done: else admission would see that room taken for good) and cuts the record short: the
    next job is refused, since a reader would take a record after an unfinished one as torn."""
    worker = _worker(writer)
    taken, given_back = [], []
    worker.part_room = lambda nbytes, ticket: taken.append(nbytes) or True
    worker.part_room_done = lambda: given_back.append(True)
    inner = writer.ring.publish

    def publish(rid, *args, first_row=0, **kwargs):
        if first_row == PART_ROWS:  # the second part
            raise OSError("the ring's file went away")
        return inner(rid, *args, first_row=first_row, **kwargs)

    monkeypatch.setattr(writer.ring, "publish", publish)
    worker.submit("long", list(range(N)), torch.arange(1, N + 1), held=True)
    worker.submit("after", [1, 2], torch.tensor([50, 51]), held=True)
    worker.flush()
    with pytest.raises(RuntimeError, match="the finish worker failed"):
        worker.drain()
    assert len(taken) == 1 and given_back == [True]  # the second part's room, taken and given back
    assert worker._cut_short == "long" and writer.stats["parts"] == 1 and writer.stats["records"] == 0
    assert writer.stats["dropped"] == 2  # "after" refused: nothing follows the cut-short record
