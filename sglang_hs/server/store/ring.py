"""The output ring: finished records, from one writer (the scheduler) to one reader process.

Two files per writer under the dump dir, created 0600 (with --hs-share-group: the ring 0640 and the
offset file 0660 of the share group). Only the writer writes the ring; a reader maps it read-only and
writes nothing but its read offset, into the offset file:

  `ring-<writer>.bin`
    [0, 4096)              header: magic, format version, capacity, writer pid; counters on their own
                           cache lines, all written by the writer with release stores: HEAD (bytes
                           published) and TAIL, TAIL_SEQ (bytes consumed as the writer accepted them from
                           the reader, and the sequence number of the record that ends there)
    [4096, 4096+capacity)  records at logical offsets that only grow, placed at offset % capacity
  `ring-<writer>.offset`   the reader's: [0, 8) the offset it has consumed up to (the end of a record),
                           [8, 16) its pid (informational: readers lock the ring with flock). Written
                           with pwrite and read by the writer with pread, never mapped by the writer:
                           whoever may write it (the share group) can truncate it, and a mapping of a
                           truncated file faults (SIGBUS) where a read just comes up short.

The writer keeps its own state in process memory (HEAD, the accepted TAIL; the ring's copies are for
readers) and takes a new read offset only when it is valid: at or after the TAIL it accepted, at most
HEAD, the end of a record the writer published there (its trailer and header agree: magic, length and
a sequence number after the last one consumed). Anything else (a bad value, a short or truncated
file) is refused, counted (`offsets_refused`) and logged, the writer carrying on as if no reader had
read further: the ring fills and admission control holds or skips requests as with no reader, and no
value a reader writes can stop the server or make it write outside the ring.

A record is 64-byte aligned: a 64-byte header (magic, total length, sequence number, T, P, H, dtype,
rid length, prompt length, next token, metadata length, token ids stored, first row, total rows), the request
id (utf-8), the metadata (a JSON object, utf-8; empty for none), input_ids int32[n_ids], rows [T, P, H], then a
64-byte trailer that repeats magic, sequence number and length and holds a CRC-32 of the header, request id and metadata. A record never wraps: when one does not fit before the end of the buffer the writer
publishes a SKIP marker (or nothing, when fewer than 64 bytes remain) and starts again at 0. The writer
only writes bytes the reader has consumed (HEAD - TAIL <= capacity), and the reader only reads bytes
below the HEAD it acquire-loaded, so a record is either wholly visible or not at all; header/trailer
mismatches (a corrupted or foreign file) are reported as torn, never emitted.
A request served without capture (--hs-capture, --hs-capture-sample, --hs-when-behind skip) may leave
a marker record: T = 0, no rows, the header's flags = the reason code (SKIP_REASONS), so a reader
can tell that request will have no record, and why.
A record of a request says where its prompt ends (prompt length: rows >= it are generated tokens) and
holds the token after its last row (the last generated token, which has no row, or -1 when the writer
did not say), so the whole sequence the server sent is input_ids + [next token].
A record larger than the server's bound leaves the ring in PARTS (format 9): each part is a record of its own
(header, trailer, sequence number: every check above and `release` are per part) whose header says it holds
rows [first_row, first_row + T) of a record of total_rows = N > 0 rows (T >= 1); the first part (first_row 0)
holds all N token ids (n_ids = N), the later ones none (n_ids = 0); every part carries the record's request id,
prompt length (of the whole record), next token and metadata. A whole record has n_ids = T, first_row = 0,
total_rows = 0. The parts of a record are published back to back, in order, nothing between them: a reader
takes anything else as torn, except later parts it finds first (a reader before it consumed the earlier ones
and died: `Record.orphan`, their record is lost).
Sequence numbers run 1, 2, 3, ... without gaps. A reader that starts later resumes where the last one
stopped: at the offset file's offset when that is the end of a record past the ring's TAIL (checked as
the writer checks it), else at TAIL; a record there not newer than the one before it (a replay) is
refused, as is a gap after it. A record is copied out, then checked to be still unconsumed in the
writer's eyes (TAIL at most its start): one the writer may have written over meanwhile (the read offset
moved past it by someone else who may write the offset file) is refused, never handed out.

Consuming is either eager (`drain`: copy out, release at once) or acknowledged (`read_ahead` copies
records out from a private cursor and releases nothing; `release(seq)` moves TAIL over the records up
to seq once every record before it was released too): a reader killed before it released a record
leaves it in the ring for the next reader. `read_ahead(copy=False)` copies nothing: a record's tensors are
views of the ring's shared memory (their storage exactly that record's input_ids, and its rows), valid
until it is released; a record never wraps, so its rows are one contiguous block. Released, its bytes
are the writer's to overwrite: whoever holds such a view must be done with it before `release`. Someone
else who may write the offset file (a member of the share group) can give them back sooner: the writer
then takes that offset and may write over the views while they are used, so a consumer asks
`holds(record.offset)` once it is done with them and discards what it made from them when it is False.
`read_ahead(view_above=N)` hands a record of more than N row bytes as views even when copying (`Record.views`),
and a reader with `drop_behind` (opened with populate=False: its pages mapped as it reads them) unmaps each
record's whole pages from its process once it is copied out or released (`drop`: madvise MADV_DONTNEED, the
file keeps them): HiddenStateReader(part_bytes=N) reads long records a chunk at a time this way.
`read_ahead(part_views=True)` hands every part of a parted record as views (the reader copies it into its
record, or streams it, and releases it then).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from stat import S_ISREG
from typing import List, Optional

import torch

from sglang_hs._ext import ext
from sglang_hs.server.store.shm import SharedRegion
from sglang_hs.server.store.layout import (ALIGN, MAX_RID_BYTES, SKIP_REASONS, _align,  # noqa: F401 (re-exported)
                                         record_bytes)

MAGIC = b"SGLHSRNG"
VERSION = 9  # 2: the trailer holds a CRC-32 of the record header and request id; 3: marker records (flags);
# 4: the record header holds the prompt length and the token after the last row (harvesting live traffic);
# 5: the reader writes its offset into its own file (ring-*.offset), the ring is the writer's alone;
# 6: marker reason 7, draft_accepted (--hs-capture-accept-below); 7: a record's metadata (meta_len, JSON after
# the request id: under speculative decoding each verify step's accepted drafts); 8: marker reason 8, oversized (a
# request whose record could never fit the ring, served without capture under --hs-when-behind skip); 9: records
# in parts (n_ids, first_row, total_rows: a record larger than the server's bound leaves the ring a part at a time)
HEADER_BYTES = 4096
OFF_MAGIC, OFF_VERSION, OFF_CAPACITY, OFF_PID = 0, 8, 16, 24
OFF_HEAD, OFF_TAIL = 64, 128  # separate cache lines
OFF_TAIL_SEQ = 136  # sequence number of the record that ends at TAIL (the writer's, like TAIL)
OFFSET_BYTES = 64  # the reader's offset file: its read offset at 0, its pid at 8
OFFSET_PID = 8
REC_MAGIC, SKIP_MAGIC = 0x52534748, 0x50494B53  # "HGSR", "SKIP"
# magic, flags, total, seq, T, P, H, dtype, pad, rid_len, prompt_len, next_token, meta_len, n_ids, first_row,
# total_rows (62 of the header's 64 bytes)
_REC = struct.Struct("<IIQQIHIBxHIiIIII")
_TRAIL = struct.Struct("<IIQQ")  # magic, crc32(header + rid + meta), seq, total
DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
DTYPE_OF = {v: k for k, v in DTYPES.items()}


def _valid_skip(pos: int, total: int, published: int, capacity: int) -> bool:
    """A SKIP marker at `pos` covers exactly the rest of the buffer, and that was published."""
    return total >= ALIGN and pos + total == capacity and total <= published


logger = logging.getLogger(__name__)
_HEAD4 = struct.Struct("<IIQQ")  # a record header's magic, flags, total, seq


def offset_name(ring_name: str) -> str:
    """The reader's offset file of ring `ring_name` (ring-w0.bin -> ring-w0.offset)."""
    return (ring_name[:-4] if ring_name.endswith(".bin") else ring_name) + ".offset"


def record_ending_at(mem, capacity: int, end: int, after: int, after_seq: int, head: int) -> Optional[int]:
    """The sequence number of the record published at logical offsets [.., end), if one does, lying at or
    after `after` (a record boundary, after record `after_seq`) and ending at most at `head`; else None.
    Checks its trailer and header agree (magic, length, sequence number > after_seq): the ring is the
    writer's alone, so those are what it wrote (and `head` bounds what it has published)."""
    if not after < end <= head or end % ALIGN:
        return None
    p_end = end % capacity or capacity
    if p_end < 2 * ALIGN:
        return None
    tm, _, tseq, ttotal = _TRAIL.unpack_from(mem, HEADER_BYTES + p_end - ALIGN)
    if tm != REC_MAGIC or ttotal % ALIGN or not 2 * ALIGN <= ttotal <= p_end or end - ttotal < after:
        return None
    magic, _, total, seq = _HEAD4.unpack_from(mem, HEADER_BYTES + p_end - ttotal)
    if magic != REC_MAGIC or total != ttotal or seq != tseq or seq <= after_seq:
        return None
    return seq


def _create_offset_file(dir_path: str, name: str) -> int:
    """A new 0600 offset file of OFFSET_BYTES zero bytes (never through a symlink); returns its fd."""
    dfd = os.open(os.path.abspath(dir_path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        os.fchmod(fd, 0o600)  # despite the umask
        os.pwrite(fd, bytes(OFFSET_BYTES), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def part_fields_valid(T: int, n_ids: int, first_row: int, total_rows: int, prompt_len: int, flags: int) -> bool:
    """A header's part fields are consistent: a whole record (total_rows 0) holds its T ids; a part holds
    T >= 1 rows [first_row, first_row + T) of the record's total_rows, all of its ids on the first part
    (first_row 0) and none on the others, its prompt length within the whole record; a marker is never a part."""
    if total_rows == 0:
        return n_ids == T and first_row == 0
    return (not flags and 1 <= T and first_row + T <= total_rows and prompt_len <= total_rows + 1
            and n_ids == (total_rows if first_row == 0 else 0))


def encode_meta(meta: Optional[dict]) -> bytes:
    """A record's metadata as the ring holds it (compact JSON, utf-8; b"" for none)."""
    return json.dumps(meta, separators=(",", ":")).encode() if meta else b""


def _open_offset_file(dir_path: str, name: str, owner: int) -> int:
    """The reader's offset file, opened for pwrite without following a symlink; a regular file of `owner`."""
    dfd = os.open(os.path.abspath(dir_path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not S_ISREG(st.st_mode) or st.st_uid != owner:
        os.close(fd)
        raise ValueError(f"{os.path.join(dir_path, name)}: not a regular file of uid {owner}")
    return fd


class TornRecord(RuntimeError):
    pass


@dataclass
class Record:
    rid: str
    seq: int
    input_ids: torch.Tensor  # [T] int32
    rows: torch.Tensor  # [T, P, H]
    skipped: int = 0  # a marker record: the request was served without capture (SKIP_REASONS); T = 0
    prompt_len: int = 0  # rows >= prompt_len are generated tokens (T + 1 when nothing was generated)
    next_token: int = -1  # the token after the last row (the last generated one); -1: not recorded
    offset: int = -1  # the logical offset it starts at (RingReader.holds)
    meta: dict = field(default_factory=dict)  # what the writer said about the request (encode_meta)
    views: bool = False  # its tensors are views of the ring (read_ahead copy=False or view_above), else copies
    # a part of a parted record (total_rows > 0): rows are its rows [first_row, first_row + T) of the record's
    # total_rows; input_ids what it stores (all the record's ids on its first part, none on later ones)
    first_row: int = 0
    total_rows: int = 0
    orphan: bool = False  # a later part a fresh reader found first: its record's first parts went to a reader before

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_part(self) -> bool:
        return self.total_rows > 0

    @property
    def is_last_part(self) -> bool:
        return self.total_rows > 0 and self.first_row + self.rows.shape[0] == self.total_rows


class RingWriter:
    def __init__(self, region: SharedRegion, offset_fd: Optional[int] = None) -> None:
        self.r = region
        self.capacity = region.nbytes - HEADER_BYTES
        self.seq = 0
        self.gather_threads = 1  # threads of a large record's copy into the ring (the writer sets its setting)
        # The writer's own state, in this process only (the ring's HEAD, TAIL and TAIL_SEQ are copies for readers)
        self.head = 0  # bytes published
        self.consumed = self.consumed_seq = 0  # the read offset last accepted, and the record that ends there
        self.offset_fd = offset_fd  # the reader's offset file, read with pread (module docstring)
        self.offsets_refused = 0  # read offsets refused (invalid, or the file cut short)
        self.stats: Optional[dict] = None  # the writer's stats: the count goes there too (reader_offsets_refused)
        self._refused: Optional[int] = None  # the last value refused (each new one counts once)
        self._lock = threading.Lock()  # the scheduler (admission) and the finish worker both ask for room
        self._mem = memoryview(region.buf.numpy())

    @classmethod
    def create(cls, dir_path: str, name: str, capacity: int) -> "RingWriter":
        """A new ring file `name` and its reader's offset file (offset_name(name)), both 0600."""
        capacity = _align(capacity)
        region = SharedRegion.create(dir_path, name, HEADER_BYTES + capacity)
        hdr = region.buf
        hdr[OFF_MAGIC : OFF_MAGIC + 8] = torch.frombuffer(bytearray(MAGIC), dtype=torch.uint8)
        hdr[OFF_VERSION : OFF_VERSION + 4] = torch.frombuffer(bytearray(struct.pack("<I", VERSION)), dtype=torch.uint8)
        region.store_release(OFF_CAPACITY, capacity)
        region.store_release(OFF_PID, os.getpid())
        return cls(region, _create_offset_file(dir_path, offset_name(name)))

    def _reader_offset(self) -> Optional[int]:
        """The offset in the reader's file, read twice alike (a read racing the reader's write is not
        taken); -1 when the file is cut short; None when it could not be read consistently."""
        try:
            a, b = os.pread(self.offset_fd, 8, 0), os.pread(self.offset_fd, 8, 0)
        except OSError:
            return -1
        if len(a) < 8 or len(b) < 8:
            return -1
        return struct.unpack("<Q", a)[0] if a == b else None

    def _take_reader_offset(self) -> None:
        """Accept the reader's offset if it is valid (module docstring), else refuse, count and log it."""
        if self.offset_fd is None:
            return
        with self._lock:
            t = self._reader_offset()
            if t is None or t == self.consumed:
                return
            seq = None if t < 0 else record_ending_at(self._mem, self.capacity, t, self.consumed, self.consumed_seq,
                                                      self.head)
            if seq is None:
                if t != self._refused:
                    self._refused = t
                    self.offsets_refused += 1
                    if self.stats is not None:
                        self.stats["reader_offsets_refused"] = self.offsets_refused
                    if self.offsets_refused & (self.offsets_refused - 1) == 0:  # 1, 2, 4, 8, ...: not a flood
                        logger.warning("sglang-hs: refused the read offset in %s (%s; accepted so far %d of %d "
                                       "published bytes): taken as no reader; %d refused so far",
                                       offset_name(self.r.path), "file cut short" if t < 0 else f"value {t}",
                                       self.consumed, self.head, self.offsets_refused)
                return
            self.consumed, self.consumed_seq = t, seq
            self.r.store_release(OFF_TAIL, t)  # for readers: before any byte below t + capacity is written
            self.r.store_release(OFF_TAIL_SEQ, seq)

    def free_bytes(self) -> int:
        self._take_reader_offset()
        return self.capacity - (self.head - self.consumed)

    def fill_ratio(self) -> float:
        """Unread bytes / capacity."""
        return 1.0 - self.free_bytes() / self.capacity

    def _wait_for(self, nbytes: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.free_bytes() < nbytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"output ring {self.r.path}: no room for {nbytes} bytes after {timeout}s "
                                   "(is a reader consuming it?)")
            time.sleep(0.001)

    def publish(self, rid: str, input_ids: torch.Tensor, rows: Optional[torch.Tensor] = None, timeout: float = 60.0,
                *, gather_from: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None,
                skipped: int = 0, prompt_len: Optional[int] = None, next_token: int = -1, meta: bytes = b"",
                first_row: int = 0, total_rows: int = 0) -> int:
        """Append one record; returns its sequence number. Blocks while the ring is full (bounded).

        The rows are either `rows` [T, P, H], or gathered straight into the ring as
        `gather_from[slots]` (a store [S, P, H] and its KV slots [T]): one copy fewer. `skipped` (a
        SKIP_REASONS code) makes it a marker record: T must be 0. `prompt_len` (default T: no row is a
        generated token) and `next_token` (the token after the last row) go into the header, `meta`
        (encode_meta) after the request id.

        `total_rows` N > 0 makes it a PART of a record of N rows: its T >= 1 rows are rows [first_row,
        first_row + T) of the record; `input_ids` are the record's N ids on the first part (first_row 0) and
        empty ([0]) on the others; rid, prompt_len (of the whole record: default N), next_token and meta the
        same on every part. The caller publishes a record's parts back to back, in order, nothing between
        them (a reader takes anything else as torn)."""
        if rows is not None:
            T, P, H = rows.shape
            dtype = rows.dtype
        else:
            T, (_, P, H), dtype = slots.shape[0], gather_from.shape, gather_from.dtype
        n_ids = T if not total_rows else (total_rows if first_row == 0 else 0)
        if total_rows and (skipped or T < 1 or first_row < 0 or first_row + T > total_rows):
            raise ValueError(f"part of request {rid[:200]!r}: rows [{first_row}, {first_row + T}) of a record of "
                             f"{total_rows} rows{' (a marker is never a part)' if skipped else ''}: expected T >= 1 "
                             "rows inside the record")
        if total_rows < 0 or (not total_rows and first_row):
            raise ValueError(f"record of request {rid[:200]!r}: first_row {first_row} and total_rows {total_rows}: "
                             "expected first_row 0 for a whole record (total_rows 0), total_rows > 0 for a part")
        if input_ids.shape != (n_ids,):
            which = ("a whole record's T" if not total_rows else "a first part's N" if not first_row
                     else "none on a later part")
            raise ValueError(f"record of request {rid[:200]!r}: token ids of shape {tuple(input_ids.shape)}, expected "
                             f"({n_ids},): {which}")
        assert dtype in DTYPES and (not skipped or (T == 0 and skipped in SKIP_REASONS))
        whole = total_rows or T  # the rows of the whole record
        prompt_len = whole if prompt_len is None else prompt_len
        assert 0 <= prompt_len <= whole + 1 and -1 <= next_token < 2**31, (prompt_len, whole, next_token)
        elem = torch.empty(0, dtype=dtype).element_size()
        rid_b = rid.encode()
        if len(rid_b) > MAX_RID_BYTES:
            raise ValueError(f"request id of {len(rid_b)} bytes (utf-8): the output ring's records hold at most "
                             f"{MAX_RID_BYTES}")
        total = record_bytes(T, P, H, elem, len(rid_b), len(meta), n_ids)
        if total > self.capacity:
            raise ValueError(f"record of {total} bytes (rid {rid[:200]!r}, {T} tokens) exceeds the output ring's "
                             f"capacity of {self.capacity} bytes: raise --hs-ring-size")
        # Encoded whole before anything moves (the sequence number, HEAD, a SKIP marker): a record that
        # cannot be encoded leaves the ring exactly as it was, its next record numbered without a gap.
        seq = self.seq + 1
        try:
            header = _REC.pack(REC_MAGIC, skipped, total, seq, T, P, H, DTYPES[dtype], len(rid_b), prompt_len,
                               next_token, len(meta), n_ids, first_row, total_rows)
        except struct.error as e:
            raise ValueError(f"record of request {rid[:200]!r} cannot be encoded ({e}): T={T}, P={P}, H={H}") from None
        trailer = _TRAIL.pack(REC_MAGIC, zlib.crc32(header + rid_b + meta), seq, total)
        # the writer's own, never read back from the ring file:
        # docs/security.md#what-a-member-of-the-share-group-can-and-cannot-do
        head = self.head
        pos = head % self.capacity
        if pos + total > self.capacity:  # does not fit before the end: skip to 0
            skip = self.capacity - pos
            self._wait_for(skip + total, timeout)
            if skip >= ALIGN:
                self._write(pos, _REC.pack(SKIP_MAGIC, 0, skip, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
            head += skip
            self.r.store_release(OFF_HEAD, head)
            self.head = head
            pos = 0
        else:
            self._wait_for(total, timeout)
        base = HEADER_BYTES + pos
        buf = self.r.buf
        o = ALIGN
        buf[base + o : base + o + len(rid_b)] = torch.frombuffer(bytearray(rid_b), dtype=torch.uint8) if rid_b else buf[:0]
        o += _align(len(rid_b))
        if meta:
            buf[base + o : base + o + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
            o += _align(len(meta))
        buf[base + o : base + o + 4 * n_ids] = input_ids.to(torch.int32).contiguous().view(torch.uint8)
        o += _align(4 * n_ids)
        n = T * P * H * elem
        dst = buf[base + o : base + o + n].view(dtype).view(T, P, H)
        if rows is None:  # streamed, threaded, without the GIL (csrc/gather_rows_cpu.cpp)
            ext().gather_rows_cpu(gather_from, slots, dst, self.gather_threads)
        elif rows.device.type == "cpu" and rows.is_contiguous():
            ext().gather_rows_cpu(rows, None, dst, self.gather_threads)
        else:
            dst.copy_(rows)
        o += _align(n)
        self._write(pos + o, trailer)
        self._write(pos, header)
        self.seq = seq  # only now: a copy that raised above left no gap in the numbering
        self.r.store_release(OFF_HEAD, head + total)  # publish: the reader may now read the record
        self.head = head + total
        return seq

    def _write(self, pos: int, data: bytes) -> None:
        base = HEADER_BYTES + pos
        self.r.buf[base : base + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


class RingReader:
    def __init__(self, region: SharedRegion, offset_fd: Optional[int] = None) -> None:
        hdr = bytes(region.buf[:32].tolist())
        if hdr[:8] != MAGIC:
            raise ValueError(f"{region.path}: not an sglang-hs output ring (bad magic)")
        (version,) = struct.unpack_from("<I", hdr, OFF_VERSION)
        if version != VERSION:
            raise ValueError(f"{region.path}: output ring format version {version}, this reader reads {VERSION}")
        self.r = region
        self.capacity = region.load_acquire(OFF_CAPACITY)
        if self.capacity + HEADER_BYTES != region.nbytes:
            raise ValueError(f"{region.path}: capacity {self.capacity} does not match the file size {region.nbytes}")
        self.offset_fd = offset_fd  # the offset file, where this reader writes how far it has consumed
        self._tail = self._tail_seq = None  # consumed up to (offset, seq of the record ending there), from _start()
        self._cursor = self._cursor_seq = None  # read_ahead's position (offset, seq), from its first call
        self._unreleased: dict = {}  # seq -> offset after that record, for records read ahead
        self._released: set = set()  # released out of order, waiting for the records before them
        self._mem: Optional[memoryview] = None  # the mapping as a buffer, for zero-copy views (read_ahead)
        # unmap each record's whole pages from this process once it is copied out or released (a reader of long
        # records in chunks, whose ring is mapped without MAP_POPULATE: its resident ring pages stay bounded)
        self.drop_behind = False
        self._starts: dict = {}  # seq -> offset it starts at, for records read ahead (drop_behind)
        # where the records read so far stand among parts (_part_order): None between records, else what the next
        # part must be; _fresh until this reader's first record (a later part there is an orphan, not torn)
        self._parting: Optional[tuple] = None
        self._fresh = True

    @classmethod
    def open(cls, dir_path: str, name: str, owner: Optional[int] = None,
             writable_by_gid: Optional[int] = None, populate: bool = True) -> "RingReader":
        """Open a ring of `owner` (a uid; None: this user), writable by nobody else, read-only, and its
        offset file, group-writable only by `writable_by_gid`. populate=False: the ring's pages are mapped as
        they are read, not all at once (SharedRegion.attach)."""
        from sglang_hs.fsutil import check_private_file

        check_private_file(os.path.join(dir_path, name), owner)
        check_private_file(os.path.join(dir_path, offset_name(name)), owner, writable_by_gid)
        region = SharedRegion.attach(dir_path, name, owner_uid=-1 if owner is None else owner, writable=False,
                                     populate=populate)
        offset_fd = None
        try:
            offset_fd = _open_offset_file(dir_path, offset_name(name), os.geteuid() if owner is None else owner)
            return cls(region, offset_fd)
        except BaseException:
            os.close(region.fd)
            if offset_fd is not None:
                os.close(offset_fd)
            raise

    def close(self) -> None:
        """Close the files (the lock on the ring goes with them); records already handed out stay valid."""
        for fd in (self.r.fd, self.offset_fd):
            if fd is not None:
                os.close(fd)
        self.r.fd = self.offset_fd = None

    def set_reader_pid(self, pid: int) -> None:
        os.pwrite(self.offset_fd, struct.pack("<Q", pid), OFFSET_PID)

    def reader_pid(self) -> Optional[int]:
        """The pid the reader holding the ring wrote (informational: anyone of the share group may write it)."""
        try:
            b = os.pread(self.offset_fd, 8, OFFSET_PID)
        except OSError:
            return None
        return struct.unpack("<Q", b)[0] if len(b) == 8 else None

    def _start(self):
        """Where this reader starts: the offset file's offset where it is the end of a record past the
        ring's TAIL (the last reader released up to there and the writer has not looked yet), else TAIL."""
        tail, seq = self.r.load_acquire(OFF_TAIL), self.r.load_acquire(OFF_TAIL_SEQ)
        try:
            b = os.pread(self.offset_fd, 8, 0) if self.offset_fd is not None else b""
        except OSError:
            b = b""
        if len(b) == 8:
            end = struct.unpack("<Q", b)[0]
            if self._mem is None:
                self._mem = memoryview(self.r.buf.numpy())
            later = record_ending_at(self._mem, self.capacity, end, tail, seq, self.r.load_acquire(OFF_HEAD))
            if later is not None:
                return end, later
        return tail, seq

    def replaced(self) -> bool:
        """Whether this ring's file was unlinked: its server is gone, and a restarted one makes a new ring
        (the records published here can still be read: the mapping stays)."""
        return self.r.unlinked()

    def unread_bytes(self) -> int:
        if self._tail is None:
            self._tail, self._tail_seq = self._start()
        return self.r.load_acquire(OFF_HEAD) - self._tail

    def drain(self) -> List[Record]:
        """Copy out every published record (one copy each) and release their bytes to the writer."""
        if self._tail is None:
            self._tail, self._tail_seq = self._start()
        tail, last_seq = self._tail, self._tail_seq
        out = []
        for rec, end in self._records(tail, last_seq):
            out.append(rec)
            tail, last_seq = end, rec.seq
        self._store_tail(tail, last_seq)  # a SKIP marker after the last record goes with the next one
        return out

    def read_ahead(self, copy: bool = True, view_above: Optional[int] = None, part_views: bool = False) -> List[Record]:
        """Copy out the records published since the last call (the first call: since TAIL) without
        releasing any: `release(seq)` does that once the consumer has handled them. copy=False: the
        records' tensors are views of the ring, valid until released (nothing is copied). `view_above`: a
        record of more row bytes than that comes as views even when copy=True (Record.views). `part_views`:
        every part of a parted record comes as views (the consumer copies it into its record, or streams it)."""
        if self._cursor is None:
            if self._tail is None:
                self._tail, self._tail_seq = self._start()
            self._cursor, self._cursor_seq = self._tail, self._tail_seq
        out = []
        for rec, end in self._records(self._cursor, self._cursor_seq, copy, view_above, part_views):
            out.append(rec)
            self._unreleased[rec.seq] = end
            if self.drop_behind:
                self._starts[rec.seq] = rec.offset
            self._cursor, self._cursor_seq = end, rec.seq
        return out

    def release(self, seq: int) -> None:
        """The consumer is done with record `seq` (from read_ahead): TAIL moves over every record up to
        the oldest one not yet released. Releasing a record twice is a no-op."""
        if seq not in self._unreleased:
            return
        if seq in self._starts:
            start = self._starts.pop(seq)
            self.drop(HEADER_BYTES + start % self.capacity, self._unreleased[seq] - start)
        self._released.add(seq)
        first = min(self._unreleased)
        if seq != first:
            return  # held until the records before it are released
        tail = last = None
        while first in self._released:
            tail, last = self._unreleased.pop(first), first
            self._released.discard(first)
            if not self._unreleased:
                break
            first = min(self._unreleased)
        self._store_tail(tail, last)

    def holds(self, offset: int) -> bool:
        """Whether the record starting at logical `offset` (read ahead, not released) is still unconsumed in
        the writer's eyes: TAIL at most its start, so the writer has written none of its bytes over. Asked
        after using a zero-copy record's views (RingReader docstring: someone else of the share group may
        write the read offset past it, and the writer then takes it and reuses the bytes). The writer
        store-releases TAIL before it writes any byte below TAIL + capacity, and this load comes after the
        reads of the views in program order (x86 keeps loads in order; the copy-mode check in _records
        relies on the same), so True means every byte read before the call was the record's."""
        return self.r.load_acquire(OFF_TAIL) <= offset

    def drop(self, at: int, nbytes: int) -> int:
        """Unmap from this process the whole pages of the ring's records area inside mapping bytes [at, at +
        nbytes) (SharedRegion.drop_pages: the ring keeps them; the header page is never dropped). Returns the
        bytes unmapped."""
        end = min(at + nbytes, self.r.nbytes)
        at = max(at, HEADER_BYTES)
        return self.r.drop_pages(at, end - at) if end > at else 0

    def unreleased(self) -> int:
        """Records read ahead and not released yet."""
        return len(self._unreleased)

    def unreleased_before(self, seq: int) -> list:
        """The sequence numbers, ascending, of the records read ahead, not released yet and older than `seq`:
        what holds the TAIL back behind record `seq`."""
        return sorted(q for q in self._unreleased if q < seq)

    def _store_tail(self, tail: int, last_seq: int) -> None:
        """Tell the writer the records up to `tail` are consumed (it checks the value, and takes it when it
        needs room)."""
        if tail != self._tail:
            self._tail, self._tail_seq = tail, last_seq
            if self.offset_fd is not None:
                os.pwrite(self.offset_fd, struct.pack("<Q", tail), 0)

    def _view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor over buf[offset:offset+nbytes] whose storage is exactly those bytes (a slice of
        buf would carry the whole ring's storage: torch.save of it would save the whole ring); it keeps
        the mapping alive."""
        if self._mem is None:
            self._mem = memoryview(self.r.buf.numpy())
        return torch.frombuffer(self._mem[offset : offset + nbytes], dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)

    def _part_order(self, seq: int, at: int, rid_b: bytes, meta_b: bytes, prompt_len: int, next_token: int, T: int,
                    first_row: int, total_rows: int) -> bool:
        """Check a record's place among parts: a record's parts come back to back, in row order, with the same
        request id, metadata, prompt length, next token and total rows, and nothing else between them
        (TornRecord otherwise). Returns whether it is an orphan: a later part read first by this reader, whose
        record's earlier parts a reader before it consumed (and released: they are gone), as are its next ones."""
        fresh, expected = self._fresh, self._parting
        self._fresh = False
        where = f"{self.r.path}: record seq {seq} at offset {at}"
        if expected is not None:
            e_rid, e_meta, e_prompt, e_next, e_total, e_row, orphan = expected
            if not total_rows or first_row != e_row or (rid_b, meta_b, prompt_len, next_token, total_rows) != \
                    (e_rid, e_meta, e_prompt, e_next, e_total):
                got = f"rows [{first_row}, {first_row + T}) of {total_rows}" if total_rows else "a whole record"
                raise TornRecord(f"{where}: {got} of request {rid_b[:200]!r} where the part of rows [{e_row}, ..) of "
                                 f"{e_total} of request {e_rid[:200]!r} was expected (a record's parts come back to "
                                 "back, in order, alike)")
        elif total_rows and first_row:
            if not fresh:
                raise TornRecord(f"{where}: a part of rows [{first_row}, {first_row + T}) of {total_rows} of request "
                                 f"{rid_b[:200]!r} without its earlier parts (expected its first part, rows [0, ..))")
            orphan = True
        else:
            orphan = False
        end = first_row + T
        self._parting = (rid_b, meta_b, prompt_len, next_token, total_rows, end, orphan) \
            if total_rows and end < total_rows else None
        return orphan

    def _records(self, tail: int, last_seq: int, copy: bool = True, view_above: Optional[int] = None,
                 part_views: bool = False):
        """(record, offset after it) for each record published between `tail` and HEAD, checked; copied
        out, or (copy=False, or more row bytes than `view_above`, or a part with `part_views`) views of the
        ring."""
        # a copy is read at once by the consumer: torch's clone (its threads, cached stores), not the streamed op
        clone = lambda off, n: self.r.buf[off : off + n].clone()  # noqa: E731
        head = self.r.load_acquire(OFF_HEAD)
        if tail > head or head - tail > self.capacity:
            raise TornRecord(f"{self.r.path}: corrupt counters (published {head}, consumed {tail}, capacity "
                             f"{self.capacity})")
        first = True
        while tail < head:
            pos = tail % self.capacity
            if self.capacity - pos < ALIGN:  # too little room for a SKIP marker: implicit wrap
                tail += self.capacity - pos
                continue
            base = HEADER_BYTES + pos
            header = bytes(self.r.buf[base : base + _REC.size].tolist())
            (magic, flags, total, seq, T, P, H, dt, rid_len, prompt_len, next_token, meta_len, n_ids, first_row,
             total_rows) = _REC.unpack(header)
            if magic == SKIP_MAGIC:
                if not _valid_skip(pos, total, head - tail, self.capacity):
                    raise TornRecord(f"{self.r.path}: corrupt skip marker at offset {tail}")
                tail += total
                continue
            if magic != REC_MAGIC or total % ALIGN or total > head - tail or dt not in DTYPE_OF \
                    or (flags and (flags not in SKIP_REASONS or T != 0)) or prompt_len > T + 1 + total_rows \
                    or next_token < -1:
                raise TornRecord(f"{self.r.path}: corrupt record header at offset {tail}")
            if not part_fields_valid(T, n_ids, first_row, total_rows, prompt_len, flags):
                raise TornRecord(f"{self.r.path}: corrupt record header at offset {tail}: {n_ids} token ids, rows "
                                 f"[{first_row}, {first_row + T}) of {total_rows} (expected a whole record's T ids, or "
                                 "a part inside its record: the record's ids on its first part, none after)")
            tm, crc, tseq, ttotal = _TRAIL.unpack(bytes(self.r.buf[base + total - ALIGN : base + total - ALIGN + _TRAIL.size].tolist()))
            dtype = DTYPE_OF[dt]
            elem = torch.empty(0, dtype=dtype).element_size()
            if (tm, tseq, ttotal) != (REC_MAGIC, seq, total) or \
                    total != record_bytes(T, P, H, elem, rid_len, meta_len, n_ids):
                raise TornRecord(f"{self.r.path}: torn record seq {seq} at offset {tail}")
            rid_b = bytes(self.r.buf[base + ALIGN : base + ALIGN + rid_len].tolist())
            m0 = base + ALIGN + _align(rid_len)
            meta_b = bytes(self.r.buf[m0 : m0 + meta_len].tolist()) if meta_len else b""
            if crc != zlib.crc32(header + rid_b + meta_b):
                raise TornRecord(f"{self.r.path}: record seq {seq} at offset {tail}: header, request id or metadata "
                                 "altered (checksum mismatch)")
            # The first record may be further on: a reader killed between storing TAIL and TAIL_SEQ.
            if seq <= last_seq or (not first and seq != last_seq + 1):
                raise TornRecord(f"{self.r.path}: record seq {seq} at offset {tail} after seq {last_seq} "
                                 "(the ring's counters were moved: a replay or a gap)")
            first, last_seq = False, seq
            try:
                rid = rid_b.decode()
            except UnicodeDecodeError:
                raise TornRecord(f"{self.r.path}: record seq {seq} at offset {tail}: request id is not UTF-8") from None
            try:
                meta = json.loads(meta_b) if meta_b else {}
            except ValueError:
                meta = None
            if not isinstance(meta, dict):
                raise TornRecord(f"{self.r.path}: record seq {seq} at offset {tail}: metadata is not a JSON object")
            orphan = self._part_order(seq, tail, rid_b, meta_b, prompt_len, next_token, T, first_row, total_rows)
            o = m0 + _align(meta_len)
            views = not copy or (view_above is not None and T * P * H * elem > view_above) or \
                (part_views and total_rows > 0)
            take = self._view if views else clone
            ids = take(o, 4 * n_ids).view(torch.int32)
            o += _align(4 * n_ids)
            rows = take(o, T * P * H * elem).view(dtype).view(T, P, H)
            if self.r.load_acquire(OFF_TAIL) > tail:  # the writer took a read offset past it: maybe written over
                raise TornRecord(f"{self.r.path}: record seq {seq} at offset {tail} was given back to the writer "
                                 "before this reader read it (someone else wrote the read offset: another member of "
                                 "the share group?)")
            start, tail = tail, tail + total
            if self.drop_behind and not views:  # copied out: this process needs none of its pages mapped
                self.drop(base, total)
            yield Record(rid=rid, seq=seq, input_ids=ids, rows=rows, skipped=flags, prompt_len=prompt_len,
                         next_token=next_token, offset=start, meta=meta, views=views, first_row=first_row,
                         total_rows=total_rows, orphan=orphan), tail
