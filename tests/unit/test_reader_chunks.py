"""Long records read in chunks (issue 47, item 2, the reader half): HiddenStateReader(part_bytes=N) hands a record
of more than N row bytes as views of the real ring, and chunks() yields its rows in order, each chunk exactly the
published rows, unmapping from this process the ring pages of the chunks behind it. Checked with the pages
/proc/self/pagemap says this process has mapped in the reader's mapping (the test process also holds the
writer's, fully populated mapping of the same file, so RssShmem of the whole process would not tell): while a
record of 2.4 MB goes by in 64 KiB chunks at most ~2 chunks of it are mapped; once done, every page wholly
inside its rows is unmapped and every other page the reader read (the ring's header, the record's token ids and
trailer, the records beside it, views still held) stays. Records at odd offsets (request ids and metadata of
odd lengths before the rows), one that lands at the start of the buffer after the writer wrapped around, and a
copying reader (small records copied and their pages let go at once, the long one a view until acked)."""
import mmap

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from helpers import mapped_pages as _mapped, mapping_of  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

K, H = 1, 1000  # one aux layer + the post-norm state: P = 2, 4,000 bytes per token in bf16 (not a page's divisor)
P, ROW = K + 1, (K + 1) * H * 2
PAGE = mmap.PAGESIZE
LONG_T = 600  # 2.4 MB of rows
CHUNK = 64 << 10  # 16 rows a chunk
SMALL_T = 5


def _rows(seed, T):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, P, H, generator=g).bfloat16()


def _ids(seed, T):
    return torch.arange(T, dtype=torch.int32) * 7 + seed


def _publish(w, seed, T, rid=None):
    w.ring.publish(rid or f"r{seed}", _ids(seed, T), _rows(seed, T), timeout=5)


def _pages_inside(reader, rec):
    """Pages of the mapping wholly inside the record's rows."""
    start, end = rec._rows_at, rec._rows_at + rec.num_tokens * ROW
    return set(range(-(-start // PAGE), end // PAGE))


def _pages_of(reader, t):
    """Pages of the mapping that tensor `t` (a view of the ring) touches."""
    base = reader._rings[0].r.buf.data_ptr()
    lo = t.data_ptr() - base
    return set(range(lo // PAGE, (lo + t.numel() * t.element_size() - 1) // PAGE + 1))


def _consume(reader, rec, seed, max_bytes=None, peak=None):
    """Read rec's chunks, checking each against the published rows; `peak`: a list that gets the most pages of
    the record's rows mapped at once."""
    rows, ids = _rows(seed, rec.num_tokens), _ids(seed, rec.num_tokens)
    inside = _pages_inside(reader, rec)
    expect_start, n = 0, 0
    for c in reader.chunks(rec, max_bytes):
        assert c.start == expect_start and c.stop > c.start, (c.start, c.stop, expect_start)
        assert torch.equal(c.input_ids, ids[c.start:c.stop]), (rec.rid, c.start)
        assert torch.equal(c.aux_hidden_states, rows[c.start:c.stop, :K]), (rec.rid, c.start, c.stop)
        assert torch.equal(c.last_hidden_state, rows[c.start:c.stop, K]), (rec.rid, c.start, c.stop)
        assert c.last_pre_norm is None
        if peak is not None:
            peak.append(len(_mapped(reader) & inside))
        expect_start, n = c.stop, n + 1
    assert expect_start == rec.num_tokens
    return n


@pytest.fixture
def dump(tmp_path):
    long_bytes = ring.record_bytes(LONG_T, P, H, 2, 8)
    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, H), 8, torch.bfloat16,
                      2 * long_bytes + 3 * ring.record_bytes(SMALL_T, P, H, 2, 80, 64))
    w.dir = tmp_path
    return w


def test_chunks_are_exact_views_and_only_about_two_chunks_stay_mapped(dump):
    dump.ring.publish("a" * 37, _ids(1, SMALL_T), _rows(1, SMALL_T), meta=b'{"x":1}', timeout=5)  # odd offsets
    _publish(dump, 2, LONG_T, rid="long-odd")
    _publish(dump, 3, SMALL_T)
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True, part_bytes=CHUNK)
    try:
        small = reader.take("a" * 37, timeout=5)
        rec = reader.take("long-odd", timeout=5)
        after = reader.take("r3", timeout=5)
        assert small.views and rec.views and after.views and rec.row_nbytes == LONG_T * ROW
        assert rec._rows_at % PAGE != 0, "the long record's rows should start inside a page for this test"
        # the reader maps pages as it reads them: the records beside the long one, read whole, stay mapped
        assert torch.equal(small.aux_hidden_states, _rows(1, SMALL_T)[:, :K])
        assert torch.equal(after.last_hidden_state, _rows(3, SMALL_T)[:, K])
        assert torch.equal(rec.input_ids, _ids(2, LONG_T))
        inside = _pages_inside(reader, rec)
        # nothing of its rows was read yet: at most the kernel's fault-around (16 pages) of its token ids' reads
        assert len(_mapped(reader) & inside) <= 16, sorted(_mapped(reader) & inside)
        keep = (_pages_of(reader, small.aux_hidden_states) | _pages_of(reader, after.last_hidden_state)
                | _pages_of(reader, rec.input_ids) | {0})
        assert keep <= _mapped(reader)
        peak = []
        n = _consume(reader, rec, 2, peak=peak)
        assert n == -(-LONG_T // (CHUNK // ROW)), n
        chunk_pages = CHUNK // PAGE
        print(f"{n} chunks of {CHUNK // ROW} rows; most pages of the record's rows mapped at once: {max(peak)} "
              f"(of {len(inside)}; a chunk is {chunk_pages})")
        # this chunk, the page it shares with the one before, and the kernel's fault-around (16 pages)
        assert max(peak) <= 2 * chunk_pages + 2 * 16, peak
        mapped = _mapped(reader)
        assert not (mapped & inside), sorted(mapped & inside)[:8]
        assert keep <= mapped, sorted(keep - mapped)[:8]  # header, token ids, the other records: not dropped
        rows_end_page = (rec._rows_at + LONG_T * ROW) // PAGE
        assert rows_end_page in mapped or (rec._rows_at + LONG_T * ROW) % PAGE == 0  # its trailer's page
        # still its bytes (the ring keeps them): reading a chunk again maps it again
        assert torch.equal(rec.aux_hidden_states, _rows(2, LONG_T)[:, :K])
        assert reader.intact(rec)
        for r in (small, rec, after):
            reader.ack(r)
        with pytest.raises(ValueError, match="acknowledged"):
            next(reader.chunks(rec))
    finally:
        reader.close()


def test_a_long_record_after_the_writer_wrapped_and_a_copying_reader(dump):
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK)  # copies records up to CHUNK
    try:
        cap = dump.ring.capacity
        seed, seen = 10, 0
        _publish(dump, seed, LONG_T, rid="first")
        rec = reader.take("first", timeout=5)
        assert rec.views
        _consume(reader, rec, seed)
        reader.ack(rec)
        # small records until the next long one cannot fit before the end of the buffer: it lands at offset 0
        while cap - dump.ring.head % cap >= ring.record_bytes(LONG_T, P, H, 2, 4):
            seed += 1
            _publish(dump, seed, SMALL_T)
            small = reader.take(f"r{seed}", timeout=5)
            assert not small.views and torch.equal(small.aux_hidden_states, _rows(seed, SMALL_T)[:, :K])
            assert list(reader.chunks(small, 2 * ROW))[-1].stop == SMALL_T  # a copy: sliced
            reader.ack(small)
            seen += 1
        _publish(dump, 99, LONG_T, rid="wrapped")
        rec = reader.take("wrapped", timeout=5)
        assert rec.views and rec.offset % cap == 0 and rec.offset > 0, (rec.offset, cap, seen)
        peak = []
        _consume(reader, rec, 99, max_bytes=3 * ROW + 17, peak=peak)  # 3 rows a chunk: a page's split rows
        assert max(peak) <= 2 + 2 * 16, max(peak)
        assert not (_mapped(reader) & _pages_inside(reader, rec))
        reader.ack(rec)
        # copied records' and acked records' pages were let go: little of the 5 MB ring is mapped in this process
        assert len(_mapped(reader)) * PAGE < 2 * CHUNK, len(_mapped(reader))
    finally:
        reader.close()


def test_part_bytes_and_max_bytes_refusals(dump):
    with pytest.raises(ValueError, match="part_bytes"):
        HiddenStateReader(str(dump.dir), wait=1, part_bytes=1 << 20)  # needs ack=True
    with pytest.raises(ValueError, match="part_bytes"):
        HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=0)
    _publish(dump, 5, SMALL_T)
    with HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True) as reader:
        rec = reader.take("r5", timeout=5)
        with pytest.raises(ValueError, match="max_bytes"):
            next(reader.chunks(rec, 0))
        assert [c.stop for c in reader.chunks(rec, ROW)] == [1, 2, 3, 4, 5]  # default-populated zero-copy too
        assert [c.stop for c in reader.chunks(rec, 1)] == [1, 2, 3, 4, 5]  # at least one row a chunk
        reader.ack(rec)


class _Bar:
    def update(self, n):
        pass

    def write(self, *a, **k):
        pass


@pytest.mark.parametrize("fmt", ["specforge", "safetensors", "deepspec"])
def test_the_extraction_writes_a_long_record_in_chunks_the_same_file(tmp_path, dump, fmt):
    """The --data run's sink stage (SampleWriter) over the real ring with --part-mb's bound: the long record's
    file, written from the ring a chunk at a time, is the file of the same rows written whole; afterwards none of
    its rows' pages is mapped in the reader."""
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.sinks.base import TrainingSample
    from sglang_hs.extract.writer import SampleWriter

    _publish(dump, 4, LONG_T, rid="long")
    manifest = {"layer_ids": [1], "rows_per_layer": 1, "model_path": "/m"}
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True, part_bytes=CHUNK)
    try:
        rec = reader.take("long", timeout=5)
        sink = SINKS[fmt](str(tmp_path / "chunked"), "bf16")
        sink.describe_capture(manifest)
        mask = (torch.arange(LONG_T) >= 100).long()
        writer = SampleWriter(reader, sink)
        writer.submit(0, mask, rec, verify=False)
        inside = _pages_inside(reader, rec)
        writer.drain(_Bar())
        assert writer.stats.done == 1 and not writer.stats.failed, writer.stats.failed
        assert rec.aux_hidden_states is None  # acked once its file was in place
        assert not (_mapped(reader) & inside)
    finally:
        reader.close()
    rows = _rows(4, LONG_T)
    whole = SINKS[fmt](str(tmp_path / "whole"), "bf16")
    whole.describe_capture(manifest)
    last = None if whole.final_state == "pre-norm" else rows[:, K]  # this ring holds the post-norm state only
    whole.write(TrainingSample(0, _ids(4, LONG_T), mask, rows[:, :K], last))
    a, b = open(whole.path(0), "rb").read(), open(sink.path(0), "rb").read()
    if fmt == "safetensors":
        from tests.unit.test_sink_chunks import _metadata_sorted

        a, b = _metadata_sorted(a), _metadata_sorted(b)
    assert a == b


def test_verify_of_a_long_record_reads_it_a_chunk_at_a_time(tmp_path, dump):
    """--verify of a long record over the real ring (issue 47, leftover 1): the logprob check (Extraction._complete:
    check() over record_chunks) and the safetensors read-back (SampleWriter: check_stored over the record's chunks
    again) pass for the true rows, fail for a stored row changed, and leave none of the record's rows' pages mapped
    in the reader (the whole path's read of the record's views leaves them all mapped)."""
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.verify import VerificationError, check, check_stored
    from sglang_hs.extract.writer import SampleWriter, record_chunks, sink_chunks

    _publish(dump, 5, LONG_T, rid="long")
    rows = _rows(5, LONG_T)
    g = torch.Generator().manual_seed(1)
    V = 64
    head = torch.randn(V, H, generator=g) * 0.05
    tokens = torch.randint(0, V, (LONG_T + 1,), generator=g).tolist()
    logp = torch.log_softmax(rows[:, K].float() @ head.T, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, zero_copy=True, part_bytes=CHUNK)
    try:
        rec = reader.take("long", timeout=5)
        inside = _pages_inside(reader, rec)
        assert check(0, tokens, rec.last_hidden_state, head, [None] + logp.tolist(),
                     chunks=record_chunks(reader, rec), part_bytes=CHUNK) < 1e-3
        assert not (_mapped(reader) & inside)
        sink = SINKS["safetensors"](str(tmp_path / "out"), None)
        sink.describe_capture({"layer_ids": [1], "rows_per_layer": 1, "model_path": "/m"})
        writer = SampleWriter(reader, sink)
        last = sink.final_of(rec)  # None: this ring holds the post-norm state only, speculators reads the pre-norm one
        writer._write(0, rec.input_ids, torch.ones(LONG_T), rec.aux_hidden_states, last, True, rec,
                      sink_chunks(reader, sink, rec))  # as submit() hands it: written and read back in chunks
        assert not (_mapped(reader) & inside)
        from safetensors.torch import load_file, save_file

        t = load_file(sink.path(0))
        assert torch.equal(t["hidden_states"], rows[:, :K])
        t["hidden_states"][LONG_T - 3, 0, 5] += 1
        save_file(t, sink.path(0))
        with pytest.raises(VerificationError, match=rf"1 stored rows differ .*\(first: row {LONG_T - 3}, layer 0 of 1\)"):
            check_stored(0, sink.path(0), rec.aux_hidden_states, last, None,
                         sink_chunks(reader, sink, rec))
        assert not (_mapped(reader) & inside)
        reader.ack(rec)
    finally:
        reader.close()


@pytest.mark.parametrize("layout,dtype", [("specforge", torch.bfloat16), ("specforge", torch.float32),
                                          ("specforge", None), ("deepspec", torch.bfloat16),
                                          ("deepspec", torch.float8_e4m3fn)])
def test_the_live_dataset_spills_a_long_record_to_a_file_backed_sample(tmp_path, dump, layout, dtype):
    """live.spill_sample (what LiveHiddenStates yields for a long record): the very dict the in-memory path
    builds (specforge_sample / deepspec_sample of the same rows), its state tensors mapped from files in spill_dir
    that are already unlinked (nothing left in the folder), the record's rows' ring pages unmapped."""
    from sglang_hs.extract.sinks import deepspec_sample, specforge_sample
    from sglang_hs.live import spill_sample

    _publish(dump, 6, LONG_T, rid="long")
    spill = tmp_path / "spill"
    spill.mkdir()
    mask = (torch.arange(LONG_T) >= 50).long()
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK)  # the live dataset's reader
    try:
        rec = reader.take("long", timeout=5)
        assert rec.views
        out = spill_sample(reader, rec, mask, layout, dtype, str(spill))
        assert not (_mapped(reader) & _pages_inside(reader, rec))
        reader.ack(rec)
    finally:
        reader.close()
    assert not list(spill.iterdir())
    rows = _rows(6, LONG_T)
    build = deepspec_sample if layout == "deepspec" else specforge_sample
    want = build(_ids(6, LONG_T), mask, rows[:, :K], rows[:, K], dtype=dtype)
    assert list(out) == list(want)
    for key in want:
        assert out[key].dtype == want[key].dtype and torch.equal(out[key], want[key]), key
    states = [k for k in out if "hidden" in k]
    for key in states:
        where = mapping_of(out[key])
        assert ".sglang-hs-spill-" in where and "(deleted)" in where, (key, where)
    out[states[0]].add_(1)  # copy on write: the trainer may change it



def test_spilling_into_a_tmpfs_folder_warns_once(tmp_path, dump, monkeypatch, capsys):
    """Two long records spilled into a folder the mount table says is a tmpfs: the samples are made all the
    same, and one line on stderr, the first time, names the folder (issue 47, leftover 2)."""
    import os

    from sglang_hs import fsutil, live
    from sglang_hs import spill as spilling

    spill = tmp_path / "spill"
    spill.mkdir()
    st = os.stat(spill)
    table = tmp_path / "mountinfo"
    table.write_text(f"31 25 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / /x rw - tmpfs tmpfs rw\n")
    monkeypatch.setattr(fsutil, "MOUNTINFO", str(table))
    monkeypatch.setattr(spilling, "_spill_dirs_checked", set())
    _publish(dump, 7, LONG_T, rid="a")
    _publish(dump, 8, LONG_T, rid="b")
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK)
    try:
        for rid, seed in (("a", 7), ("b", 8)):
            rec = reader.take(rid, timeout=5)
            out = live.spill_sample(reader, rec, torch.ones(LONG_T), "specforge", None, str(spill))
            assert torch.equal(out["hidden_state"][0], _rows(seed, LONG_T)[:, K])
            reader.ack(rec)
    finally:
        reader.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"spill_dir {spill} is on tmpfs" in err[0] and "disk-backed directory" in err[0], err


def test_a_kernel_refusing_to_drop_pages_costs_no_ack():
    """madvise(MADV_DONTNEED) may fail (EINVAL after mlockall, EAGAIN): dropping pages is only a saving, so
    drop_pages says 0 and the ack that called it goes on (review: the OSError escaped RingReader.release before
    its bookkeeping, and the record was never released)."""
    from sglang_hs.server.store.shm import SharedRegion

    class Refusing:
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    region = SharedRegion("/nowhere", "ring", torch.zeros(4 * mmap.PAGESIZE, dtype=torch.uint8), mm=Refusing())
    assert region.drop_pages(0, 4 * mmap.PAGESIZE) == 0


def test_close_drops_the_held_views_and_keeps_the_held_copies(dump):
    """A copying reader with part_bytes holds both kinds: close() lets go of the views (the next reader may have
    their bytes overwritten) and keeps the copies takeable, as a copying reader's close always did (review: every
    held record was thrown away once one was a view)."""
    reader = HiddenStateReader(str(dump.dir), wait=1, ack=True, part_bytes=CHUNK)
    try:
        _publish(dump, 1, SMALL_T, rid="small")
        _publish(dump, 2, LONG_T, rid="long")
        reader.poll()
        assert set(reader.ready_rids()) == {"small", "long"}
    finally:
        reader.close()
    assert reader.ready_rids() == ["small"]
    small = reader.take("small", timeout=1)
    assert not small.views and torch.equal(small.aux_hidden_states, _rows(1, SMALL_T)[:, :K])
