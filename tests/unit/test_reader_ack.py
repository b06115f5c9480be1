"""Acknowledged reading: a record's ring bytes go back to the server only when the consumer acks it and
every record before it, so a reader killed and restarted gets exactly the records it had not released,
in order (an out-of-order ack waits for the records before it: those come again too); every row is
handed out exactly as published (each value differs by record, token, layer and hidden index); one
reader per dump dir, refused with the holder's pid while it lives and free again once closed or dead. Zero-copy
reading (ack=True, zero_copy=True): the records are views of the ring, byte for byte the copied records, each
holding only its own bytes, dropped when acked, and exact while the writer wraps around the ring beside them."""
import io
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

from sglang_hs.server.capture_spec import CaptureSpec, parse_last  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

K, H = 1, 16  # one aux layer plus the last state: P = 2


def _rows(i, T, P=K + 1):
    """Record i's rows [T, P, H], every value different and exact in bf16: an odd mantissa below 256 that
    numbers the (layer, hidden index), times a power of two that numbers the (record, token), T <= 8.
    A reader that hands out another record's, token's or layer's row, or shifts a row, is caught."""
    assert T <= 8 and P * H <= 128
    t, p, h = torch.arange(T).view(T, 1, 1), torch.arange(P).view(1, P, 1), torch.arange(H).view(1, 1, H)
    rows = ((2 * (h + H * p) + 1) * torch.pow(2.0, 8 * i + t - 40)).bfloat16()
    assert torch.equal(rows.float(), (2 * (h + H * p) + 1) * torch.pow(2.0, 8 * i + t - 40))  # exact in bf16
    return rows


def _ids(i, T):
    return torch.arange(T, dtype=torch.int32) + 100 * i


def _publish(w, i, T=3):
    w.ring.publish(f"r{i}", _ids(i, T), _rows(i, T), timeout=5)


def _assert_exact(rec, i, T, K=K, last=True):
    """rec is record i, every token id and every row exactly as published: the layers, then the final states
    in row order (post-norm, pre-norm), each where it belongs."""
    finals = parse_last(last)
    rows = _rows(i, T, K + len(finals))
    assert rec.rid == f"r{i}" and rec.num_tokens == T and torch.equal(rec.input_ids, _ids(i, T)), rec
    assert rec.aux_hidden_states.shape == (T, K, H) and torch.equal(rec.aux_hidden_states, rows[:, :K]), rec.rid
    for got, which in ((rec.last_hidden_state, "post-norm"), (rec.last_pre_norm, "pre-norm")):
        if which in finals:
            assert torch.equal(got, rows[:, K + finals.index(which)]), (rec.rid, which)
        else:
            assert got is None, (rec.rid, which)


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
    for i, rec in enumerate(recs):
        _assert_exact(rec, i, 3)
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
    _assert_exact(rec, 2, 3)
    for i in (0, 1, 3):  # drained with it, held by the reader
        _assert_exact(reader.take(f"r{i}", timeout=0), i, 3)
    reader.ack(rec)  # harmless
    for i in range(4, 8):  # the ring is all free again
        _publish(dump, i)


def _consume_then_die(dump_dir, n_take, ack_order, q):
    """A reader process: take n_take records, ack those at the indices of ack_order in that order, report
    them, die without cleanup."""
    reader = HiddenStateReader(dump_dir, wait=5, ack=True)
    taken = [reader.next(timeout=10) for _ in range(n_take)]
    for j in ack_order:
        reader.ack(taken[j])
    q.put([r.rid for r in taken])
    time.sleep(60)  # killed here, holding unacknowledged records and the lock


# (records taken, the order they are acked in): in order, none, all; and out of order, where an ack
# waits for the records before it: acking r2 before r0 and r1 releases nothing, so all three (and r3)
# come again; r2 then r0 releases r0 only; a reversed pair releases both.
@pytest.mark.parametrize("n_take, ack_order", [(2, []), (3, [0, 1]), (3, [0, 1, 2]), (3, [2]), (3, [2, 0]),
                                               (2, [1, 0]), (4, [3, 1, 2, 0])])
def test_a_killed_reader_restarted_gets_exactly_what_it_had_not_acknowledged(dump, n_take, ack_order):
    for i in range(4):
        _publish(dump, i)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_consume_then_die, args=(str(dump.dir), n_take, ack_order, q))
    p.start()
    first_run = q.get(timeout=120)
    assert first_run == [f"r{i}" for i in range(n_take)]
    with pytest.raises(RuntimeError, match=rf"already read by another HiddenStateReader \(pid {p.pid}\)"):
        HiddenStateReader(str(dump.dir), wait=1)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    released = 0  # the acknowledged prefix: an ack after a gap releases nothing
    while released in ack_order:
        released += 1
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True)  # the lock died with the process
    for i in range(4, 4 + released):  # the space the first reader released is the server's again
        _publish(dump, i)
    second_run = []
    while reader.poll() or reader.ready_rids():
        rec = reader.next(timeout=1)
        second_run.append(rec.rid)
        _assert_exact(rec, int(rec.rid[1:]), 3)
        reader.ack(rec)
    assert second_run == [f"r{i}" for i in range(released, 4 + released)]  # in order, from the first unreleased
    assert not set(first_run[:released]) & set(second_run)  # what was released never comes again
    # acked out of order, not released: delivered again (a consumer's save must be idempotent)
    assert {first_run[j] for j in ack_order} - set(first_run[:released]) <= set(second_run)
    with pytest.raises(TimeoutError):  # and nothing else is left
        reader.next(timeout=0.2)


@pytest.mark.parametrize("ack, zero_copy", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("layers, last", [([1, 2, 3], True), ([0, 2], False), ([1, 2], "pre-norm"),
                                          ([1, 2, 3], "both")])
def test_every_row_of_every_record_is_handed_out_exactly(tmp_path, layers, last, ack, zero_copy):
    """Records of 1..8 tokens, several in the ring at once, wrapping around it: every token id and every
    row comes out exactly as published, each layer's row as that layer, each final state as that state."""
    K, P = len(layers), len(layers) + len(parse_last(last))
    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve(layers, last, 4, H), 8, torch.bfloat16,
                      3 * ring.record_bytes(8, P, H, 2, 3))
    reader = HiddenStateReader(str(tmp_path), wait=1, ack=ack, zero_copy=zero_copy)
    assert reader.num_aux == K and reader.has_last == ("post-norm" in parse_last(last)) and w.P == P
    assert reader.manifest["last_states"] == list(parse_last(last)) and reader.manifest["rows_per_token"] == P
    lengths = [1 + (i * 5) % 8 for i in range(15)]
    for start in range(0, 15, 3):
        for i in range(start, start + 3):
            w.ring.publish(f"r{i}", _ids(i, lengths[i]), _rows(i, lengths[i], P), timeout=5)
        for i in ([start + 1, start, start + 2] if start % 2 else range(start, start + 3)):  # by rid, any order
            rec = reader.take(f"r{i}", timeout=5)
            _assert_exact(rec, i, lengths[i], K, last)
            assert rec.seq == i + 1
            reader.ack(rec)  # the ring has room for 3: the next 3 need these acknowledged
    assert reader.unacked() == 0 and reader.unread_bytes() == 0


def test_one_reader_per_dump_dir_until_closed(dump):
    first = HiddenStateReader(str(dump.dir), wait=1)
    with pytest.raises(RuntimeError, match=rf"ring-w0.bin: already read by another HiddenStateReader \(pid {os.getpid()}\)"):
        HiddenStateReader(str(dump.dir), wait=1)
    with pytest.raises(RuntimeError, match="already read by another"):  # the same refusal for a zero-copy reader
        HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True)
    first.close()
    with pytest.raises(RuntimeError, match="is closed"):
        first.poll()
    with HiddenStateReader(str(dump.dir), wait=1) as second:
        assert second.poll() == 0
    del second
    HiddenStateReader(str(dump.dir), wait=1)  # and a dropped reader lets go too (no close needed)
    HiddenStateReader(str(dump.dir), wait=1)


# -- zero-copy reading: records are views of the ring, valid until acked -------------------------------
def test_zero_copy_views_are_byte_for_byte_the_copied_record_and_hold_only_its_bytes(dump):
    for i, T in enumerate((3, 1, 2)):
        _publish(dump, i, T)
    copied = ring.RingReader.open(str(dump.dir), "ring-w0.bin").read_ahead()
    viewed = ring.RingReader.open(str(dump.dir), "ring-w0.bin").read_ahead(copy=False)
    assert [r.seq for r in viewed] == [r.seq for r in copied] == [1, 2, 3]
    for c, v in zip(copied, viewed):
        T = c.num_tokens
        assert (v.rid, v.seq, v.rows.shape, v.rows.dtype) == (c.rid, c.seq, c.rows.shape, c.rows.dtype)
        assert bytes(v.rows.view(torch.uint8).flatten().tolist()) == bytes(c.rows.view(torch.uint8).flatten().tolist())
        assert torch.equal(v.input_ids, c.input_ids)
        # the storage is exactly this record's bytes, not the ring's: torch.save writes the record only
        assert v.rows.untyped_storage().nbytes() == T * (K + 1) * H * 2
        assert v.input_ids.untyped_storage().nbytes() == 4 * T
        buf = io.BytesIO()
        torch.save({"rows": v.rows}, buf)
        assert len(buf.getvalue()) < T * (K + 1) * H * 2 + 4096
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue()))["rows"], c.rows)


def test_zero_copy_records_are_views_of_the_ring_and_are_dropped_when_acked(dump):
    with pytest.raises(ValueError, match="zero_copy=True.* needs ack=True"):
        HiddenStateReader(str(dump.dir), wait=1, zero_copy=True)
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True)
    for i in range(4):
        _publish(dump, i)
    recs = [reader.next(timeout=1) for _ in range(4)]
    for i, rec in enumerate(recs):
        _assert_exact(rec, i, 3)
    kept_by_mistake = recs[0].aux_hidden_states  # a view taken out of the record before its ack
    reader.ack(recs[0])
    assert recs[0].aux_hidden_states is None and recs[0].last_hidden_state is None and recs[0].input_ids is None
    _publish(dump, 4)  # the writer reuses r0's bytes at once: what a stale view would show
    assert torch.equal(kept_by_mistake, _rows(4, 3)[:, :K])
    for i in (1, 2, 3):  # the records not acked yet are untouched
        _assert_exact(recs[i], i, 3)
    _assert_exact(reader.next(timeout=1), 4, 3)


def test_zero_copy_views_stay_exact_while_the_writer_wraps_around_the_ring(tmp_path):
    """The reader holds every view it can while the writer fills the rest of the ring with records of 1..8
    tokens (skip markers at the end, wrapping to 0), acking the oldest only when the writer has no room:
    every held view stays exactly its record until acked, in order."""
    biggest = ring.record_bytes(8, K + 1, H, 2, 3)
    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, H), 8, torch.bfloat16, 6 * biggest)
    reader = HiddenStateReader(str(tmp_path), wait=1, ack=True, zero_copy=True)
    lengths = [1 + (i * 5) % 8 for i in range(19)]
    held, most_held, wrapped, last_pos = [], 0, 0, -1
    for i, T in enumerate(lengths):
        while w.ring.free_bytes() < 2 * biggest:  # room for this record and a skip marker
            j, rec = held.pop(0)
            _assert_exact(rec, j, lengths[j])  # after the writer wrote every record since
            reader.ack(rec)
        pos = w.ring.r.load_acquire(ring.OFF_HEAD) % w.ring.capacity
        wrapped += pos < last_pos
        last_pos = pos
        w.ring.publish(f"r{i}", _ids(i, T), _rows(i, T), timeout=5)
        held.append((i, reader.next(timeout=1)))
        most_held = max(most_held, len(held))
    for j, rec in held:
        _assert_exact(rec, j, lengths[j])
        reader.ack(rec)
    print("views held at most", most_held, "wraps", wrapped)
    assert most_held >= 3 and wrapped >= 1 and reader.unacked() == 0 and reader.unread_bytes() == 0


@pytest.mark.parametrize("ack", [True, False])
def test_a_reused_rid_gives_every_record_oldest_first_and_each_is_acked(dump, ack):
    """A client reuses a rid after its request finished: the second record of that rid arrives while the
    first is still unread (same poll). Both are handed out, oldest first, each exact; with ack=True
    acknowledging them gives every ring byte back (before, the newer replaced the older, which was
    never acknowledged: the ring stayed full for good)."""
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=ack)
    for i, rid in ((0, "same"), (1, "same"), (2, "other")):
        dump.ring.publish(rid, _ids(i, 3), _rows(i, 3), timeout=5)
    first, second = reader.take("same", timeout=1), reader.take("same", timeout=1)
    assert (first.seq, second.seq) == (1, 2)
    for rec, i in ((first, 0), (second, 1)):
        rec.rid = f"r{i}"
        _assert_exact(rec, i, 3)
    other = reader.next(timeout=1)
    assert other.rid == "other" and not reader.ready_rids()
    for rec in (first, second, other):
        reader.ack(rec)
    assert _free(dump) == dump.ring.capacity
    reader.close()


def test_a_closed_zero_copy_reader_hands_out_no_view_of_bytes_another_reader_gave_back(dump):
    """Reader A polls three records zero-copy, hands out one, and closes; reader B takes over, acks them
    and the writer publishes over their bytes. A must not hand out its other two (their views now show
    the new records: review finding, r1 came back holding r5's ids), and acking after close is an error
    naming the record, not an IndexError."""
    a = HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True)
    for i in range(3):
        _publish(dump, i)
    first = a.next(timeout=1)
    assert a.poll() == 0 and len(a.ready_rids()) == 2
    a.close()
    assert not a.ready_rids() and a.pop_ready("r1") is None
    with pytest.raises(RuntimeError, match="is closed"):
        a.next(timeout=1)
    with pytest.raises(RuntimeError, match="is closed.*'r0'"):
        a.ack(first)
    b = HiddenStateReader(str(dump.dir), wait=1, ack=True)
    for i in range(3):
        rec = b.take(f"r{i}", timeout=1)
        _assert_exact(rec, i, 3)
        b.ack(rec)
    for i in range(3, 6):
        _publish(dump, i)
    for i in range(3, 6):
        _assert_exact(b.take(f"r{i}", timeout=1), i, 3)
    b.close()


@pytest.mark.parametrize("ack", [True, False])
def test_discarding_another_clients_rid_takes_its_record_behind_its_marker_and_frees_the_ring(dump, ack):
    """Another client reuses a rid with different decisions: a marker, then a record of "foreign". The loops
    that drop others' records (the extraction CLI's _drop, the live dataset and its router) must take both:
    pop_ready answers None while the older marker waits, so dropping with it left the record in ready_rids
    for good and, with ack=True, its ring bytes and every later record's held (the ring filled)."""
    from sglang_hs.extract.cli import Extraction

    reader = HiddenStateReader(str(dump.dir), wait=1, ack=ack)
    dump.publish_marker("foreign", "not_sampled")
    dump.ring.publish("foreign", _ids(0, 3), _rows(0, 3), timeout=5)
    _publish(dump, 1)
    reader.poll()
    assert reader.pop_ready("foreign") is None and reader.ready_rids() == ["foreign", "r1"]
    extraction = object.__new__(Extraction)  # only its reader is used by _drop
    extraction.reader = reader
    extraction._drop("foreign")
    assert reader.ready_rids() == ["r1"] and reader.not_captured("foreign") is None
    assert reader.discard("foreign") == 0  # nothing of it is left
    rec = reader.take("r1", timeout=1)
    _assert_exact(rec, 1, 3)
    reader.ack(rec)
    assert reader.unacked() == 0 and _free(dump) == dump.ring.capacity  # the whole ring is the server's again
    reader.close()


@pytest.mark.parametrize("streams, rows_per_layer", [("mean", 1), ("full", 4)])
def test_deepseek_v4_records_are_read_as_published(tmp_path, streams, rows_per_layer):
    """DeepSeek-V4 (hc_mult 4): its records hold one row per layer id (the streams' mean) or, with
    --hs-hc-streams full, four (stream s of the k-th id at row 4k + s); the reader's aux is every one of
    them, the final states after, each exactly as published (a reader taking one row per id hands the
    second stream out as the post-norm state)."""
    spec = CaptureSpec.resolve([2], "both", 4, H, hc_mult=4, streams=streams)
    P = spec.rows_per_token
    assert P == rows_per_layer + 2
    w = CaptureWriter(str(tmp_path), spec, 8, torch.bfloat16, 3 * ring.record_bytes(8, P, H, 2, 3))
    reader = HiddenStateReader(str(tmp_path), wait=1)
    assert reader.manifest["rows_per_layer"] == rows_per_layer and reader.manifest["hc_mult"] == 4
    assert reader.manifest["hc_streams"] == streams and reader.num_aux == rows_per_layer
    w.ring.publish("r1", _ids(1, 5), _rows(1, 5, P), timeout=5)
    rec = reader.take("r1", timeout=5)
    _assert_exact(rec, 1, 5, K=rows_per_layer, last="both")
    reader.ack(rec)
    reader.close()
