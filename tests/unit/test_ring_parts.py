"""Records in parts (issue 47, the writer half's ring format, version 9): a record larger than the server's bound
leaves the ring a part at a time, each part a record of its own (rows [first_row, first_row + T) of the record's
total_rows; the first part holds all the record's token ids, the later ones none). The ring's own checks (round
trip, the torn cases: a part out of order, a gap in the rows, a foreign record between parts, bad id counts), then
the reader's: a parted record is ONE HiddenStateRecord, assembled by copy (no part_bytes, or small enough) or
streamed a part at a time through chunks() (more than part_bytes of rows), with a ring smaller than the record."""
import struct
import threading
import zlib

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.store import admission, ring  # noqa: E402

P, H = 2, 40
N_IDS_AT = 50  # the byte offset of n_ids in a record header (ring._REC: after meta_len)


def _rows(seed, T, P=P, H=H):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, P, H, generator=g).bfloat16()


def _ids(seed, T):
    return torch.arange(T, dtype=torch.int32) * 3 + seed


def _publish_parts(w, rid, ids, rows, bounds, **kw):
    """Publish record (ids, rows) as parts of rows [a, b) for each (a, b) in `bounds`; returns their seqs."""
    N = rows.shape[0]
    return [w.publish(rid, ids if a == 0 else torch.empty(0, dtype=torch.int32), rows[a:b], timeout=5, first_row=a,
                      total_rows=N, **kw) for a, b in bounds]


@pytest.fixture
def ringw(tmp_path):
    return ring.RingWriter.create(str(tmp_path), "r", 1 << 16), str(tmp_path)


def test_parts_round_trip_between_whole_records_and_markers(ringw):
    w, d = ringw
    N = 10
    ids, rows = _ids(1, N), _rows(1, N)
    w.publish("before", _ids(0, 3), _rows(0, 3), timeout=5)
    w.publish("m", torch.empty(0, dtype=torch.int32), torch.empty(0, P, H, dtype=torch.bfloat16), skipped=2)
    seqs = _publish_parts(w, "p", ids, rows, [(0, 4), (4, 7), (7, 10)], prompt_len=6, next_token=9,
                          meta=ring.encode_meta({"x": 1}))
    w.publish("after", _ids(2, 2), _rows(2, 2), timeout=5)
    assert seqs == [3, 4, 5]
    recs = ring.RingReader.open(d, "r").drain()
    assert [(r.rid, r.total_rows, r.first_row) for r in recs] == [
        ("before", 0, 0), ("m", 0, 0), ("p", N, 0), ("p", N, 4), ("p", N, 7), ("after", 0, 0)]
    first, mid, last = recs[2:5]
    assert torch.equal(first.input_ids, ids) and mid.num_tokens == last.num_tokens == 0
    assert torch.equal(torch.cat([first.rows, mid.rows, last.rows]), rows)
    assert all((r.prompt_len, r.next_token, r.meta) == (6, 9, {"x": 1}) for r in (first, mid, last))
    assert [r.is_last_part for r in recs] == [False, False, False, False, True, False]
    assert ring.record_bytes(4, P, H, 2, 1, 0, 20) == ring.record_bytes(4, P, H, 2, 1) + 64  # 80 bytes of ids, not 16


def test_publish_refuses_inconsistent_parts(ringw):
    w, _ = ringw
    rows = _rows(1, 4)
    with pytest.raises(ValueError, match=r"expected \(10,\): a first part's N"):
        w.publish("p", _ids(1, 4), rows, first_row=0, total_rows=10)
    with pytest.raises(ValueError, match=r"expected \(0,\): none on a later part"):
        w.publish("p", _ids(1, 4), rows, first_row=4, total_rows=10)
    with pytest.raises(ValueError, match=r"rows \[8, 12\) of a record of 10 rows"):
        w.publish("p", torch.empty(0, dtype=torch.int32), rows, first_row=8, total_rows=10)
    with pytest.raises(ValueError, match="expected first_row 0 for a whole record"):
        w.publish("p", _ids(1, 4), rows, first_row=2)
    assert w.seq == 0 and w.head == 0  # nothing published


def _torn(d, match):
    with pytest.raises(ring.TornRecord, match=match):
        ring.RingReader.open(d, "r").drain()


def test_a_foreign_record_between_parts_is_torn(ringw):
    w, d = ringw
    _publish_parts(w, "p", _ids(1, 10), _rows(1, 10), [(0, 4)])
    w.publish("other", _ids(2, 2), _rows(2, 2))
    _torn(d, r"a whole record of request b'other' where the part of rows \[4, \.\.\) of 10 of request b'p'")


def test_a_marker_between_parts_is_torn(ringw):
    w, d = ringw
    _publish_parts(w, "p", _ids(1, 10), _rows(1, 10), [(0, 4)])
    w.publish("m", torch.empty(0, dtype=torch.int32), torch.empty(0, P, H, dtype=torch.bfloat16), skipped=2)
    _torn(d, "where the part of rows")


def test_a_gap_in_the_rows_is_torn(ringw):
    w, d = ringw
    _publish_parts(w, "p", _ids(1, 10), _rows(1, 10), [(0, 4), (5, 10)])
    _torn(d, r"rows \[5, 10\) of 10 of request b'p' where the part of rows \[4, \.\.\)")


def test_a_part_of_another_record_is_torn(ringw):
    w, d = ringw
    _publish_parts(w, "p", _ids(1, 10), _rows(1, 10), [(0, 4)])
    _publish_parts(w, "q", _ids(1, 10), _rows(1, 10), [(4, 10)])
    _torn(d, "of request b'q' where the part of rows")


def test_a_part_out_of_order_is_torn(ringw):
    w, d = ringw
    w.publish("before", _ids(0, 3), _rows(0, 3))
    _publish_parts(w, "p", _ids(1, 10), _rows(1, 10), [(4, 10), (0, 4)])
    _torn(d, r"without its earlier parts \(expected its first part")


def test_a_restarted_reader_finds_later_parts_first_as_orphans(ringw):
    """A reader that died after releasing a record's first part: the next one starts at that part's end; the rest
    of that record are orphans (lost: their first part is gone), the records after it as usual."""
    w, d = ringw
    ids, rows = _ids(1, 10), _rows(1, 10)
    _publish_parts(w, "p", ids, rows, [(0, 4), (4, 7), (7, 10)])
    w.publish("after", _ids(2, 2), _rows(2, 2))
    first = ring.RingReader.open(d, "r")
    recs = first.read_ahead(part_views=True)
    first.release(recs[0].seq)
    first.close()
    recs = ring.RingReader.open(d, "r").drain()
    assert [(r.rid, r.first_row, r.orphan) for r in recs] == [("p", 4, True), ("p", 7, True), ("after", 0, False)]


@pytest.mark.parametrize("n_ids,first_row,total_rows", [(4, 0, 10), (0, 0, 10), (10, 4, 10), (3, 0, 0), (10, 8, 10),
                                                        (0, 0, 0)])
def test_bad_part_fields_in_a_header_are_torn(ringw, n_ids, first_row, total_rows):
    """A header whose part fields disagree (its checksum made to match, as a writer's bug would): the ids a part
    stores (all N on the first, none after), rows outside the record, a whole record with fewer ids than rows."""
    w, d = ringw
    T, N = 4, 10
    first = _publish_parts(w, "p", _ids(1, N), _rows(1, N), [(0, T)])  # a well-formed first part: 10 ids
    base = ring.HEADER_BYTES
    hdr = bytearray(bytes(w.r.buf[base : base + ring._REC.size].tolist()))
    struct.pack_into("<III", hdr, N_IDS_AT, n_ids, first_row, total_rows)
    total = struct.unpack_from("<Q", hdr, 8)[0]
    w.r.buf[base : base + len(hdr)] = torch.frombuffer(hdr, dtype=torch.uint8)
    trail = base + total - ring.ALIGN
    old = ring._TRAIL.unpack(bytes(w.r.buf[trail : trail + ring._TRAIL.size].tolist()))
    new = ring._TRAIL.pack(old[0], zlib.crc32(bytes(hdr) + b"p"), *old[2:])
    w.r.buf[trail : trail + len(new)] = torch.frombuffer(bytearray(new), dtype=torch.uint8)
    assert first == [1]
    _torn(d, "corrupt record header|torn record")


# -- the reader: a parted record is ONE HiddenStateRecord -------------------------------------------------------------

from helpers import mapped_pages as _mapped  # noqa: E402
from sglang_hs.reader import HiddenStateReader, StreamedRecordError, is_long  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

RH = 1000  # one aux layer + the post-norm state: RP = 2, 4,000 bytes a token in bf16 (not a page's divisor)
RP, ROW = 2, 2 * 1000 * 2
PAGE = 4096
N, PART = 600, 50  # a record of 2.4 MB of rows in parts of 200 KB
CHUNK = 64 << 10  # the streaming reader's part_bytes: 16 rows a chunk, 4 chunks a part
SMALL = 5


def _rrows(seed, T):
    return _rows(seed, T, RP, RH)


@pytest.fixture
def dump(tmp_path):
    """A dump whose ring holds about two parts (and the small records beside them), far less than the record."""
    cap = 2 * ring.record_bytes(PART, RP, RH, 2, 8, 0, N) + 4 * ring.record_bytes(SMALL, RP, RH, 2, 16, 64)
    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, RH), 8, torch.bfloat16, cap)
    w.dir = tmp_path
    assert cap < N * ROW / 3
    return w


def _streaming_reader(dump):
    """An acknowledging reader that streams the parted record (its rows are more than CHUNK bytes)."""
    return HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK, part_wait=20)


class Publisher(threading.Thread):
    """Publishes from a thread, as the server's finish worker does: whole records, a marker, and a record in parts
    (each part waits for ring room the reader gives back); `error` holds what it raised."""

    def __init__(self, w, items, timeout=20):
        super().__init__(daemon=True)
        self.w, self.items, self.timeout, self.error, self.done = w, items, timeout, None, threading.Event()

    def run(self):
        try:
            for kind, rid, seed, T in self.items:
                ids, rows = _ids(seed, T), _rrows(seed, T)
                if kind == "whole":
                    self.w.ring.publish(rid, ids, rows, timeout=self.timeout, prompt_len=2, next_token=seed)
                elif kind == "marker":
                    self.w.ring.publish(rid, torch.empty(0, dtype=torch.int32), torch.empty(0, RP, RH,
                                        dtype=torch.bfloat16), skipped=2, timeout=self.timeout)
                else:
                    for a in range(0, T, PART):
                        self.w.ring.publish(rid, ids if a == 0 else torch.empty(0, dtype=torch.int32),
                                            rows[a:a + PART], timeout=self.timeout, first_row=a, total_rows=T,
                                            prompt_len=T - 7, next_token=seed, meta=b'{"parts":1}')
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.done.set()

    def finish(self):
        assert self.done.wait(30), "the publisher is still waiting for ring room"
        assert self.error is None, self.error


ITEMS = [("whole", "before", 1, SMALL), ("marker", "m", 0, 0), ("parts", "long", 2, N), ("whole", "after", 3, SMALL)]


def _check_whole(rec, rid, seed):
    assert rec.rid == rid and torch.equal(rec.input_ids, _ids(seed, SMALL))
    assert torch.equal(rec.aux_hidden_states, _rrows(seed, SMALL)[:, :1])


def test_a_streamed_record_from_a_writer_thread_through_a_ring_smaller_than_it(dump):
    """The reader with part_bytes hands the record when its first part came and streams its rows through chunks() as
    the writer publishes the next parts into the room each released part leaves: every row equal to the source,
    the whole record never in the ring (its capacity holds ~2 parts) nor mapped in the reader (pagemap: about a
    part of ring pages at a time); a marker and whole records before and after it as usual."""
    pub = Publisher(dump, ITEMS)
    reader = _streaming_reader(dump)
    pub.start()
    try:
        before = reader.take("before", timeout=20)
        _check_whole(before, "before", 1)
        reader.ack(before)
        rec = reader.take("long", timeout=20)
        assert (rec.num_tokens, rec.prompt_len, rec.next_token, rec.meta) == (N, N - 7, 2, {"parts": 1})
        assert torch.equal(rec.input_ids, _ids(2, N)) and rec.row_nbytes == N * ROW and is_long(reader, rec)
        assert rec.aux_hidden_states.shape == (N, 1, RH) and rec.last_hidden_state.shape == (N, RH)
        with pytest.raises(StreamedRecordError, match="aux_hidden_states of the record of 'long' is streamed"):
            rec.aux_hidden_states[0]
        with pytest.raises(StreamedRecordError, match="reader.chunks"):
            torch.cat([rec.last_hidden_state])
        src, at, peak = _rrows(2, N), 0, 0
        for c in reader.chunks(rec):
            assert c.start == at and c.stop - c.start <= CHUNK // ROW, (c.start, c.stop, at)
            assert torch.equal(c.input_ids, _ids(2, N)[c.start:c.stop])
            assert torch.equal(c.aux_hidden_states, src[c.start:c.stop, :1]), c.start
            assert torch.equal(c.last_hidden_state, src[c.start:c.stop, 1]), c.start
            assert c.last_pre_norm is None
            peak, at = max(peak, len(_mapped(reader))), c.stop
        assert at == N
        with pytest.raises(RuntimeError, match="second time"):
            next(reader.chunks(rec))
        assert reader.intact(rec)
        reader.ack(rec)
        _check_whole(reader.take("after", timeout=20), "after", 3)
        assert reader.not_captured("m") == "not_sampled"
        pub.finish()
        part_pages, ring_pages = PART * ROW // PAGE, reader._rings[0].r.buf.numel() // PAGE
        print(f"most ring pages mapped at once: {peak} (a part is {part_pages} pages, the record {N * ROW // PAGE}, "
              f"the ring {ring_pages})")
        bound = part_pages + CHUNK // PAGE + 16  # a part, a chunk beyond it, the kernel's fault-around
        assert bound < ring_pages - 30 and peak <= bound, (peak, bound, ring_pages)
    finally:
        reader.close()


@pytest.mark.parametrize("kw", [dict(), dict(ack=True), dict(ack=True, zero_copy=True),
                                dict(ack=True, part_bytes=N * ROW)], ids=["eager", "ack", "zero_copy", "under_bound"])
def test_an_assembling_reader_gets_the_identical_whole_record(dump, kw):
    """A reader without part_bytes (or whose bound the record is under) copies each part into one whole record as
    it arrives and gives the part's ring bytes back at once (so the writer goes on through a ring smaller than the
    record): one record, ready at its last part, a copy even for a zero-copy reader."""
    pub = Publisher(dump, ITEMS)
    reader = HiddenStateReader(str(dump.dir), wait=1, **kw)
    pub.start()
    try:
        before = reader.take("before", timeout=20)
        _check_whole(before, "before", 1)
        reader.ack(before)  # else it holds the ring's TAIL back, and with it the parts behind it
        rec = reader.take("long", timeout=20)
        assert not rec.views and rec._stream is None and rec.seq == 3  # its first part's
        src = _rrows(2, N)
        assert torch.equal(rec.input_ids, _ids(2, N)) and (rec.prompt_len, rec.next_token) == (N - 7, 2)
        assert torch.equal(rec.aux_hidden_states, src[:, :1]) and torch.equal(rec.last_hidden_state, src[:, 1])
        assert [c.stop for c in reader.chunks(rec, 200 * ROW)] == [200, 400, 600]
        _check_whole(reader.take("after", timeout=20), "after", 3)
        pub.finish()
        assert reader.unacked() == (1 if kw.get("ack") else 0)  # "after" (the parts went back as they were copied)
    finally:
        reader.close()


def test_ack_before_reading_all_parts_releases_the_rest_as_they_arrive(dump):
    pub = Publisher(dump, ITEMS)
    reader = _streaming_reader(dump)
    pub.start()
    try:
        reader.ack(reader.take("before", timeout=20))
        rec = reader.take("long", timeout=20)
        it = reader.chunks(rec)
        c = next(it)
        assert torch.equal(c.aux_hidden_states, _rrows(2, N)[:c.stop, :1])
        reader.ack(rec)  # the consumer gives up on it after one chunk
        with pytest.raises(ValueError, match="acknowledged"):
            next(it)
        _check_whole(reader.take("after", timeout=20), "after", 3)  # the writer got past the record's parts
        pub.finish()
        assert reader.unacked() == 1  # "after" alone
    finally:
        reader.close()


def test_a_part_that_does_not_come_times_out_naming_the_unacked_records_holding_the_tail(dump):
    """A record read before the streamed one and not acknowledged holds the ring's TAIL back: the writer cannot
    publish the next part once the ring is full, and chunks() says so when its part_wait runs out. Acknowledging
    it lets the writer go on."""
    big = [("whole", f"b{i}", 10 + i, SMALL) for i in range(3)]
    pub = Publisher(dump, big + [("parts", "long", 2, N), ("whole", "after", 3, SMALL)], timeout=30)
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK, part_wait=1)
    pub.start()
    try:
        held = [reader.take(f"b{i}", timeout=20) for i in range(3)]
        rec = reader.take("long", timeout=20)
        with pytest.raises(TimeoutError, match=r"no part of the streamed record of 'long' \(seq 4\) after 1s: \d+ "
                           r"of its 600 rows arrived, \d+ read; 3 records read before it and not acknowledged \(seq 1, 2, 3\) "
                           "hold the ring's TAIL back"):
            for _ in reader.chunks(rec):
                pass
        for r in held:
            reader.ack(r)
        reader.ack(rec)
        _check_whole(reader.take("after", timeout=20), "after", 3)
        pub.finish()
    finally:
        reader.close()


# -- the consumers of a streamed record, end to end through the reader API --------------------------------------------

class _Bar:
    def update(self, n):
        pass

    def write(self, *a, **k):
        pass


MANIFEST = {"layer_ids": [1], "rows_per_layer": 1, "model_path": "/m"}


def _streamed(dump, items=(("parts", "long", 4, N),)):
    """A publisher thread of `items` and a streaming reader holding the parted record "long" (taken)."""
    pub = Publisher(dump, list(items))
    reader = _streaming_reader(dump)
    pub.start()
    rec = reader.take("long", timeout=20)
    assert rec.streamed
    return pub, reader, rec


@pytest.mark.parametrize("fmt", ["specforge", "safetensors", "deepspec"])
def test_the_extraction_writes_a_streamed_record_the_same_file(tmp_path, dump, fmt):
    """The --data run's sink stage (SampleWriter, its writer thread reading the chunks, which polls for the parts)
    writes the streamed record's file as the parts arrive: the file of the same rows written whole."""
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.sinks.base import TrainingSample
    from sglang_hs.extract.writer import SampleWriter

    pub, reader, rec = _streamed(dump)
    mask = (torch.arange(N) >= 100).long()
    try:
        sink = SINKS[fmt](str(tmp_path / "chunked"), "bf16")
        sink.describe_capture(MANIFEST)
        writer = SampleWriter(reader, sink)
        writer.submit(0, mask, rec, verify=False)
        writer.drain(_Bar())
        assert writer.stats.done == 1 and not writer.stats.failed, writer.stats.failed
        assert rec.aux_hidden_states is None  # acked once its file was in place
        pub.finish()
    finally:
        reader.close()
    rows = _rrows(4, N)
    whole = SINKS[fmt](str(tmp_path / "whole"), "bf16")
    whole.describe_capture(MANIFEST)
    last = None if whole.final_state == "pre-norm" else rows[:, 1]  # this ring holds the post-norm state only
    whole.write(TrainingSample(0, _ids(4, N), mask, rows[:, :1], last))
    a, b = open(whole.path(0), "rb").read(), open(sink.path(0), "rb").read()
    if fmt == "safetensors":
        from tests.unit.test_sink_chunks import _metadata_sorted

        a, b = _metadata_sorted(a), _metadata_sorted(b)
    assert a == b


def _logprob_case(seed):
    rows = _rrows(seed, N)
    g = torch.Generator().manual_seed(1)
    V = 64
    head = torch.randn(V, RH, generator=g) * 0.05
    tokens = torch.randint(0, V, (N + 1,), generator=g).tolist()
    logp = torch.log_softmax(rows[:, 1].float() @ head.T, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return head, tokens, [None] + logp.tolist()


@pytest.mark.parametrize("save_dtype", [None, "fp8"])
def test_verify_of_a_streamed_record_checks_in_the_one_pass(tmp_path, dump, save_dtype):
    """--verify of a streamed record (its parts are gone after the sink's pass): the logprob check is fed by that
    pass and the file read back against what it kept; both pass for the true rows, the run counts it verified."""
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.verify import LogprobCheck
    from sglang_hs.extract.writer import SampleWriter

    head, tokens, logp = _logprob_case(4)
    pub, reader, rec = _streamed(dump)
    try:
        sink = SINKS["safetensors"](str(tmp_path / "out"), save_dtype)
        sink.describe_capture(MANIFEST)
        writer = SampleWriter(reader, sink)
        lc = LogprobCheck(0, tokens, N, head, logp, part_bytes=CHUNK)
        writer.submit(0, torch.ones(N), rec, True, lc)
        writer.drain(_Bar())
        assert writer.stats.done == 1 and not writer.stats.failed, writer.stats.failed
        assert writer.stats.verified == 1 and writer.stats.verify_max_diff < 1e-3
        pub.finish()
    finally:
        reader.close()


@pytest.mark.parametrize("what", ["stored", "logprob"])
def test_verify_of_a_streamed_record_fails_for_a_wrong_row(tmp_path, dump, monkeypatch, what):
    """The same with one stored row changed on its way into the file (after what the pass kept), or the server's
    logprob of one row off: VerificationError naming the row, and no file."""
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.sinks.base import Chunk
    from sglang_hs.extract.verify import LogprobCheck
    from sglang_hs.extract.writer import SampleWriter

    head, tokens, logp = _logprob_case(4)
    bad = N - 3
    if what == "logprob":
        logp[bad + 1] += 1.0
    else:
        cls = SINKS["safetensors"]
        save_chunks = cls._save_chunks

        def altered(self, tmp, input_ids, loss_mask, aux, last, chunks):
            def alter(c):
                if c.start <= bad < c.stop:
                    a = c.aux.clone()
                    a[bad - c.start, 0, 5] += 1
                    return Chunk(c.start, c.stop, a, c.last)
                return c
            return save_chunks(self, tmp, input_ids, loss_mask, aux, last, map(alter, chunks))

        monkeypatch.setattr(cls, "_save_chunks", altered)
    pub, reader, rec = _streamed(dump)
    try:
        sink = SINKS["safetensors"](str(tmp_path / "out"), None)
        sink.describe_capture(MANIFEST)
        writer = SampleWriter(reader, sink)
        writer.submit(0, torch.ones(N), rec, True, LogprobCheck(0, tokens, N, head, logp, part_bytes=CHUNK))
        writer.drain(_Bar())
        assert writer.stats.done == 0 and len(writer.stats.failed) == 1
        msg = writer.stats.failed[0][1]
        want = (rf"1 stored rows differ .*\(first: row {bad}, layer 0 of 1\)" if what == "stored" else
                rf"row {bad} \(the state before token {bad + 1}\).*1 of {N} rows disagree")
        assert __import__("re").search(want, msg), msg
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))
        pub.finish()
    finally:
        reader.close()


@pytest.mark.parametrize("layout,dtype", [("specforge", torch.bfloat16), ("deepspec", torch.float8_e4m3fn)])
def test_the_live_dataset_spills_a_streamed_record(tmp_path, dump, layout, dtype):
    """live.spill_sample (LiveHiddenStates' sample of a long record) of a streamed record: the dict the in-memory
    path builds of the same rows, file-backed; and the router's spill_record (DataLoader workers) the same rows."""
    from sglang_hs.extract.sinks import deepspec_sample, specforge_sample
    from sglang_hs.live import spill_sample
    from sglang_hs.spill import spill_record

    spill = tmp_path / "spill"
    spill.mkdir()
    mask = (torch.arange(N) >= 50).long()
    pub, reader, rec = _streamed(dump, [("parts", "long", 6, N), ("parts", "again", 6, N)])
    try:
        out = spill_sample(reader, rec, mask, layout, dtype, str(spill))
        assert reader.intact(rec)
        reader.ack(rec)
        again = reader.take("again", timeout=20)
        routed = spill_record(reader, again, str(spill))
        assert reader.intact(again)
        reader.ack(again)
        pub.finish()
    finally:
        reader.close()
    rows = _rrows(6, N)
    build = deepspec_sample if layout == "deepspec" else specforge_sample
    want = build(_ids(6, N), mask, rows[:, :1], rows[:, 1], dtype=dtype)
    assert list(out) == list(want)
    for key in want:
        assert out[key].dtype == want[key].dtype and torch.equal(out[key], want[key]), key
    assert not routed.streamed and torch.equal(routed.input_ids, _ids(6, N))
    assert torch.equal(routed.aux_hidden_states, rows[:, :1]) and torch.equal(routed.last_hidden_state, rows[:, 1])


# -- several writers, a restarted server, a reader that stopped mid-record ---------------------------------------------

def test_parts_are_per_ring_with_several_writers(tmp_path):
    """Data-parallel attention: one ring per writer, each publishing a parted record from its own thread at once;
    one reader streams both, reading their chunks in turns (each ring's parts are its own record's)."""
    node = {"dp_ranks": [0, 1], "dp_size": 2, "nnodes": 1, "node_rank": 0}
    cap = 2 * ring.record_bytes(PART, RP, RH, 2, 8, 0, N) + 4 * ring.record_bytes(SMALL, RP, RH, 2, 16, 64)
    ws = [CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, RH), 8, torch.bfloat16, cap, writer_id=i,
                        node=node) for i in (0, 1)]
    pubs = [Publisher(w, [("parts", f"long{i}", 20 + i, N), ("whole", f"after{i}", 30 + i, SMALL)])
            for i, w in enumerate(ws)]
    reader = HiddenStateReader(str(tmp_path), wait=5, ack=True, part_bytes=CHUNK, part_wait=20)
    for p in pubs:
        p.start()
    try:
        recs = [reader.take(f"long{i}", timeout=20) for i in (0, 1)]
        assert [r.writer for r in recs] == [0, 1] and all(r.streamed for r in recs)
        for i, pair in enumerate(zip(*(reader.chunks(r) for r in recs))):
            for k, c in enumerate(pair):
                assert torch.equal(c.aux_hidden_states, _rrows(20 + k, N)[c.start:c.stop, :1]), (i, k)
        assert pair[0].stop == pair[1].stop == N
        for r in recs:
            reader.ack(r)
        for i in (0, 1):
            _check_whole(reader.take(f"after{i}", timeout=20), f"after{i}", 30 + i)
        for p in pubs:
            p.finish()
    finally:
        reader.close()


def test_a_server_restarted_before_the_last_part(dump):
    """The server restarted after a streamed record's first part: chunks() yields that part's rows, then raises
    ServerRestarted naming the record; the reader (reattach=True) goes on with the new server's records."""
    from sglang_hs.reader import ServerRestarted

    ids, rows = _ids(7, N), _rrows(7, N)
    dump.ring.publish("long", ids, rows[:PART], first_row=0, total_rows=N, timeout=5)
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK, part_wait=20, reattach=True)
    try:
        rec = reader.take("long", timeout=5)
        w1 = CaptureWriter(str(dump.dir), CaptureSpec.resolve([1], True, 4, RH), 8, torch.bfloat16,
                           dump.ring.capacity + ring.HEADER_BYTES)  # the restarted server
        w1.ring.publish("new", _ids(8, SMALL), _rrows(8, SMALL), timeout=5, prompt_len=2, next_token=8)
        got = 0
        with pytest.raises(ServerRestarted, match="restarted before the last part of the streamed record of 'long'"):
            for c in reader.chunks(rec):
                assert torch.equal(c.aux_hidden_states, rows[c.start:c.stop, :1])
                got = c.stop
        assert got == PART
        reader.ack(rec)
        _check_whole(reader.take("new", timeout=5), "new", 8)
        assert reader.restarts == 1
    finally:
        reader.close()


def test_a_reader_after_one_that_stopped_mid_record_skips_its_orphan_parts(dump):
    """A reader closed after reading (and releasing) the first part of a streamed record: the next reader starts
    after that part, skips the record's remaining parts (lost: counted in orphan_parts) and reads on."""
    pub = Publisher(dump, ITEMS)
    first = _streaming_reader(dump)
    pub.start()
    try:
        first.ack(first.take("before", timeout=20))
        it = first.chunks(first.take("long", timeout=20))
        for _ in range(-(-PART // (CHUNK // ROW)) + 1):  # into the second part: the first one went back
            next(it)
    finally:
        first.close()
    reader = _streaming_reader(dump)
    try:
        _check_whole(reader.take("after", timeout=20), "after", 3)
        assert reader.orphan_parts == N // PART - 1 and "long" not in reader.ready_rids()
        pub.finish()
    finally:
        reader.close()


def test_take_of_a_record_behind_an_unread_streamed_one_says_why_it_waits(dump):
    """A record published after a streamed one comes only once the streamed one's parts were read (they fill the
    ring before it): take() of it times out saying so."""
    pub = Publisher(dump, ITEMS)
    reader = _streaming_reader(dump)
    pub.start()
    try:
        reader.ack(reader.take("before", timeout=20))
        rec = reader.take("long", timeout=20)
        with pytest.raises(TimeoutError, match=r"the record of 'long' is coming in parts, \d+ of its 600 rows so far: "
                           r"the server publishes its next part only into the ring room those acks, and reading its "
                           r"chunks\(\), give back"):
            reader.take("after", timeout=1)
        assert sum(c.num_tokens for c in reader.chunks(rec)) == N
        reader.ack(rec)
        _check_whole(reader.take("after", timeout=20), "after", 3)
        pub.finish()
    finally:
        reader.close()


@pytest.mark.parametrize("wrong", [False, True])
def test_the_extractions_verify_of_a_streamed_record_defers_its_logprob_check_to_the_sinks_pass(tmp_path, dump, wrong):
    """Extraction._complete with --verify: a streamed record's rows come once, so its logprob check is not run over
    its chunks there (that would consume the parts before the sink) but fed by the sink's pass: the sample is
    written and counted verified, or with one logprob off fails the run's verification naming the row."""
    from types import SimpleNamespace

    from sglang_hs.extract.dataset import Sample
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.sources.server import Extraction

    ids = _ids(4, N).tolist()
    tokens = ids + [5]
    g = torch.Generator().manual_seed(2)
    head = torch.randn(2048, RH, generator=g) * 0.05
    rows = _rrows(4, N)
    logp = torch.log_softmax(rows[:, 1].float() @ head.T, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    entries = [[None, tokens[0]]] + [[float(x), t] for x, t in zip(logp, tokens[1:])]
    if wrong:
        entries[100][0] += 1.0
    reply = {"output_ids": [5], "meta_info": {"input_token_logprobs": entries[:N], "output_token_logprobs": entries[N:]}}
    pub, reader, rec = _streamed(dump)
    try:
        sink = SINKS["safetensors"](str(tmp_path / "out"), None)
        sink.describe_capture(MANIFEST)
        ext = Extraction(SimpleNamespace(temperature=0.0), "http://unused", reader, sink, None, head, progress=False)
        ext._complete(Sample(0, ids, [1] * N), reply, rec, True)
        ext.drain(_Bar())
        pub.finish()
    finally:
        reader.close()
    if wrong:
        assert ext.stats.done == 0 and ext.stats.verified == 0
        assert "sample 0: row 99 (the state before token 100)" in ext.verify_failure, ext.verify_failure
        assert not list((tmp_path / "out").glob("*.safetensors"))
    else:
        assert (ext.stats.done, ext.stats.verified, ext.stats.failed) == (1, 1, []), ext.stats.failed
        assert ext.stats.verify_max_diff < 1e-3


def test_the_harvester_writes_a_streamed_record(tmp_path, dump):
    """The harvester (--harvest) handles a streamed record like any long one: its file from the chunks as the parts
    arrive, the same file as the rows written whole, its journal line, then the ack."""
    from safetensors.torch import load_file

    from sglang_hs.extract import harvest
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.stats import Stats

    pub, reader, rec = _streamed(dump)
    out = tmp_path / "out"
    out.mkdir()
    try:
        sink = SINKS["safetensors"](str(out), None)
        sink.describe_capture(MANIFEST)
        journal = harvest.Journal(str(out))
        h = harvest.Harvester(reader, sink, journal, Stats())
        h.handle(rec)
        assert h.stats.done == 1 and rec.aux_hidden_states is None  # written, then acked
        pub.finish()
    finally:
        reader.close()
    (index,) = journal.files
    t = load_file(sink.path(index))
    assert torch.equal(t["hidden_states"], _rrows(4, N)[:, :1]) and t["token_ids"].tolist() == _ids(4, N).tolist()
    assert journal.files[index]["tokens"] == N and journal.files[index]["prompt_len"] == N - 7


def test_chunks_of_a_streamed_record_after_close_refuse(dump):
    """close() hands the ring to the next reader: a streamed record's chunks() stops there (its parts may be
    written over once that reader acknowledges them), and the record comes again whole to the next reader."""
    pub = Publisher(dump, ITEMS)
    first = _streaming_reader(dump)
    pub.start()
    try:
        first.ack(first.take("before", timeout=20))
        it = first.chunks(first.take("long", timeout=20))
        next(it)
    finally:
        first.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    reader = _streaming_reader(dump)
    try:
        rec = reader.take("long", timeout=20)  # its first part was never released: it comes again, whole
        assert sum(c.num_tokens for c in reader.chunks(rec)) == N and reader.orphan_parts == 0
        reader.ack(rec)
        _check_whole(reader.take("after", timeout=20), "after", 3)
        pub.finish()
    finally:
        reader.close()


@pytest.mark.parametrize("use", [lambda s: s[0], lambda s: s.float(), lambda s: s.contiguous(), lambda s: s + 1,
                                 lambda s: 2 * s, lambda s: torch.cat([s]), lambda s: torch.zeros(1) @ s,
                                 lambda s: list(s), lambda s: bool(s), lambda s: __import__("numpy").asarray(s),
                                 lambda s: s.view(torch.uint8)],
                         ids=["index", "float", "contiguous", "add", "rmul", "cat", "matmul", "iter", "bool", "numpy",
                              "view"])
def test_a_streamed_records_state_stand_in_refuses_every_read(use):
    """StreamedRows (a streamed record's aux_hidden_states, last_hidden_state, last_pre_norm): shape and dtype for a
    file's layout, and every read a StreamedRecordError naming the record and chunks(), never a wrong answer."""
    from sglang_hs.reader import StreamedRows

    s = StreamedRows("r-1", "last_hidden_state", (N, RH), torch.bfloat16)
    assert (s.shape, s.dtype, s.dim(), s.size(0), s.numel(), s.element_size()) == ((N, RH), torch.bfloat16, 2, N,
                                                                                   N * RH, 2)
    with pytest.raises(StreamedRecordError, match=r"last_hidden_state of the record of 'r-1' is streamed in parts .*"
                                                  r"read its rows with reader.chunks\(record\)"):
        use(s)


@pytest.mark.parametrize("parts", [False, True])
def test_the_largest_record_a_consumer_must_hold_counts_records_in_parts(tmp_path, monkeypatch, parts):
    """reader.largest_record_bytes (the Mooncake publisher's segment warning): half the ring when every record is
    whole (admission's bound); a record of the whole context when the server publishes long records in parts
    (the manifest's record_part_bytes, --hs-record-part-size), far more than the ring. Before: half the ring
    either way, so a publisher whose segment held half the ring was never warned of a 2.4 MB record; and a whole
    context's record counted with a 256-byte request id, short of one named by the longest id a record holds."""
    if parts:
        monkeypatch.setenv("SGLANG_HS_RECORD_PART_BYTES", str(PART * ROW))
    cap = 4 * ring.record_bytes(PART, RP, RH, 2, 8, 0, N)
    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, RH), 8, torch.bfloat16, cap, context_len=N)
    try:
        with HiddenStateReader(str(tmp_path), wait=1) as reader:
            assert reader.manifest["record_part_bytes"] == (PART * ROW if parts else 0)
            largest = reader.largest_record_bytes()
            if parts:
                longest = ring.record_bytes(N, RP, RH, 2, ring.MAX_RID_BYTES, admission.meta_bound(N))
                assert largest >= longest > N * ROW > cap
            else:
                assert largest == w.ring.capacity // 2
    finally:
        w.close()
