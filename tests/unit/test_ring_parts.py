"""Records in parts (issue 47, the writer half's ring format, version 9): a record larger than the server's bound
leaves the ring a part at a time, each part a record of its own (rows [first_row, first_row + T) of the record's
total_rows; the first part holds all the record's token ids, the later ones none). The ring's own checks (round
trip, the torn cases: a part out of order, a gap in the rows, a foreign record between parts, bad id counts), then
the reader's: a parted record is ONE HiddenStateRecord, assembled by copy (no part_bytes, or small enough) or
streamed a part at a time through chunks() (more than part_bytes of rows), with a ring smaller than the record."""
import struct
import threading
import time
import zlib

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.store import ring  # noqa: E402

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
