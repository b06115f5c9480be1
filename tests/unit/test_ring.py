"""The output ring: records cross processes whole and in order, wrap around, and corruption is caught."""
import multiprocessing as mp
import struct

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.shm import SharedRegion  # noqa: E402

N, P, H = 300, 3, 40
PROMPT_LEN_AT = 38  # the prompt length's byte offset in a record header (ring._REC)


def _record(i):
    g = torch.Generator().manual_seed(i)
    T = 1 + (i * 7919) % 57
    ids = torch.randint(0, 1000, (T,), generator=g, dtype=torch.int32)
    rows = torch.randn(T, P, H, generator=g).to(torch.bfloat16)
    return f"req-{i}-é", ids, rows


def _said(i, T):
    """Where record i's prompt ends (0..T + 1: T + 1 when nothing was generated) and its next token."""
    return dict(prompt_len=i % (T + 2), next_token=(i * 31) % 1000)


def _writer(dir_path, capacity):
    w = ring.RingWriter.create(dir_path, "ring-w0.bin", capacity)
    for i in range(N):
        rid, ids, rows = _record(i)
        w.publish(rid, ids, rows, timeout=60, **_said(i, len(ids)))


def test_records_cross_processes_whole_in_order_with_wraparound(tmp_path):
    capacity = 3 * ring.record_bytes(57, P, H, 2, 16) + 1000  # small: forces wraps and back-pressure
    p = mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), capacity))
    p.start()
    import time

    # RingWriter.create writes the header, then makes the reader's offset file: once that is there, the
    # ring is ready to open (the ring file alone exists before its header is written)
    deadline = time.monotonic() + 120
    while not (tmp_path / ring.offset_name("ring-w0.bin")).exists():
        assert p.exitcode is None and time.monotonic() < deadline
        time.sleep(0.01)
    reader = ring.RingReader.open(str(tmp_path), "ring-w0.bin")
    got = []
    deadline = time.monotonic() + 120
    while len(got) < N and time.monotonic() < deadline:
        got += reader.drain()
    p.join(30)
    assert p.exitcode == 0 and len(got) == N
    for i, rec in enumerate(got):
        rid, ids, rows = _record(i)
        assert (rec.rid, rec.seq) == (rid, i + 1)
        assert torch.equal(rec.input_ids, ids) and torch.equal(rec.rows, rows)
        assert dict(prompt_len=rec.prompt_len, next_token=rec.next_token) == _said(i, len(ids))


def test_full_ring_blocks_then_times_out_without_overwriting(tmp_path):
    w = ring.RingWriter.create(str(tmp_path), "r", ring.record_bytes(10, P, H, 2, 8) * 2)
    recs = {rid: (torch.arange(10, dtype=torch.int32) + 100 * i,
                  torch.randn(10, P, H, generator=torch.Generator().manual_seed(i)).bfloat16())
            for i, rid in enumerate("abc")}  # rows differ by record, token, slot and index
    w.publish("a", *recs["a"])
    w.publish("b", *recs["b"])
    with pytest.raises(TimeoutError, match="no room"):
        w.publish("c", *recs["c"], timeout=0.2)
    reader = ring.RingReader.open(str(tmp_path), "r")
    got = reader.drain()
    assert [r.rid for r in got] == ["a", "b"]
    for r in got:  # not a byte of c over them
        assert torch.equal(r.input_ids, recs[r.rid][0]) and torch.equal(r.rows, recs[r.rid][1]), r.rid
    w.publish("c", *recs["c"], timeout=1)  # room again once read
    (c,) = reader.drain()
    assert c.rid == "c" and torch.equal(c.input_ids, recs["c"][0]) and torch.equal(c.rows, recs["c"][1])


def test_record_larger_than_ring_is_refused(tmp_path):
    w = ring.RingWriter.create(str(tmp_path), "r", 4096)
    with pytest.raises(ValueError, match="exceeds the output ring's capacity .* --hs-ring-size"):
        w.publish("big", torch.zeros(100, dtype=torch.int32), torch.zeros(100, P, H, dtype=torch.bfloat16))


def test_corruption_is_detected_never_emitted(tmp_path):
    w = ring.RingWriter.create(str(tmp_path), "r", 1 << 16)
    w.publish("x", torch.arange(5, dtype=torch.int32), torch.ones(5, P, H, dtype=torch.bfloat16))
    region = SharedRegion.open(str(tmp_path), "r")
    trailer = ring.HEADER_BYTES + ring.record_bytes(5, P, H, 2, 1) - ring.ALIGN
    region.buf[trailer + 8] ^= 0xFF  # the trailer's sequence number
    with pytest.raises(ring.TornRecord, match="torn record seq 1"):
        ring.RingReader.open(str(tmp_path), "r").drain()


@pytest.mark.parametrize("total", [0, 64, 1 << 40])
@pytest.mark.parametrize("mode", ["drain", "read_ahead"])
def test_a_corrupt_skip_marker_is_refused_not_looped_on(tmp_path, total, mode):
    import threading

    rec = ring.record_bytes(10, P, H, 2, 1)
    w = ring.RingWriter.create(str(tmp_path), "r", 2 * rec + rec // 2)
    ids, rows = torch.arange(10, dtype=torch.int32), torch.ones(10, P, H, dtype=torch.bfloat16)
    w.publish("a", ids, rows)
    w.publish("b", ids, rows)
    ring.RingReader.open(str(tmp_path), "r").drain()
    w.publish("c", ids, rows)  # does not fit before the end: a SKIP marker at 2 * rec, then c at 0
    region = SharedRegion.open(str(tmp_path), "r")
    skip = ring.HEADER_BYTES + 2 * rec
    assert struct.unpack_from("<I", bytes(region.buf[skip : skip + 4].tolist()))[0] == ring.SKIP_MAGIC
    region.buf[skip + 8 : skip + 16] = torch.frombuffer(bytearray(struct.pack("<Q", total)), dtype=torch.uint8)
    reader, out = ring.RingReader.open(str(tmp_path), "r"), []

    def read():
        try:
            getattr(reader, mode)()
        except ring.TornRecord as e:
            out.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the reader loops on a corrupt skip marker"
    assert out and "corrupt skip marker" in str(out[0])


@pytest.mark.parametrize("what, message", [("magic", "not an sglang-hs output ring"), ("version", "format version 99")])
def test_foreign_or_future_files_are_refused(tmp_path, what, message):
    ring.RingWriter.create(str(tmp_path), "r", 4096)
    region = SharedRegion.open(str(tmp_path), "r")
    if what == "magic":
        region.buf[0] = ord("X")
    else:
        region.buf[ring.OFF_VERSION : ring.OFF_VERSION + 4] = torch.frombuffer(bytearray(struct.pack("<I", 99)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        ring.RingReader.open(str(tmp_path), "r")


def test_store_that_does_not_fit_names_the_flags(tmp_path):
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    spec = CaptureSpec.resolve([0], True, 8, 7168)
    import os
    import shutil
    import tempfile

    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="shrink it with --max-total-tokens or --mem-fraction-static"):
            CaptureWriter(d, spec, 1 << 40, torch.bfloat16, 1 << 20)
        with pytest.raises(RuntimeError, match="lower --hs-ring-size"):
            CaptureWriter(d, spec, 16, torch.bfloat16, 1 << 50)
    finally:
        shutil.rmtree(d)


def test_prompt_length_and_next_token_are_checked_and_default_to_all_prompt(tmp_path):
    """A record says where its prompt ends and which token followed its last row (format 4). Left out,
    the whole record is prompt and the next token unknown (-1). Out of range on the writer's side is a
    bug (assert); in the ring, a header altered without its checksum is torn, one that says a prompt
    longer than T + 1 is corrupt even with a matching checksum."""
    import zlib

    w = ring.RingWriter.create(str(tmp_path), "r", 1 << 16)
    ids, rows = torch.arange(5, dtype=torch.int32), torch.ones(5, P, H, dtype=torch.bfloat16)
    w.publish("plain", ids, rows)
    with pytest.raises(AssertionError):
        w.publish("too-long", ids, rows, prompt_len=7)
    reader = ring.RingReader.open(str(tmp_path), "r")
    (plain,) = reader.drain()
    assert (plain.prompt_len, plain.next_token) == (5, -1)
    region = SharedRegion.open(str(tmp_path), "r")
    rec = ring.record_bytes(5, P, H, 2, len("said"))
    for prompt_len, fix_crc, message in ((3, False, "checksum mismatch"), (7, True, "corrupt record header")):
        w.publish("said", ids, rows, prompt_len=2, next_token=77)
        base = ring.HEADER_BYTES + ring.record_bytes(5, P, H, 2, len("plain")) + (rec if fix_crc else 0)
        hdr = bytearray(bytes(region.buf[base : base + ring._REC.size].tolist()))
        assert ring._REC.unpack(bytes(hdr))[9:12] == (2, 77, 0)  # prompt_len, next_token, meta_len
        struct.pack_into("<I", hdr, PROMPT_LEN_AT, prompt_len)
        region.buf[base : base + len(hdr)] = torch.frombuffer(hdr, dtype=torch.uint8)
        if fix_crc:
            trail = base + rec - ring.ALIGN
            old = ring._TRAIL.unpack(bytes(region.buf[trail : trail + ring._TRAIL.size].tolist()))
            new = ring._TRAIL.pack(old[0], zlib.crc32(bytes(hdr) + b"said"), *old[2:])
            region.buf[trail : trail + len(new)] = torch.frombuffer(bytearray(new), dtype=torch.uint8)
        with pytest.raises(ring.TornRecord, match=message):
            ring.RingReader.open(str(tmp_path), "r").drain()
        if not fix_crc:  # put it back and consume it, so the next record is the one altered
            struct.pack_into("<I", hdr, PROMPT_LEN_AT, 2)
            region.buf[base : base + len(hdr)] = torch.frombuffer(hdr, dtype=torch.uint8)
            (said,) = ring.RingReader.open(str(tmp_path), "r").drain()
            assert (said.prompt_len, said.next_token) == (2, 77)


def test_request_ids_up_to_the_header_limit_and_a_refused_one_leaves_the_ring_as_it_was(tmp_path):
    """The record header holds the rid's utf-8 length in 16 bits: 65,535 bytes go through whole; one byte
    more (or a multi-byte character that makes it longer) is refused with a ValueError naming the limit,
    before anything moves: HEAD and the sequence number stay, and the next record is read after the
    last one with no gap (a bump before the refusal made every later reader refuse the ring as a replay
    or a gap). A copy that fails after the encoding leaves no gap either."""
    w = ring.RingWriter.create(str(tmp_path), "r", 1 << 20)
    ids, rows = torch.arange(3, dtype=torch.int32), torch.ones(3, P, H, dtype=torch.bfloat16)
    longest = "r" * ring.MAX_RID_BYTES
    assert ring.MAX_RID_BYTES == 65535 and w.publish(longest, ids, rows) == 1
    head = w.r.load_acquire(ring.OFF_HEAD)
    for bad in ("r" * (ring.MAX_RID_BYTES + 1), "é" * (ring.MAX_RID_BYTES // 2 + 1)):
        with pytest.raises(ValueError, match="request id of .* bytes .* at most 65535"):
            w.publish(bad, ids, rows)
        assert w.seq == 1 and w.r.load_acquire(ring.OFF_HEAD) == head  # nothing moved
    with pytest.raises(ValueError, match="cannot be encoded"):  # any field out of range: refused the same way
        w.publish("wide", torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1 << 16, 1, dtype=torch.bfloat16))
    assert w.seq == 1 and w.r.load_acquire(ring.OFF_HEAD) == head
    with pytest.raises(RuntimeError, match="outside"):  # the gather fails after the encoding (a slot outside the store)
        w.publish("bad-slot", ids, gather_from=torch.zeros(4, P, H, dtype=torch.bfloat16),
                  slots=torch.tensor([0, 1, 99]))
    assert w.seq == 1 and w.r.load_acquire(ring.OFF_HEAD) == head
    assert w.publish("next", ids + 1, rows * 2) == 2
    recs = ring.RingReader.open(str(tmp_path), "r").drain()
    assert [(r.rid, r.seq) for r in recs] == [(longest, 1), ("next", 2)]
    assert torch.equal(recs[1].input_ids, ids + 1) and torch.equal(recs[1].rows, rows * 2)


def test_a_records_metadata_crosses_whole_and_is_checksummed(tmp_path):
    """A record's metadata (encode_meta: a JSON object after the request id) reaches the reader as it was
    written, gathered or given rows alike, and lengthens the record by its aligned size only; a record
    without it reads as {}. A byte of it altered is a checksum mismatch, never a record with other metadata."""
    w = ring.RingWriter.create(str(tmp_path), "r", 1 << 16)
    ids, rows = torch.arange(5, dtype=torch.int32), torch.randn(5, P, H).to(torch.bfloat16)
    meta = {"speculative": {"verify_steps": 3, "accepted_drafts": [1, 0, 2]}, "é": "ü" * 40}
    raw = ring.encode_meta(meta)
    assert ring.encode_meta(None) == ring.encode_meta({}) == b"" and len(raw) > ring.ALIGN
    w.publish("with", ids, rows, meta=raw)
    w.publish("gathered", ids, gather_from=rows.repeat(2, 1, 1), slots=torch.tensor([9, 8, 7, 6, 5]), meta=raw)
    w.publish("without", ids, rows)
    a, b, c = ring.RingReader.open(str(tmp_path), "r").drain()
    assert (a.meta, b.meta, c.meta) == (meta, meta, {}) and torch.equal(a.rows, rows) and torch.equal(a.input_ids, ids)
    assert torch.equal(b.rows, rows.repeat(2, 1, 1)[[9, 8, 7, 6, 5]])
    assert ring.record_bytes(5, P, H, 2, 4, len(raw)) - ring.record_bytes(5, P, H, 2, 4) == ring._align(len(raw))
    # one byte of the metadata altered: the trailer's CRC no longer matches
    w.publish("altered", ids, rows, meta=raw)
    region = SharedRegion.open(str(tmp_path), "r")
    base = ring.HEADER_BYTES + 3 * ring.record_bytes(5, P, H, 2, 0, 0) + ring._align(len("with")) \
        + ring._align(len("gathered")) + ring._align(len("without")) + 2 * ring._align(len(raw))
    hdr = bytes(region.buf[base : base + ring._REC.size].tolist())
    assert ring._REC.unpack(hdr)[11] == len(raw)  # meta_len
    m0 = base + ring.ALIGN + ring._align(len("altered"))
    assert bytes(region.buf[m0 : m0 + len(raw)].tolist()) == raw
    region.buf[m0 + 5] = region.buf[m0 + 5] ^ 1
    with pytest.raises(ring.TornRecord, match="metadata altered .checksum mismatch"):
        ring.RingReader.open(str(tmp_path), "r").drain()
    # a writer of another build that wrote something not an object is refused too (its CRC matches)
    region.buf[m0 + 5] = region.buf[m0 + 5] ^ 1
    w2 = ring.RingWriter.create(str(tmp_path), "r2", 1 << 14)
    w2.publish("list", ids, rows, meta=b"[1,2]")
    with pytest.raises(ring.TornRecord, match="metadata is not a JSON object"):
        ring.RingReader.open(str(tmp_path), "r2").drain()
