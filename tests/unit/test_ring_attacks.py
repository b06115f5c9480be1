"""What a member of --hs-share-group can do to the server through the ring, and what it cannot
(docs/security.md#what-a-member-of-the-share-group-can-and-cannot-do). The ring is the writer's alone (0640 of
the group): a member can neither write nor truncate it, nor open the store. What it can write is the read
offset, in the ring's offset file (0660): every value there is checked by the writer (at or after what it
accepted, at most what it published, the end of a record it wrote); a bad one, or the file cut short, is
refused and counted and the server goes on as with no reader: it never stops, never writes outside the ring,
and a reader's records stay whole and exact. A member that writes a valid offset consumes records, as any
reader of the group may.

The member runs as another uid (root starts it; the test skips elsewhere). The writer's side is also
fuzzed (hypothesis): random publishes, reads, reader restarts, offsets and truncations of the offset
file: the writer never raises but TimeoutError (no room), its counters stay within the ring, and every
record a reader hands out is exactly one that was published, in order; a zero-copy record whose reader says
the writer has not taken its bytes back (RingReader.holds) reads as published, whatever moved the offset."""
import os
import struct
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from helpers import ProgressLines  # noqa: E402
from sglang_hs import fsutil  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

OTHER_UID, SHARE_GID = 4242, 4343  # a member of the share group, and the group
H = 16


def rows_of(i, T, P=2):
    """Record i's rows: every value differs by record, token, layer and hidden index, exact in bf16."""
    t, p, h = torch.arange(T).view(T, 1, 1), torch.arange(P).view(1, P, 1), torch.arange(H).view(1, 1, H)
    return ((2 * (h + H * p) + 1) * torch.pow(2.0, (8 * i + t) % 64 - 40)).bfloat16()


def ids_of(i, T):
    return torch.arange(T, dtype=torch.int32) * 7 + 100 * i


# The member: plain os calls, one per line of stdin, each answered "ok" or the error's name.
_MEMBER = """
import mmap, os, struct, sys  # (imported before dropping to the member: the interpreter lives under /root)
os.setgroups([int(sys.argv[3])]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
d = sys.argv[1]
def do(cmd, arg):
    if cmd == "open-ring-for-writing": os.close(os.open(f"{d}/ring-w0.bin", os.O_RDWR))
    elif cmd == "truncate-ring": os.truncate(f"{d}/ring-w0.bin", 4096)
    elif cmd == "open-store": os.close(os.open(f"{d}/store-w0.bin", os.O_RDONLY))
    elif cmd == "replace-ring": os.rename(f"{d}/ring-w0.offset", f"{d}/ring-w0.bin")
    elif cmd == "read-ring": os.close(os.open(f"{d}/ring-w0.bin", os.O_RDONLY))
    elif cmd == "offset":
        fd = os.open(f"{d}/ring-w0.offset", os.O_WRONLY)
        os.pwrite(fd, struct.pack("<Q", int(arg)), 0); os.close(fd)
    elif cmd == "cut": os.truncate(f"{d}/ring-w0.offset", int(arg))
    elif cmd == "open-for-writing": os.close(os.open(f"{d}/{arg}", os.O_WRONLY | os.O_NOFOLLOW))
    elif cmd == "truncate": os.truncate(f"{d}/{arg}", 0)
    elif cmd == "chmod": os.chmod(f"{d}/{arg}", 0o666)
    elif cmd == "chown": os.chown(f"{d}/{arg}", os.getuid(), os.getgid())
    elif cmd == "unlink": os.unlink(f"{d}/{arg}")
    elif cmd == "rename": os.rename(f"{d}/{arg}", f"{d}/{arg}.moved")
    elif cmd == "map-writable":
        fd = os.open(f"{d}/{arg}", os.O_RDONLY)
        try: mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally: os.close(fd)
    elif cmd == "create": os.close(os.open(f"{d}/{arg}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    elif cmd == "symlink": os.symlink("/tmp", f"{d}/{arg}")
    elif cmd == "mkdir": os.mkdir(f"{d}/{arg}")
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    try:
        do(cmd, arg); print("ok", flush=True)
    except OSError as e:
        print(type(e).__name__, flush=True)
"""


class Member:
    def __init__(self, dump):
        self.p = subprocess.Popen([sys.executable, "-c", _MEMBER, dump, str(OTHER_UID), str(SHARE_GID)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")

    def __call__(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)


@pytest.fixture
def shared_dump(monkeypatch):
    """(parent folder, dump dir, new_member): a dump dir made as launch_server makes it with
    --hs-share-group, in a folder others may enter; new_member() starts a Member of the group on it. The
    members are closed and the folder removed after the test."""
    import shutil

    parent = tempfile.mkdtemp(prefix="sglang-hs-attack-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    members = []

    def new_member():
        members.append(Member(d))
        return members[-1]

    try:
        os.chmod(parent, 0o755)
        monkeypatch.setenv("SGLANG_HS_SHARE_GID", str(SHARE_GID))
        d = fsutil.ensure_private_dir(os.path.join(parent, "hs"), SHARE_GID)  # as launch_server does
        yield parent, d, new_member
    finally:
        for m in members:
            m.close()
        shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user of the share group")
def test_a_share_group_member_can_neither_stop_the_server_nor_hand_a_reader_a_bad_record(shared_dump):
    _, d, new_member = shared_dump
    T = 4
    one = ring.record_bytes(T, 2, H, 2, 2)
    w = CaptureWriter(d, CaptureSpec.resolve([1], True, 4, H), 8, torch.bfloat16, 6 * one)  # six records
    published = 0

    def publish():
        nonlocal published
        try:
            w.ring.publish(f"r{published}", ids_of(published, T), rows_of(published, T), timeout=0.05)
            published += 1
        except TimeoutError:  # no room: the only way a publish may fail here
            pass

    for _ in range(3):
        publish()
    member = new_member()
    assert member("read-ring") == "ok"  # the group reads the ring...
    for attack in ("open-ring-for-writing", "truncate-ring", "replace-ring", "open-store"):
        assert member(attack) == "PermissionError", attack  # ...and cannot write, cut or swap it, nor see the store
    bad = [lambda h: 2**63, lambda h: 2**64 - 1, lambda h: h + 64, lambda h: h + one, lambda h: 64,
           lambda h: 32, lambda h: one - 64, lambda h: 2 * one + 8]  # of the writer's HEAD at the time
    for n, value in enumerate(bad, 1):
        assert member(f"offset {value(w.ring.head)}") == "ok"
        assert w.ring.free_bytes() == w.ring.capacity - w.ring.head  # refused: nothing was consumed
        assert w.ring.offsets_refused == n and w.ring.consumed == 0
        publish()  # the server goes on
    for size in (0, 4):
        assert member(f"cut {size}") == "ok"  # the member may cut the offset file short...
        publish()  # ...and the writer, which only reads it with pread, goes on
        assert w.ring.consumed == 0
    assert w.ring.offsets_refused == len(bad) + 1  # a file cut short counts once, however short
    assert w.stats["reader_offsets_refused"] == len(bad) + 1  # in the status file
    assert published == 6  # the ring is full: the rest waits for a reader, the server is not stopped
    publish()
    assert published == 6
    # a valid offset is what any reader of the group may write: it consumes r0, the writer takes it
    assert member(f"offset {one}") == "ok"
    assert w.ring.free_bytes() == one and w.ring.consumed == one and w.ring.consumed_seq == 1
    reader = HiddenStateReader(d, wait=1, ack=True)  # the server's user: starts after what was consumed
    for i in range(1, 12):
        rec = reader.next(timeout=5)
        assert rec.rid == f"r{i}" and torch.equal(rec.input_ids, ids_of(i, T)), rec
        assert torch.equal(rec.aux_hidden_states, rows_of(i, T)[:, :1]), i
        assert torch.equal(rec.last_hidden_state, rows_of(i, T)[:, 1]), i
        reader.ack(rec)
        publish()  # room again as the reader acks
        assert published == 6 + i
    reader.close()


# -- the writer's side, fuzzed: one ring, a reader, and someone else writing the offset file --

P = 2
CAP_RECORDS = 5


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 6)),  # a record of T tokens (T = 0: a marker)
    st.tuples(st.just("read"), st.booleans()),  # the reader drains (True) or reads ahead and releases all
    st.tuples(st.just("read-views"), st.none()),  # reads ahead zero-copy (views), held until "release-views"
    st.tuples(st.just("release-views"), st.none()),
    st.tuples(st.just("reader-restarts"), st.none()),
    st.tuples(st.just("offset"), st.integers(0, 2**64 - 1) | st.integers(0, 64 * 40).map(lambda x: x * 64)
              | st.integers(0, 2**64 - 1).map(lambda x: x % 4096)),
    st.tuples(st.just("offset-at-a-record-end"), st.integers(0, 10**6)),  # a valid one: it consumes
    st.tuples(st.just("cut"), st.integers(0, 16)),
), min_size=1, max_size=40))
@example(ops=[("publish", 6)] * 5 + [("read-views", None), ("offset-at-a-record-end", 0), ("publish", 6)])
def test_no_reader_offset_stops_the_writer_or_tears_a_record(tmp_path_factory, ops):
    path = str(tmp_path_factory.mktemp("offsets"))
    w = ring.RingWriter.create(path, "ring-w0.bin", CAP_RECORDS * ring.record_bytes(6, P, H, 2, 3))
    sent = {}  # rid -> (ids, rows)
    ends = []  # where each published record ends
    reader = ring.RingReader.open(path, "ring-w0.bin")
    last_seq, n = 0, 0
    held = []  # (its reader, zero-copy record, what was published): whole whenever its reader says it holds it
    for op, arg in ops:
        before = w.consumed
        if op == "publish":
            rid = f"r{n}"
            try:
                if arg == 0:
                    w.publish(rid, torch.empty(0, dtype=torch.int32), torch.empty(0, P, H, dtype=torch.bfloat16),
                              timeout=0.01, skipped=2)
                else:
                    w.publish(rid, ids_of(n, arg), rows_of(n, arg), timeout=0.01)
                sent[rid] = (ids_of(n, arg), rows_of(n, arg)) if arg else None
                ends.append(w.head)
                n += 1
            except TimeoutError:
                pass
        elif op == "read":
            try:
                if arg and not held:  # (one reader never drains while it holds records read ahead)
                    got = reader.drain()
                else:
                    got = reader.read_ahead()
                    for rec in got:
                        reader.release(rec.seq)
            except ring.TornRecord as e:  # someone else moved the offset past what this reader had not read
                assert "ring-w0.bin" in str(e)
                reader.close()
                reader, last_seq = ring.RingReader.open(path, "ring-w0.bin"), 0
                continue
            for rec in got:
                assert rec.seq > last_seq, (rec.seq, last_seq)  # in order, each once per reader
                last_seq = rec.seq
                want = sent[rec.rid]
                if want is None:
                    assert rec.skipped == 2 and rec.num_tokens == 0
                else:
                    assert torch.equal(rec.input_ids, want[0]) and torch.equal(rec.rows, want[1]), rec.rid  # whole
        elif op == "read-views":
            try:
                got = reader.read_ahead(copy=False)
            except ring.TornRecord as e:
                assert "ring-w0.bin" in str(e)
                reader.close()
                reader, last_seq = ring.RingReader.open(path, "ring-w0.bin"), 0
                continue
            for rec in got:
                assert rec.seq > last_seq, (rec.seq, last_seq)
                last_seq = rec.seq
                held.append((reader, rec, sent[rec.rid]))
        elif op == "release-views":
            for r, rec, _ in held:
                r.release(rec.seq)
            held = []
        elif op == "reader-restarts":
            reader.close()
            reader, last_seq = ring.RingReader.open(path, "ring-w0.bin"), 0
        elif op == "offset":
            os.pwrite(reader.offset_fd, struct.pack("<Q", arg), 0)
        elif op == "offset-at-a-record-end":
            if ends:
                os.pwrite(reader.offset_fd, struct.pack("<Q", ends[arg % len(ends)]), 0)
        elif op == "cut":
            os.truncate(os.path.join(path, "ring-w0.offset"), arg)
        free = w.free_bytes()  # the writer looks at the offset file
        for r, rec, want in held:  # a view read while the writer has not taken its bytes back is the record's
            if want is not None and r.holds(rec.offset):
                assert torch.equal(rec.input_ids, want[0]) and torch.equal(rec.rows, want[1]), rec.rid
        assert 0 <= w.head - w.consumed <= w.capacity and free == w.capacity - (w.head - w.consumed)
        assert w.consumed >= before and (w.consumed == 0 or w.consumed in ends)  # only forward, to a record's end
    reader.close()


# -- a zero-copy reader (the extraction CLI) while a member moves the read offset past what it is copying --


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user of the share group")
def test_a_member_moving_the_read_offset_under_the_extraction_cli_gets_no_torn_file_written(shared_dump):
    """The CLI writes a file straight from a record's views of the ring and acks it once the file is in
    place. A member writes the end of that record as the read offset meanwhile (a valid one: the writer
    takes it) and the server writes the next record over those bytes while the file is being written: the
    file must not take the sample's name (it would hold another request's rows), the sample fails with one
    line and --resume redoes it; a record nobody touched is written exactly."""
    from types import SimpleNamespace

    from sglang_hs.extract import cli
    from sglang_hs.extract.sinks import SafetensorsSink
    from safetensors.torch import load_file

    parent, d, new_member = shared_dump
    T = 4
    one = ring.record_bytes(T, 2, H, 2, 2)
    w = CaptureWriter(d, CaptureSpec.resolve([1], "pre-norm", 4, H), 8, torch.bfloat16, 2 * one)  # two records
    for i in range(2):
        w.ring.publish(f"r{i}", ids_of(i, T), rows_of(i, T), timeout=1)
    member = new_member()
    reader = HiddenStateReader(d, wait=1, ack=True, zero_copy=True)
    r0, r1 = reader.next(timeout=5), reader.next(timeout=5)
    assert (r0.rid, r1.rid) == ("r0", "r1") and reader.intact(r0) and reader.intact(r1)

    attacked = []

    class Sink(SafetensorsSink):
        def _save(self, tmp, input_ids, loss_mask, aux, last):
            if not attacked:  # while sample 0's views are being read: the member, then the server
                assert member(f"offset {one}") == "ok"
                w.ring.publish("r2", ids_of(2, T), rows_of(2, T), timeout=1)  # over r0's bytes
                attacked.append(True)
            super()._save(tmp, input_ids, loss_mask, aux, last)

    bar = ProgressLines()
    out = os.path.join(parent, "out")
    ext = cli.Extraction(SimpleNamespace(), "http://unused", reader, Sink(out), None, None)
    for index, rec in enumerate((r0, r1)):
        fut = ext.write_pool.submit(ext._write, index, rec.input_ids, torch.ones(T), rec.aux_hidden_states,
                                    rec.last_pre_norm, False, rec)
        fut.exception()  # one at a time (waits): the attack happens during sample 0's write
        ext.writes.append((index, T, fut, rec))
    ext.write_pool.shutdown(wait=True)
    assert attacked and w.ring.consumed == one  # the writer took the member's offset and wrote r2 over r0
    assert torch.equal(r0.input_ids, ids_of(2, T))  # r0's views now show r2: what a file of them would hold
    assert not reader.intact(r0) and reader.intact(r1)
    assert ext._collect_writes(bar) == 2
    assert not ext.sink.done(0) and not [p for p in os.listdir(out) if "tmp" in p], os.listdir(out)
    assert len(ext.stats.failed) == 1 and ext.stats.failed[0][0] == 0, ext.stats.failed
    assert "given back to the server" in ext.stats.failed[0][1] and d in ext.stats.failed[0][1]
    assert bar.lines == [f"[extract] sample 0 failed: {ext.stats.failed[0][1]}"]
    got = load_file(ext.sink.path(1))  # the record nobody touched: exactly what the server published
    assert torch.equal(got["token_ids"], ids_of(1, T).long()) and torch.equal(got["hidden_states"], rows_of(1, T))
    assert r1.input_ids is None and not reader.intact(r1)  # acked: its tensors dropped, nothing to vouch for
    reader.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user of the share group")
def test_a_share_group_member_can_write_nothing_in_the_dump_but_the_offset_file(shared_dump):
    """Every file a serving process puts in a shared dump dir (made here by the same calls: the launcher's
    folder and lock, the writer's manifest, store, ring and offset file, the overlay's
    status file): a member of the group can open for writing, truncate and write nothing but the ring's
    offset file; it can change no mode or owner, map the ring writable, remove, rename or add anything.
    So a member cannot forge a record (the ring's CRC, unkeyed, only detects corruption, and a member
    cannot write the ring), and what it can do is what any reader of the group does: read every record
    and consume it
    (docs/security.md#what-a-member-of-the-share-group-can-and-cannot-do)."""
    from sglang_hs.server.overlay_status import OverlayStatus

    _, d, new_member = shared_dump
    lock = None
    try:
        lock = fsutil.lock_dump_dir(d)
        spec = CaptureSpec.resolve([1], "both", 4, H)
        w = CaptureWriter(d, spec, 8, torch.bfloat16, 1 << 16)
        w.ring.publish("r0", ids_of(0, 4), rows_of(0, 4, P=3), timeout=1)
        status = OverlayStatus(d, "DeepseekV3ForCausalLM", spec)
        status.stop()  # its file stays; no temporary file of a rewrite in the listing
        names = sorted(os.listdir(d))
        assert {"manifest.json", "ring-w0.bin", "ring-w0.offset", "store-w0.bin", fsutil.LOCK_NAME} <= set(names) \
            and any(n.startswith("overlay-") for n in names), names
        member = new_member()
        for name in names:
            writable = name == "ring-w0.offset"
            for attack in ("open-for-writing", "truncate"):
                assert member(f"{attack} {name}") == ("ok" if writable else "PermissionError"), (attack, name)
            for attack in ("chmod", "chown", "unlink", "rename"):
                assert member(f"{attack} {name}") == "PermissionError", (attack, name)
        assert member("map-writable ring-w0.bin") == "PermissionError"
        assert member("chmod .") == "PermissionError"
        for attack in ("create", "symlink", "mkdir"):
            assert member(f"{attack} planted") == "PermissionError", attack
        assert sorted(os.listdir(d)) == names  # nothing added, removed or renamed
        assert os.path.getsize(os.path.join(d, "ring-w0.offset")) == 0  # the one file it may write (and cut)
        w.ring.publish("r1", ids_of(1, 4), rows_of(1, 4, P=3), timeout=1)  # the server goes on
        reader = HiddenStateReader(d, wait=1)
        assert [reader.next(timeout=5).rid for _ in range(2)] == ["r0", "r1"]
        reader.close()
    finally:
        if lock is not None:
            os.close(lock)
