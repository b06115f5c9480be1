"""Fuzzing the reader's parsing of the output ring (hypothesis): whatever happens to the ring's header,
its counters or the headers and trailers of its records, the reader either returns records exactly as
published, in order, each once, or refuses with TornRecord / ValueError naming the file. Never another
exception, never a made-up, partial or repeated record. Cases hypothesis once found stay as regression
tests in fuzz_corpus/ring_cases.json (a failing example is added there when fixed)."""
import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.shm import SharedRegion  # noqa: E402

P, H = 2, 24
CORPUS = os.path.join(os.path.dirname(__file__), "fuzz_corpus", "ring_cases.json")


def _records():
    out = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        T = 3 + 5 * i
        out.append((f"r{i}", torch.randint(0, 99, (T,), generator=g, dtype=torch.int32),
                    torch.randn(T, P, H, generator=g).bfloat16()))
    return out


RECORDS = _records()
CAPACITY = 2 * sum(ring.record_bytes(ids.shape[0], P, H, 2, len(rid)) for rid, ids, _ in RECORDS)


def _ring(path, n_published=4, skip_first=0):
    w = ring.RingWriter.create(str(path), "ring-w0.bin", CAPACITY)
    if skip_first:  # consume some so later records wrap around the end
        r = ring.RingReader.open(str(path), "ring-w0.bin")
        for rid, ids, rows in RECORDS[:skip_first]:
            w.publish(rid, ids, rows)
        r.drain()
    for rid, ids, rows in RECORDS[:n_published]:
        w.publish(rid, ids, rows)
    return SharedRegion.open(str(path), "ring-w0.bin")


def _control_offsets(skip_first):
    """Byte offsets of everything the reader parses: the file header and each record's header/trailer."""
    offs = list(range(0, 136))  # magic, version, capacity, pid, HEAD (64), TAIL (128)
    pos = 0
    for rid, ids, _ in (RECORDS[:skip_first] + RECORDS)[: skip_first + 4]:
        total = ring.record_bytes(ids.shape[0], P, H, 2, len(rid))
        if (pos % CAPACITY) + total > CAPACITY:
            pos += CAPACITY - pos % CAPACITY
        base = ring.HEADER_BYTES + pos % CAPACITY
        offs += list(range(base, base + ring._REC.size)) + list(range(base + total - ring.ALIGN,
                                                                       base + total - ring.ALIGN + ring._TRAIL.size))
        pos += total
    return offs


def _check(region, path):
    try:
        got = ring.RingReader.open(str(path), "ring-w0.bin").drain()
    except (ring.TornRecord, ValueError) as e:
        assert "ring-w0.bin" in str(e)
        return
    rids = [r.rid for r in got]
    assert len(rids) == len(set(rids)), f"a record emitted twice: {rids}"
    for rec in got:
        match = [x for x in RECORDS if x[0] == rec.rid]
        assert match, f"made-up record {rec.rid!r}"
        _, ids, rows = match[0]
        assert torch.equal(rec.input_ids, ids) and torch.equal(rec.rows, rows), f"record {rec.rid} altered"


def _apply(region, case):
    buf = region.buf
    for off, val in case.get("bytes", []):
        buf[off % buf.numel()] = val
    for name, val in case.get("words", []):
        off = {"head": ring.OFF_HEAD, "tail": ring.OFF_TAIL, "capacity": ring.OFF_CAPACITY}[name]
        buf[off: off + 8] = torch.frombuffer(bytearray(struct.pack("<Q", val % 2**64)), dtype=torch.uint8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(skip=st.sampled_from([0, 2]), data=st.data())
def test_mutated_control_bytes_never_yield_a_wrong_record(tmp_path_factory, skip, data):
    path = tmp_path_factory.mktemp("fuzz")
    region = _ring(path, skip_first=skip)
    offsets = _control_offsets(skip)
    case = {
        "bytes": data.draw(st.lists(st.tuples(st.sampled_from(offsets), st.integers(0, 255)), max_size=4)),
        "words": data.draw(st.lists(st.tuples(st.sampled_from(["head", "tail", "capacity"]),
                                              st.integers(0, 4 * CAPACITY) | st.integers(0, 2**64 - 1)), max_size=2)),
    }
    _apply(region, case)
    _check(region, path)


def _corpus():
    with open(CORPUS) as f:
        return json.load(f)


@pytest.mark.parametrize("case", _corpus(), ids=lambda c: c["name"])
def test_corpus_of_found_cases(tmp_path, case):
    region = _ring(tmp_path, skip_first=case.get("skip", 0))
    _apply(region, case)
    _check(region, tmp_path)


# a record in parts (ring format 9) between two whole ones: (rid, first_row, T) of each published record
PARTED_T = 12
PARTS = [("w0", 0, 3), ("p", 0, 5), ("p", 5, 4), ("p", 9, 3), ("w1", 0, 4)]


def _parted_ring(path):
    g = torch.Generator().manual_seed(7)
    ids, rows = torch.randint(0, 99, (PARTED_T,), generator=g, dtype=torch.int32), torch.randn(PARTED_T, P, H,
                                                                                                generator=g).bfloat16()
    w = ring.RingWriter.create(str(path), "ring-w0.bin", CAPACITY)
    placed = []
    for rid, a, T in PARTS:
        if rid == "p":
            w.publish(rid, ids if a == 0 else torch.empty(0, dtype=torch.int32), rows[a:a + T], first_row=a,
                      total_rows=PARTED_T)
            n_ids = PARTED_T if a == 0 else 0
        else:
            w.publish(rid, ids[:T], rows[:T])
            n_ids = T
        placed.append(ring.record_bytes(T, P, H, 2, len(rid), 0, n_ids))
    return SharedRegion.open(str(path), "ring-w0.bin"), ids, rows, placed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_control_bytes_around_parts_never_yield_a_wrong_part(tmp_path_factory, data):
    """The same for a ring holding a record in parts: the reader returns a prefix of what was published, each
    record or part exactly (its ids, rows, rows [first_row, ..) of total_rows), in order, or refuses."""
    path = tmp_path_factory.mktemp("fuzz")
    region, ids, rows, sizes = _parted_ring(path)
    offsets, pos = list(range(0, 136)), 0
    for total in sizes:
        base = ring.HEADER_BYTES + pos
        offsets += list(range(base, base + ring._REC.size)) + list(range(base + total - ring.ALIGN,
                                                                         base + total - ring.ALIGN + ring._TRAIL.size))
        pos += total
    _apply(region, {"bytes": data.draw(st.lists(st.tuples(st.sampled_from(offsets), st.integers(0, 255)),
                                                max_size=4))})
    try:
        got = ring.RingReader.open(str(path), "ring-w0.bin").drain()
    except (ring.TornRecord, ValueError) as e:
        assert "ring-w0.bin" in str(e)
        return
    assert len(got) <= len(PARTS)
    for rec, (rid, a, T) in zip(got, PARTS):
        assert (rec.rid, rec.first_row, rec.rows.shape[0]) == (rid, a, T), (rec.rid, rec.first_row)
        assert rec.total_rows == (PARTED_T if rid == "p" else 0)
        want_ids = (ids if a == 0 else ids[:0]) if rid == "p" else ids[:T]
        assert torch.equal(rec.input_ids, want_ids) and torch.equal(rec.rows, rows[a:a + T]), rec.rid
