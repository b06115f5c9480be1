"""Acknowledged reading: a record's ring bytes go back to the server only when the consumer acks it, so
a reader killed and restarted gets exactly the records it had not acknowledged, in order; one reader
per dump dir, refused with the holder's pid while it lives and free again once it is closed or dead."""
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.store import ring  # noqa: E402
from sglang_hs.store.writer import CaptureWriter  # noqa: E402

K, H = 1, 16  # one aux layer plus the last state: P = 2


def _rows(i, T):
    return torch.full((T, K + 1, H), float(i), dtype=torch.bfloat16)


def _publish(w, i, T=3):
    w.ring.publish(f"r{i}", torch.arange(T, dtype=torch.int32) + i, _rows(i, T), timeout=5)


@pytest.fixture
def dump(tmp_path):
    # room for 4 records of 3 tokens: publishing more needs the reader to give bytes back
    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, H), 8, torch.bfloat16,
                      4 * ring.record_bytes(3, K + 1, H, 2, 3))
    w.dir = tmp_path
    return w


def _free(w):
    return w.ring.free_bytes()


def test_unacked_records_keep_their_bytes_and_out_of_order_acks_wait_for_the_prefix(dump):
    one = ring.record_bytes(3, K + 1, H, 2, 2)
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True)
    for i in range(3):
        _publish(dump, i)
    recs = [reader.next(timeout=1) for _ in range(3)]
    assert [r.rid for r in recs] == ["r0", "r1", "r2"] and [r.seq for r in recs] == [1, 2, 3]
    full = _free(dump)
    reader.ack(recs[1])  # out of order: r0 still holds the ring's oldest bytes
    assert _free(dump) == full and reader.unacked() == 3
    reader.ack(recs[0])  # now r0 and r1 go back together
    assert _free(dump) == full + 2 * one and reader.unacked() == 1
    reader.ack(recs[0])  # twice: nothing happens
    reader.ack(recs[2])
    assert reader.unacked() == 0 and reader.unread_bytes() == 0


def test_a_reader_that_stops_acking_holds_the_ring_and_says_so(dump):
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True)
    for i in range(4):
        _publish(dump, i)
    for _ in range(4):
        reader.next(timeout=1)
    with pytest.raises(TimeoutError, match="no room"):  # the writer cannot overwrite unacknowledged bytes
        dump.ring.publish("r4", torch.arange(3, dtype=torch.int32), _rows(4, 3), timeout=0.2)
    with pytest.raises(TimeoutError, match=r"4 records read and not acknowledged .* ack\(\) records as you go"):
        reader.take("r4", timeout=0.1)


def test_an_eager_reader_ignores_ack_and_frees_at_once(dump):
    reader = HiddenStateReader(str(dump.dir), wait=1)
    for i in range(4):
        _publish(dump, i)
    rec = reader.take("r2", timeout=1)
    assert reader.unread_bytes() == 0 and reader.unacked() == 0
    reader.ack(rec)  # harmless
    for i in range(4, 8):  # the ring is all free again
        _publish(dump, i)


def _consume_then_die(dump_dir, n_ack, n_take, q):
    """A reader process: take n_take records, ack the first n_ack, report them, die without cleanup."""
    reader = HiddenStateReader(dump_dir, wait=5, ack=True)
    taken = [reader.next(timeout=10) for _ in range(n_take)]
    for rec in taken[:n_ack]:
        reader.ack(rec)
    q.put([r.rid for r in taken])
    time.sleep(60)  # killed here, holding unacknowledged records and the lock


@pytest.mark.parametrize("n_ack, n_take", [(0, 2), (2, 3), (3, 3)])
def test_a_killed_reader_restarted_gets_exactly_what_it_had_not_acknowledged(dump, n_ack, n_take):
    for i in range(4):
        _publish(dump, i)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_consume_then_die, args=(str(dump.dir), n_ack, n_take, q))
    p.start()
    first_run = q.get(timeout=120)
    assert first_run == [f"r{i}" for i in range(n_take)]
    with pytest.raises(RuntimeError, match=rf"already read by another HiddenStateReader \(pid {p.pid}\)"):
        HiddenStateReader(str(dump.dir), wait=1)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True)  # the lock died with the process
    for i in range(4, 4 + n_ack):  # the space the first reader acked is the server's again
        _publish(dump, i)
    second_run = []
    while reader.poll() or reader.ready_rids():
        rec = reader.next(timeout=1)
        second_run.append(rec.rid)
        assert torch.equal(rec.aux_hidden_states, _rows(int(rec.rid[1:]), 3)[:, :K])
        reader.ack(rec)
    acked = first_run[:n_ack]
    assert second_run == [f"r{i}" for i in range(n_ack, 4 + n_ack)]  # in order, from the first unacked one
    assert sorted(acked + second_run, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(4 + n_ack)]
    assert not set(acked) & set(second_run)  # each record handled exactly once


def test_one_reader_per_dump_dir_until_closed(dump):
    first = HiddenStateReader(str(dump.dir), wait=1)
    with pytest.raises(RuntimeError, match=rf"ring-w0.bin: already read by another HiddenStateReader \(pid {os.getpid()}\)"):
        HiddenStateReader(str(dump.dir), wait=1)
    first.close()
    with pytest.raises(RuntimeError, match="is closed"):
        first.poll()
    with HiddenStateReader(str(dump.dir), wait=1) as second:
        assert second.poll() == 0
    del second
    HiddenStateReader(str(dump.dir), wait=1)  # and a dropped reader lets go too (no close needed)
    HiddenStateReader(str(dump.dir), wait=1)
