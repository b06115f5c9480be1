"""Read captured hidden states back, per request, from another process.

    from sglang_hs import HiddenStateReader
    reader = HiddenStateReader("/dev/shm/hs")
    rec = reader.take("my-request-id", timeout=60)     # that request's record, once it finished
    for rec in reader: ...                              # finished records in completion order

A record holds `input_ids` [T] (int32), `aux_hidden_states` [T, K, H] (the layers of
`reader.manifest["layer_ids"]`, HF `output_hidden_states[i]`; DeepSeek-V4: the mean of its hc_mult streams,
or with `--hs-hc-streams full` [T, K * hc_mult, H], stream s of the k-th id at row k * hc_mult + s, as
`reader.manifest["rows_per_layer"]` and `["hc_convention"]` say), `last_hidden_state` [T, H] (the final
post-norm state, HF `output_hidden_states[n]`) when the server runs with `--hs-last` (post-norm or both),
and `last_pre_norm` [T, H] (the final residual stream before the final norm, the input of HF
`model.model.norm`) with `--hs-last pre-norm` or `both`; each None when not captured
(`reader.manifest["last_states"]` says which are). T = every prompt token, then every
generated token but the last; row t is position t (`positions` is that arange, for convenience).
`prompt_len` says where the prompt ends (rows >= prompt_len are generated tokens; prompt_len = T + 1
when nothing was generated) and `next_token` is the token after the last row (the last generated one),
so `output_ids` (input_ids[prompt_len:] + [next_token]) are exactly the tokens the server sent back.
On a server that decodes speculatively, `meta["speculative"]` holds the drafts each verify step of the
request accepted, in order (`accepted_drafts`; the step's accept length is that + 1, the bonus token), and
from a DSpark draft with a confidence head each step's mean draft confidence (`confidence`, 4 decimals).
The reader drains the ring eagerly (one copy per record, then the bytes go back to the server), so
holding on to one record never stalls the server. Aborted requests, `HEALTH_CHECK` requests and SGLang's start-up warm-up request are not
emitted. A request id used again (a client's retry, a duplicate) gives one outcome per request, a record
or a marker (below), oldest first: each `take(rid)` answers the oldest request of that rid not answered
yet, never one in place of another.

A record drained eagerly is gone from the ring: if the reader process dies before its consumer handled
it, it is lost. With `ack=True` the reader still copies records out as they arrive, but their bytes go
back to the server only when `reader.ack(record)` says the consumer is done; a reader killed and
restarted gets every record it had not acknowledged again, in order, and none it had:

    with HiddenStateReader("/dev/shm/hs", ack=True) as reader:
        for rec in reader:
            save(rec)          # make this idempotent (e.g. a file named by rec.rid, renamed into place)
            reader.ack(rec)    # a crash before this line means rec comes again after a restart

A request the server served without capture (--hs-capture opt-in, --hs-capture-sample, --hs-when-behind
skip, --hs-capture-max-bytes, --hs-capture-accept-below, or a shape that cannot be recorded exactly: beam
search, input_embeds) has no record; the server leaves a marker for it when the ring had room, and
`take(rid)` then raises `NotCaptured` (its `.reason`: "not_opted_in", "not_sampled", "reader_behind",
"over_budget", "draft_accepted", "oversized", "beam_search" or "input_embeds") instead of waiting;
`reader.not_captured(rid)` asks without waiting. Iteration yields records only.

With `zero_copy=True` too (it needs ack=True), nothing is copied: a record's tensors are views of the
server's output ring, valid until `reader.ack(record)` or `reader.close()`, after which the server overwrites
those bytes (close() drops the records it holds and has not handed out). So finish with the tensors
(write the file, copy what you keep) before acking; ack() drops the record's tensors (they become None)
so the record itself is not handed on stale, but a view you took from it yourself
(`aux = rec.aux_hidden_states`) is not protected: do not use it after the ack. A view's storage is
exactly that record's bytes (torch.save of it saves the record, not the ring). Someone else who may write
the ring's read offset (a member of the server's --hs-share-group) can hand a record's bytes back to the
server before your ack, and the server then writes over them while you read: `reader.intact(rec)`, asked
once you are done with the views and before the ack, says whether every byte you read was the record's;
when False, throw away what you made of them (the extraction CLI removes the file and fails the sample):

    with HiddenStateReader("/dev/shm/hs", ack=True, zero_copy=True) as reader:
        for rec in reader:
            torch.save({"aux": rec.aux_hidden_states}, f"{rec.rid}.pt.tmp")   # one copy: ring -> file
            if reader.intact(rec):
                os.rename(f"{rec.rid}.pt.tmp", f"{rec.rid}.pt")
            reader.ack(rec)                                                   # rec's tensors are gone now

A long record (DeepSeek-V3 at 128K tokens: 7.5 GB of rows) is read a chunk at a time, never held whole:
with `part_bytes=N` (it needs ack=True) a record of more than N bytes of rows is not copied even by a copying
reader but comes as views of the ring (`rec.views`, the zero-copy contract: valid until acked), and
`reader.chunks(rec)` yields its rows in order as RecordChunks (start, stop, and those rows' input_ids,
aux_hidden_states, last_hidden_state, last_pre_norm) of at most N bytes each. Asking for the next chunk
unmaps the ring pages of the chunks before it from this process (madvise MADV_DONTNEED; the ring keeps its
bytes), and such a reader maps its ring page by page as it reads (not all of it up front), unmapping each
record's pages once copied or acked: the process holds about one chunk of ring pages, never the record.
chunks() of any other record (max_bytes=) just slices it:

    with HiddenStateReader("/dev/shm/hs", ack=True, part_bytes=256 << 20) as reader:
        for rec in reader:
            for c in reader.chunks(rec):             # rec.views: ~256 MB of ring pages mapped at a time
                out.write(c.aux_hidden_states)      # done with c before the next one
            reader.ack(rec)

A server may publish a long record in PARTS (ring format 9; docs/how-it-works.md, Long records in parts): it is
still ONE record here (the whole input_ids, prompt_len, next_token, meta; seq and offset its first part's). A reader
with part_bytes STREAMS a parted record of more row bytes: it is ready once its first part came (`rec.streamed`),
its state tensors are StreamedRows (shape and dtype; any read raises StreamedRecordError), and chunks(rec), once,
yields its rows as the parts arrive (waiting up to `part_wait` seconds for each), each part's ring bytes given back
once the next chunk is asked for; ack it before the end and its remaining parts are let go as they come. Any other
reader (or a record of at most part_bytes) gets it ASSEMBLED: each part copied into one whole record as it arrives
and given back at once, the record ready at its last part (a copy even for zero_copy). Either way the server
publishes the next part only into ring room given back, so ack the records before a parted one: an unacknowledged
record holds the ring's TAIL, and chunks() times out naming it. A reader that stops in the middle of a parted
record loses it (its earlier parts went back); the next reader skips the rest (`orphan_parts`).

Unacknowledged records hold their ring space (new requests wait in admission control while the ring is
full), so acknowledge as you go. One reader per dump dir: a second is refused while the first lives.

A restarted server makes a new ring (the old one is unlinked; its manifest names the new ring_id). A reader
notices once it has read every record the old ring holds: by default poll()/next()/take() then raise
ServerRestarted (one line); with `reattach=True` it attaches to the new ring as soon as the new server's
manifest is there (the old ring's records read ahead can still be acknowledged; `restarts` counts).

Several nodes (SGLang's --nnodes): each node's dump dir holds the writers on that node, one per data-
parallel attention group served there; `reader.dp_ranks` are the DP ranks this reader covers (of
`reader.manifest["dp_size"]`), a record's `dp_rank` the group that served it. A request served by a
group of another node has its record in that node's dump dir: route requests with SGLang's
`routed_dp_rank` to the ranks of the node whose dump you read. With `--tp` spread over nodes (no DP
attention), the writer is TP rank 0, on node 0: the other nodes' dump dirs hold no manifest but the launcher's
no-writer.json, and a reader there fails at once (NoWriterHere) instead of waiting for a manifest.
"""
from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import logging
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from sglang_hs.envs import DEFAULT_PART_BYTES
from sglang_hs.server.capture_spec import final_states
from sglang_hs.fsutil import NO_WRITER, check_private_file, owner_uid
from sglang_hs.server.store.admission import meta_bound
from sglang_hs.server.store.ring import MAX_RID_BYTES, SKIP_REASONS, RingReader, record_bytes
from sglang_hs.server.store.writer import FORMAT_VERSION, MANIFEST

logger = logging.getLogger(__name__)


def recycle_freed_memory() -> bool:
    """Keep freed memory in this process's heap (glibc: no mmap for large blocks, no trimming), so each
    drained record reuses pages a dropped record freed instead of faulting in fresh zeroed ones: draining
    large records gets ~5x faster (tmpfs to heap, measured in benchmarks/bench_ring.py). The process
    then keeps its peak heap. Returns False where this is not glibc. Process-wide, hence opt-in
    (HiddenStateReader(recycle_memory=True)); the extraction CLI turns it on for itself."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 1 << 30))  # M_MMAP_MAX, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def read_manifest(path: str, owner: Optional[int] = None) -> dict:
    check_private_file(path, owner)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not a valid manifest (truncated or corrupted JSON: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ValueError(f"{path}: format version {found}, this reader reads {FORMAT_VERSION}")
    missing = [k for k in ("layer_ids", "last", "writers", "hidden_size") if k not in manifest]
    if missing or not manifest["writers"] or not all(isinstance(w, dict) and "ring" in w for w in manifest["writers"]):
        raise ValueError(f"{path}: not a valid manifest (missing {missing or 'writers'})")
    for w in manifest["writers"]:
        if os.path.basename(str(w["ring"])) != w["ring"]:
            raise ValueError(f"{path}: writer ring {w['ring']!r} is not a file name inside the dump dir")
    return manifest


MAX_MARKERS = 1 << 16  # markers of requests served without capture kept for take(); the oldest go first


class ServerRestarted(RuntimeError):
    """The server this reader attached to was restarted (its ring was replaced by a new one), and the
    reader was not told to reattach, or could not (another setup, another reader holding the new ring)."""


REATTACH_TRY_S = 0.1  # how often a reader whose server restarted looks for the new server's manifest


def dp_rank_of(writer: dict) -> int:
    """The data-parallel attention rank a manifest writer serves (its id, in a manifest before dp_rank)."""
    return int(writer.get("dp_rank", writer["id"]))


def coverage(manifest: dict) -> str:
    """Which DP ranks a dump dir's writers serve, in words: "DP ranks [1] of 2 (node 1 of 2)"."""
    ranks = sorted(dp_rank_of(w) for w in manifest["writers"])
    where = f" (node {manifest['node_rank']} of {manifest['nnodes']})" if manifest.get("nnodes", 1) > 1 else ""
    return f"DP ranks {ranks} of {manifest.get('dp_size', len(ranks))}{where}"


def node_share(manifest: dict):
    """(this dump's DP ranks, the DP size) when the dump is one node's of a multi-node server whose writers
    serve only some DP ranks (a reader here gets only their records: requests must be routed to them with
    SGLang's routed_dp_rank); None when it covers every DP rank."""
    ranks = sorted(dp_rank_of(w) for w in manifest["writers"])
    dp_size = int(manifest.get("dp_size", len(ranks)))
    return None if len(ranks) >= dp_size else (ranks, dp_size)


def ring_ids(manifest: dict) -> list:
    """Each writer's ring_id: tells one server generation's rings from the next one's."""
    return [str(w.get("ring_id") or f"pid-{w.get('pid')}") for w in manifest["writers"]]


# what a reattaching reader requires of the restarted server: records of the same shape and meaning (the
# final states and DeepSeek-V4's rows per layer id set where each row of a record is: num_aux, finals)
SAME_SETUP = ("model_path", "architecture", "dtype", "hidden_size", "layer_ids", "last", "last_states",
              "rows_per_layer")


class NotCaptured(LookupError):
    """take(rid) of a request the server served without capture: it will never have a record."""

    def __init__(self, rid: str, reason: str) -> None:
        super().__init__(f"request {rid!r} was served without capture ({reason})")
        self.rid, self.reason = rid, reason


@dataclass
class HiddenStateRecord:
    rid: str
    input_ids: torch.Tensor
    aux_hidden_states: torch.Tensor
    last_hidden_state: Optional[torch.Tensor]
    seq: int = field(default=0, repr=False)  # its sequence number in its writer's ring (1, 2, 3, ...)
    writer: int = field(default=0, repr=False)  # index of that writer in manifest["writers"]
    ring_id: str = field(default="", repr=False)  # that writer's ring (manifest ring_id): which server run
    generation: int = field(default=0, repr=False)  # the reader's server generation it came from (restarts)
    dp_rank: int = field(default=0, repr=False)  # the data-parallel attention group that served it
    prompt_len: int = 0  # rows >= prompt_len are generated tokens (T + 1: nothing was generated)
    next_token: int = -1  # the token after the last row (the last generated one; -1: not recorded)
    last_pre_norm: Optional[torch.Tensor] = None  # the final state before the final norm (--hs-last pre-norm/both)
    offset: int = field(default=-1, repr=False)  # where it starts in its writer's ring (HiddenStateReader.intact)
    # what the server said about the request: under speculative decoding {"speculative": {"verify_steps": N,
    # "accepted_drafts": [drafts accepted at each verify step, in order]}} (accept length = that + 1), with a DSpark
    # confidence head also "confidence": [each verify step's mean draft confidence]; else {}
    meta: dict = field(default_factory=dict, repr=False)
    _arrival: int = field(default=0, repr=False, compare=False)  # this reader's count of records and markers
    views: bool = field(default=False, repr=False)  # its tensors are views of the ring (zero_copy, or part_bytes)
    _rows_at: int = field(default=-1, repr=False, compare=False)  # views: where its rows start in the ring's mapping
    _row_bytes: int = field(default=0, repr=False, compare=False)  # bytes of one token's rows [P, H]
    # a streamed record (parts, more than part_bytes of rows): its parts as they arrive (HiddenStateReader.chunks)
    _stream: Optional["_Parted"] = field(default=None, repr=False, compare=False)

    def drop_tensors(self) -> None:
        """A zero-copy record whose ring bytes went back to the server: no tensor of it is handed on."""
        self.input_ids = self.aux_hidden_states = self.last_hidden_state = self.last_pre_norm = None

    @property
    def streamed(self) -> bool:
        """Its rows come a part at a time through reader.chunks(record), once (a record that left the server's ring
        in parts, more row bytes than the reader's part_bytes); its state tensors are StreamedRows stand-ins."""
        return self._stream is not None

    @property
    def output_ids(self) -> list:
        """The generated tokens the server sent: input_ids[prompt_len:] + [next_token]."""
        if self.prompt_len > self.num_tokens or self.next_token < 0:
            return []
        return self.input_ids[self.prompt_len:].tolist() + [self.next_token]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def row_nbytes(self) -> int:
        """Bytes of its rows (every captured state of every token): what chunks() splits."""
        return self.num_tokens * self._row_bytes

    @property
    def positions(self) -> torch.Tensor:
        """[T] int32 0..T-1, derived, not captured: the ring holds no positions, since row t is position t
        by construction (the server gathers a request's rows through req_to_token in position order and
        checks their count). Kept because docs/reading.md shows it; nothing to check in it: whether row t
        really is position t shows only in its values (e.g. against HF transformers)."""
        return torch.arange(self.num_tokens, dtype=torch.int32)


class StreamedRecordError(TypeError):
    """A streamed record's rows were asked for as one tensor: they are read with reader.chunks(record)."""


class StreamedRows:
    """What a streamed record (one that leaves the server's ring in parts, more than the reader's part_bytes of
    rows) holds in place of aux_hidden_states, last_hidden_state and last_pre_norm: its rows are never in one
    place, they come a part at a time through reader.chunks(record). It has the tensor's shape and dtype (what a
    sink or a spill needs to lay its file out), and everything else (indexing, any torch function, .to(), .numpy())
    raises StreamedRecordError naming the record, so no consumer gets a silent wrong answer."""

    def __init__(self, rid: str, name: str, shape: tuple, dtype: torch.dtype, of: object = None) -> None:
        self.__dict__.update(_rid=rid, _name=name, shape=torch.Size(shape), dtype=dtype, device=torch.device("cpu"),
                             _of=of)

    def same_rows(self, other) -> bool:
        """Whether `other` stands in for another state of the same streamed record (its rows side by side with
        these in every part: a sink that stores a record's states as one tensor, SpecForge's, lays the file out
        as for a record's own views)."""
        return isinstance(other, StreamedRows) and other._of is not None and other._of is self._of

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def _refuse(self, what: str) -> StreamedRecordError:
        return StreamedRecordError(f"{self._name} of the record of {self._rid!r} is streamed in parts (more row bytes "
                                   f"than the reader's part_bytes), not one tensor ({what}): read its rows with "
                                   "reader.chunks(record)")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocol probes (copy, pickle, numpy's array interface): as any object
            raise AttributeError(name)
        raise self._refuse(f".{name}")

    def __getitem__(self, key):
        raise self._refuse("indexed")

    def __iter__(self):
        raise self._refuse("iterated")

    def __len__(self) -> int:
        raise self._refuse("len()")

    def __array__(self, *a, **k):
        raise self._refuse("as an array")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def find(x):
            if isinstance(x, cls):
                return x
            items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
            return next((f for f in map(find, items) if f is not None), None)

        raise find((args, kwargs or {}))._refuse(getattr(func, "__name__", str(func)))

    def __repr__(self) -> str:
        return f"StreamedRows({self._name} of {self._rid!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _refused_op(name: str):
    def op(self, *args):
        raise self._refuse(name)
    return op


for _op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lt", "le", "gt",
            "ge", "neg", "abs", "bool", "float", "int"):
    setattr(StreamedRows, f"__{_op}__", _refused_op(f"__{_op}__"))
    if _op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor"):
        setattr(StreamedRows, f"__r{_op}__", _refused_op(f"__r{_op}__"))


class _Parted:
    """A parted record coming in from one ring (its parts come back to back, nothing between them). `mode`:
    "assemble" (each part copied into `rows`, the whole record, and released at once; the record is ready at its
    last part), "stream" (the record was ready at its first part; `parts` holds the parts arrived and not read by
    chunks() yet, views of the ring, each released once chunks() is past it) or "drop" (a streamed record acked
    before all its parts were read: the rest are released as they arrive)."""

    def __init__(self, record: "HiddenStateRecord", mode: str, ring: RingReader, total_rows: int) -> None:
        self.record, self.mode, self.ring, self.total_rows = record, mode, ring, total_rows
        self.rows: Optional[torch.Tensor] = None  # assemble: the whole record's rows
        self.parts: "collections.deque" = collections.deque()  # stream: ring Records arrived, not read yet
        self.received = 0  # rows arrived
        self.read = 0  # rows chunks() moved past (stream)
        self.current = None  # the part chunks() is reading (stream)
        self.iterated = False  # chunks() was asked for (once only)
        self.given_back = False  # a part's ring bytes were taken back by the server before it was read out
        self.lost: Optional[Exception] = None  # why its remaining parts will never come (a restart, close())

    @property
    def complete(self) -> bool:
        return self.received == self.total_rows


@dataclass
class RecordChunk:
    """Rows [start, stop) of a record, from HiddenStateReader.chunks: slices of its tensors (views of the ring
    for a record that is one)."""
    start: int
    stop: int
    input_ids: torch.Tensor  # [stop - start]
    aux_hidden_states: torch.Tensor  # [stop - start, K, H]
    last_hidden_state: Optional[torch.Tensor]
    last_pre_norm: Optional[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


DEFAULT_CHUNK_BYTES = DEFAULT_PART_BYTES  # chunks() without a bound, on a reader without part_bytes


def is_long(reader, rec) -> bool:
    """Whether `rec` is a long record of `reader`: more row bytes than its part_bytes (a HiddenStateReader's, which
    hands such a record as views of the ring, or a live dataset worker's RoutedRecords'), read a chunk at a time."""
    bound = getattr(reader, "part_bytes", None)
    return bool(bound) and rec.row_nbytes > bound


class NoWriterHere(FileNotFoundError):
    """The dump dir is that of a node hosting no writer of a multi-node server (SGLang --nnodes): its
    launcher says so there (fsutil.NO_WRITER); the records land in another node's dump dir."""


def no_writer_here(dump_dir: str) -> Optional[str]:
    """Why `dump_dir` will never hold records (one line naming it and the nodes whose dumps do), or None when
    its launcher did not mark it as a node without writers."""
    path = os.path.join(dump_dir, NO_WRITER)
    try:
        os.stat(path)
    except OSError:  # not there, or a dump dir closed to this user (the manifest's wait says so)
        return None
    try:
        with open(path) as f:
            marker = json.load(f)
    except (OSError, ValueError):  # unreadable: still the mark of a node without writers
        marker = {}
    marker = marker if isinstance(marker, dict) else {}
    nodes = marker.get("writer_nodes") or [0]
    where = "node " + ", ".join(map(str, nodes)) + "'s dump" + ("s" if len(nodes) > 1 else "")
    return (f"{dump_dir}: this node hosts no writer (node {marker.get('node_rank', '?')} of "
            f"{marker.get('nnodes', '?')}, {marker.get('layout', 'a multi-node server')}): records of this server "
            f"land in {where}; read them there")


def _exists(path: str) -> bool:
    """Whether the manifest is there yet; a dump dir closed to this user is an error, not a wait."""
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False
    except PermissionError:
        folder = os.path.dirname(path)
        try:
            st = os.stat(folder)
            whose = f" (owner uid {st.st_uid}, group {st.st_gid}, mode {st.st_mode & 0o7777:04o})"
        except OSError:
            whose = ""
        raise PermissionError(f"{folder}: permission denied{whose}; a dump is this user's only, unless the server "
                              "shares it with a group of yours (--hs-share-group)") from None


def _lock_ring(ring: RingReader) -> RingReader:
    """Hold an exclusive lock on the ring file (the one mapped) while this reader lives (it dies with the
    process): two readers of one ring would split or duplicate its records. Returns the ring, which the
    reader closes to let go; a ring it cannot lock is closed here."""
    try:
        fcntl.flock(ring.r.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ring.reader_pid() or "?"
        ring.close()
        raise RuntimeError(f"{ring.r.path}: already read by another HiddenStateReader (pid {holder}); one reader "
                           "per dump dir: stop or close() that one first") from None
    ring.set_reader_pid(os.getpid())
    return ring


class HiddenStateReader:
    def __init__(self, dump_dir: str, wait: float = 60.0, poll_interval: float = 0.002,
                 recycle_memory: bool = False, ack: bool = False, owner=None, zero_copy: bool = False,
                 reattach: bool = False, part_bytes: Optional[int] = None, part_wait: float = 60.0) -> None:
        """`owner`: the user (name or uid) whose dump files to trust; default this user. Pass the
        server's user when it shares the dump with a group of yours (--hs-share-group). `zero_copy`
        (with `ack`): records are views of the ring, valid until acked (module docstring). `reattach`:
        follow a restarted server to its new ring, instead of raising ServerRestarted. `part_bytes` (with
        `ack`): records of more row bytes than that are long records, read in chunks (module docstring).
        `part_wait`: how long chunks() of a streamed record waits for its next part before TimeoutError."""
        if zero_copy and not ack:
            raise ValueError("HiddenStateReader(zero_copy=True) needs ack=True: a zero-copy record is a view of the "
                             "server's ring, valid until you ack() it")
        if part_bytes is not None and (not ack or isinstance(part_bytes, bool) or not isinstance(part_bytes, int)
                                       or part_bytes < 1):
            raise ValueError(f"HiddenStateReader(part_bytes={part_bytes!r}): a byte count >= 1, with ack=True (a long "
                             "record is a view of the server's ring until you ack() it)")
        self.part_bytes = part_bytes
        self.part_wait = part_wait
        # poll(), ack() and a streamed record's chunks() may run on different threads (the extraction CLI's writer
        # threads read a streamed record's chunks, which polls for its next part, while the main thread takes)
        self._lock = threading.RLock()
        self._parted: dict = {}  # (generation, writer) -> _Parted: the parted record coming in from that ring
        self.orphan_parts = 0  # later parts of a record whose first parts a reader before this one consumed
        if recycle_memory:
            recycle_freed_memory()
        self.dump_dir = os.path.abspath(dump_dir)
        self.poll_interval = poll_interval
        path = os.path.join(self.dump_dir, MANIFEST)
        deadline = time.monotonic() + wait
        while True:
            why = no_writer_here(self.dump_dir)  # first: a stale manifest of an earlier server may still be there
            if why is not None:
                raise NoWriterHere(why)
            if _exists(path):
                break
            if time.monotonic() > deadline:
                raise FileNotFoundError(f"{path}: no manifest after {wait}s; is a server capturing into "
                                        f"--hs-dump-dir {self.dump_dir}?")
            time.sleep(0.05)
        uid = self._uid = None if owner is None else owner_uid(owner)
        self.manifest = read_manifest(path, uid)
        while len(self.manifest["writers"]) < self.manifest.get("num_writers", 1):
            # data-parallel attention: each group's writer on this node adds itself to the manifest as it starts
            if time.monotonic() > deadline:
                have = sorted(dp_rank_of(w) for w in self.manifest["writers"])
                raise FileNotFoundError(f"{path}: {len(self.manifest['writers'])} of the "
                                        f"{self.manifest['num_writers']} writers it announces after {wait}s (DP "
                                        f"ranks {have} of this node's {self.manifest.get('dp_ranks')})")
            time.sleep(0.05)
            self.manifest = read_manifest(path, uid)
        # DeepSeek-V4 with --hs-hc-streams full: hc_mult rows per layer id (stream s of id k at row k*hc_mult+s)
        self.rows_per_layer = int(self.manifest.get("rows_per_layer", 1))
        self.num_aux = len(self.manifest["layer_ids"]) * self.rows_per_layer
        self.dp_ranks = sorted(dp_rank_of(w) for w in self.manifest["writers"])  # the DP groups this reader covers
        self.finals = final_states(self.manifest)  # row order after the K layers
        self.has_last = "post-norm" in self.finals
        self.ack_mode = ack
        self.zero_copy = zero_copy
        self._ready: "collections.OrderedDict[str, HiddenStateRecord]" = collections.OrderedDict()
        # a reused rid (a client retrying with the same rid after its request finished): records of that rid
        # that arrived while an older one was still here wait in line behind it, never replacing it (a
        # replaced record would be lost and, with ack=True, never acknowledged: the ring would stay full)
        self._later: "dict[str, collections.deque]" = {}
        # markers of requests served without capture: arrival number -> (rid, reason), oldest first; and per
        # rid, the arrival numbers of its markers. A rid used again has one outcome per request (a record or a
        # marker): take(rid) answers them oldest first, by arrival, and consumes the one it answers with.
        self._skipped: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
        self._marks: "dict[str, collections.deque]" = {}
        self._arrivals = 0
        self.markers = 0  # marker records seen (requests served without capture)
        self.reattach, self.restarts = reattach, 0  # restarts: new server generations this reader attached to
        self._generation, self._retired = 0, {}  # (generation, writer) -> an old ring with records not acked yet
        self._next_try = 0.0  # monotonic time of the next look for a restarted server's manifest
        self._rings, self._locks = self._attach(self.manifest)
        self._ring_ids = ring_ids(self.manifest)

    def _attach(self, manifest: dict):
        """Open and lock the ring of every writer of `manifest`: (rings, the rings held: the same)."""
        rings, locks = [], []
        try:
            for w in manifest["writers"]:
                ring = RingReader.open(self.dump_dir, w["ring"], self._uid, manifest.get("share_gid"),
                                       populate=self.part_bytes is None)
                ring.drop_behind = self.part_bytes is not None
                locks.append(_lock_ring(ring))  # closes the ring if it cannot lock it
                rings.append(ring)
        except BaseException:
            for ring in locks:
                ring.close()
            raise
        return rings, locks

    def _check_restart(self) -> None:
        """Called when a poll found nothing new: if the server was restarted (its ring unlinked), raise
        ServerRestarted, or (reattach=True) attach to the new server's rings once its manifest names them."""
        replaced = [ring.r.path for ring in self._rings if ring.replaced()]
        if not replaced:
            return
        if not self.reattach:
            raise ServerRestarted(f"{replaced[0]}: the server was restarted (its output ring was replaced); the "
                                  "records of requests it had not finished are gone, and this reader stops here")
        now = time.monotonic()
        if now < self._next_try:
            return
        self._next_try = now + REATTACH_TRY_S
        path = os.path.join(self.dump_dir, MANIFEST)
        try:
            manifest = read_manifest(path, self._uid)
        except FileNotFoundError:
            return  # the new server has not written it yet
        if ring_ids(manifest) == self._ring_ids or len(manifest["writers"]) < manifest.get("num_writers", 1):
            return  # still the old server's manifest, or not every writer of the new one is there yet
        differ = [k for k in SAME_SETUP if manifest.get(k) != self.manifest.get(k)]
        if differ:
            raise ServerRestarted(f"{path}: the server was restarted with another capture setup ("
                                  + "; ".join(f"{k} {self.manifest.get(k)!r} before, {manifest.get(k)!r} now"
                                              for k in differ) + "): this reader stops here")
        try:
            rings, locks = self._attach(manifest)
        except FileNotFoundError:
            return  # a ring the manifest names is not there yet
        except RuntimeError as e:  # another reader locked the new ring first
            raise ServerRestarted(f"the server was restarted and {e}") from None
        for w, ring in enumerate(self._rings):
            if ring.unreleased():  # records read ahead from the old ring: their acks still go to it
                self._retired[(self._generation, w)] = ring
        for ring in self._locks:
            ring.close()
        for key in [k for k in self._parted if k[0] == self._generation]:  # its remaining parts will never come
            st = self._parted.pop(key)
            st.lost = ServerRestarted(f"the server was restarted before the last part of the streamed record of "
                                      f"{st.record.rid!r}: its remaining rows are gone")
        self._rings, self._locks, self.manifest = rings, locks, manifest
        self._ring_ids = ring_ids(manifest)
        self.dp_ranks = sorted(dp_rank_of(w) for w in manifest["writers"])
        self._generation += 1
        self.restarts += 1

    def close(self) -> None:
        """Let another reader take over the dump dir (records not acknowledged stay in the ring). A reader
        holding records that are views of the ring (zero-copy, or long records of part_bytes) first drops the
        records it holds and has not handed out: once the next reader acknowledges them the server writes over
        their bytes."""
        with self._lock:
            for st in self._parted.values():  # parted records coming in: their parts not read stay in the ring
                st.lost = RuntimeError(f"this HiddenStateReader of {self.dump_dir} was closed before the last part "
                                       f"of the streamed record of {st.record.rid!r}")
                st.parts.clear()
            self._parted = {}
            held = list(self._ready.values()) + [r for later in self._later.values() for r in later]
            if any(record.views for record in held):  # copied records stay takeable after close, as before
                for record in held:
                    if record.views:
                        record.drop_tensors()
                self._ready = type(self._ready)((rid, r) for rid, r in self._ready.items() if not r.views)
                later = ((rid, collections.deque(r for r in recs if not r.views)) for rid, recs in self._later.items())
                self._later = type(self._later)((rid, recs) for rid, recs in later if recs)
            for ring in self._locks:
                ring.close()
            self._locks, self._rings, self._retired = [], [], {}

    def __enter__(self) -> "HiddenStateReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_locks", None):
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; the locks die with the process anyway
            pass

    def poll(self) -> int:
        """Bring in every record published since the last poll; returns how many arrived (a parted record counts
        once: when it becomes ready, at its last part when assembled, at its first when streamed)."""
        with self._lock:
            if not self._locks:
                raise RuntimeError(f"this HiddenStateReader of {self.dump_dir} is closed")
            n = 0
            for w, ring in enumerate(self._rings):
                # parts come as views to an acknowledging reader (copied into their record, or streamed, then
                # released); an eager one's drain() copies them out and releases them at once (assembled by a second
                # copy: its views would be the writer's again before this loop read them)
                for rec in (ring.read_ahead(copy=not self.zero_copy, view_above=self.part_bytes, part_views=True)
                            if self.ack_mode else ring.drain()):
                    if rec.skipped:
                        self._marker(ring, rec)
                        n += 1
                    elif rec.is_part:
                        record = self._part_in(w, ring, rec)
                        if record is not None:
                            self._arrive(record)
                            n += 1
                    else:
                        self._arrive(self._record_of(w, ring, rec))
                        n += 1
            if n == 0:
                self._check_restart()
            return n

    def _marker(self, ring: RingReader, rec) -> None:
        """A marker: that request has no record."""
        if self.ack_mode:
            ring.release(rec.seq)
        self._arrivals += 1
        self._skipped[self._arrivals] = (rec.rid, SKIP_REASONS[rec.skipped])
        self._marks.setdefault(rec.rid, collections.deque()).append(self._arrivals)
        if len(self._skipped) > MAX_MARKERS:  # the oldest marker of all is its rid's oldest
            _, (old, _) = self._skipped.popitem(last=False)
            self._marks[old].popleft()
            if not self._marks[old]:
                del self._marks[old]
        self.markers += 1

    def _record_of(self, w: int, ring: RingReader, rec, rows: Optional[torch.Tensor] = None,
                   input_ids: Optional[torch.Tensor] = None, stream: Optional[_Parted] = None) -> HiddenStateRecord:
        """The HiddenStateRecord of ring record `rec` (a whole one; or a parted record's first part, with the
        whole `rows` assembled, or `stream`: its rows stand-ins, StreamedRows)."""
        rows = rec.rows if rows is None else rows
        ids = rec.input_ids if input_ids is None else input_ids
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        if stream is not None:
            N, _, H = stream.total_rows, *rows.shape[1:]
            aux = StreamedRows(rec.rid, "aux_hidden_states", (N, self.num_aux, H), rows.dtype, stream)
            last, pre = (StreamedRows(rec.rid, name, (N, H), rows.dtype, stream) if which in self.finals else None
                         for name, which in (("last_hidden_state", "post-norm"), ("last_pre_norm", "pre-norm")))
        else:
            aux, last, pre = rows[:, :self.num_aux], self._final(rows, "post-norm"), self._final(rows, "pre-norm")
        views = stream is not None or (rec.views and rows is rec.rows)
        return HiddenStateRecord(
            rid=rec.rid, input_ids=ids, aux_hidden_states=aux, last_hidden_state=last, last_pre_norm=pre, seq=rec.seq,
            writer=w, dp_rank=dp_rank_of(self.manifest["writers"][w]), ring_id=self._ring_ids[w],
            generation=self._generation, prompt_len=rec.prompt_len, next_token=rec.next_token, offset=rec.offset,
            meta=rec.meta, views=views,
            _rows_at=rows.data_ptr() - ring.r.buf.data_ptr() if views and stream is None and rows.shape[0] else -1,
            _row_bytes=row_bytes, _stream=stream)

    def _arrive(self, record: HiddenStateRecord) -> None:
        """A record is ready: take() answers it (after any older one of its rid)."""
        self._arrivals += 1
        record._arrival = self._arrivals
        if record.rid in self._ready:
            self._later.setdefault(record.rid, collections.deque()).append(record)
        else:
            self._ready[record.rid] = record

    def _part_in(self, w: int, ring: RingReader, rec) -> Optional[HiddenStateRecord]:
        """Take one part of a parted record (a view of the ring; the ring checked it continues the record before
        it, in order). Returns the record when it becomes ready: an assembled one at its last part, a streamed
        one at its first."""
        key = (self._generation, w)
        if rec.orphan:  # its record's first parts went to a reader before this one: lost, let its bytes go
            self._release_part(ring, rec)
            self.orphan_parts += 1
            if self.orphan_parts == 1:
                logger.warning("sglang-hs: %s: the record of request %r was being read in parts by a reader that "
                               "stopped; its remaining parts are skipped (the record is lost)", ring.r.path, rec.rid)
            return None
        st = self._parted[key] = self._first_part(w, ring, rec) if rec.first_row == 0 else self._parted[key]
        T = rec.rows.shape[0]
        st.received += T
        if st.mode == "assemble":
            st.rows[rec.first_row:rec.first_row + T].copy_(rec.rows)
            self._release_part(ring, rec)  # copied: its ring bytes go back at once, so the next part can come
        elif st.mode == "stream":
            st.parts.append(rec)
        else:  # "drop": its record was acknowledged before this part came
            self._release_part(ring, rec)
        if st.complete:
            del self._parted[key]
        if st.mode == "assemble":
            return st.record if st.complete else None
        return st.record if rec.first_row == 0 else None  # streamed: ready at its first part

    def _first_part(self, w: int, ring: RingReader, rec) -> _Parted:
        """The state of a parted record from its first part: streamed (more than part_bytes of rows: ready now, its
        parts read by chunks()) or assembled (a whole copy of its rows, filled as its parts arrive)."""
        N = rec.total_rows
        row_bytes = rec.rows[0].numel() * rec.rows.element_size()
        ids = rec.input_ids.clone()  # all N ids (4 bytes a token): small, and the part's bytes go back early
        if self.part_bytes is not None and N * row_bytes > self.part_bytes:
            st = _Parted(None, "stream", ring, N)
            st.record = self._record_of(w, ring, rec, input_ids=ids, stream=st)
            return st
        st = _Parted(None, "assemble", ring, N)
        st.rows = torch.empty((N, *rec.rows.shape[1:]), dtype=rec.rows.dtype)
        st.record = self._record_of(w, ring, rec, rows=st.rows, input_ids=ids)
        return st

    def _release_part(self, ring: RingReader, rec) -> None:
        """A part is done with: its ring bytes go back to the server (eager readers released it already)."""
        if self.ack_mode:
            ring.release(rec.seq)

    def _final(self, rows: torch.Tensor, which: str) -> Optional[torch.Tensor]:
        return rows[:, self.num_aux + self.finals.index(which)] if which in self.finals else None

    def _pop(self, rid: str) -> HiddenStateRecord:
        """The oldest ready record of `rid`; the next one of a reused rid, if any, becomes ready."""
        with self._lock:
            record = self._ready.pop(rid)
            later = self._later.get(rid)
            if later:
                self._ready[rid] = later.popleft()
                if not later:
                    del self._later[rid]
            return record

    def ack(self, record: HiddenStateRecord) -> None:
        """The consumer is done with `record`: with ack=True its ring bytes go back to the server (once
        the records before it are acknowledged too); a no-op for an eager reader. A zero-copy record's
        tensors are dropped (None): its bytes are the server's again. A streamed record acked before chunks()
        read all its parts: the rest are released as they arrive (poll() consumes them). An assembled record's
        parts went back to the server as they were copied: its ack releases nothing more."""
        with self._lock:
            self._ack(record)

    def _ack(self, record: HiddenStateRecord) -> None:
        st = record._stream
        if st is not None and st.mode == "stream":
            st.mode = "drop"
            while st.parts:
                self._release_part(st.ring, st.parts.popleft())
            if st.current is not None:
                self._release_part(st.ring, st.current)
                st.current = None
        if self.ack_mode:
            if not self._locks:
                raise RuntimeError(f"this HiddenStateReader of {self.dump_dir} is closed: the record of "
                                   f"{record.rid!r} comes again to the next reader")
            key = (record.generation, record.writer)
            if record.generation == self._generation:
                self._rings[record.writer].release(record.seq)
            elif key in self._retired:  # a record of the server before a restart: its old ring
                self._retired[key].release(record.seq)
                if not self._retired[key].unreleased():
                    del self._retired[key]
        if record.views:
            record.drop_tensors()

    def _ring_of(self, record: HiddenStateRecord) -> Optional[RingReader]:
        """The ring `record` came from (None: its server's ring was let go)."""
        if record.generation == self._generation:
            return self._rings[record.writer] if self._locks else None
        return self._retired.get((record.generation, record.writer))

    def chunks(self, record: HiddenStateRecord, max_bytes: Optional[int] = None) -> Iterator[RecordChunk]:
        """`record`'s rows in order, in chunks of at most `max_bytes` of rows (default: the reader's part_bytes,
        else DEFAULT_CHUNK_BYTES; at least one token's rows): RecordChunks of views of its tensors. For a record
        that is views of the ring (zero_copy, or a long record of part_bytes), asking for the next chunk unmaps
        from this process the ring pages of the chunks before it (madvise MADV_DONTNEED: the ring keeps them, a
        later read maps them again), and so does the end of the iteration (or its close()) for the rows handed
        out: only the pages wholly inside the record's rows, never its header, token ids or trailer, nor another
        record's. So be done with a chunk's views before asking for the next; reading a chunk's views afterwards
        still gives its bytes (until the record's ack) but maps its pages again. A copied record is just
        sliced."""
        if record.aux_hidden_states is None:
            raise ValueError(f"record of {record.rid!r} was acknowledged: its tensors are gone")
        bound = max_bytes if max_bytes is not None else self.part_bytes or DEFAULT_CHUNK_BYTES
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise ValueError(f"chunks(max_bytes={max_bytes!r}): a byte count >= 1")
        if record._stream is not None:
            return self._stream_chunks(record, bound)
        return self._slice_chunks(record, bound)

    def _slice_chunks(self, record: HiddenStateRecord, bound: int) -> Iterator[RecordChunk]:
        """chunks() of a record held whole (copied, or views of the ring)."""
        T, row = record.num_tokens, record._row_bytes
        n = max(1, bound // row) if row else max(T, 1)
        ring = self._ring_of(record) if record.views and record._rows_at >= 0 else None
        at = record._rows_at
        page = mmap.PAGESIZE
        low, done = at, 0  # unmapped below `low` already; rows [0, done) handed out

        def drop(rows: int) -> None:
            nonlocal low
            if ring is not None and rows:
                end = at + rows * row
                ring.drop(low, end - low)
                low = max(at, end // page * page)

        try:
            for start in range(0, T, n):
                drop(start)
                stop = min(T, start + n)
                yield RecordChunk(start, stop, record.input_ids[start:stop], record.aux_hidden_states[start:stop],
                                  None if record.last_hidden_state is None else record.last_hidden_state[start:stop],
                                  None if record.last_pre_norm is None else record.last_pre_norm[start:stop])
                done = stop
        finally:
            drop(done)

    def _stream_chunks(self, record: HiddenStateRecord, bound: int) -> Iterator[RecordChunk]:
        """chunks() of a streamed record: its parts' rows as they arrive (chunks of at most `bound` row bytes, a
        part split as needed, never two parts in one chunk), each part released to the server (its ring pages
        unmapped) once the next chunk after it is asked for. Once only: the parts are gone after."""
        st = record._stream
        with self._lock:
            if st.iterated:
                raise RuntimeError(f"chunks() of the streamed record of {record.rid!r} was asked for a second time: "
                                   "its parts went back to the server as the first pass read them")
            st.iterated = True
        n = max(1, bound // record._row_bytes)
        return self._parts_of(record, st, n)

    def _parts_of(self, record: HiddenStateRecord, st: _Parted, n: int) -> Iterator[RecordChunk]:
        try:
            while True:
                part = self._next_part(record, st)
                if part is None:
                    return
                at, T = part.first_row, part.rows.shape[0]
                for s in range(0, T, n):
                    if s:  # the pages of the part's chunks before this one (drop_behind: the part's rest at release)
                        self._still_readable(record, st)
                        self._drop_rows(st.ring, part.rows, s)
                    e = min(T, s + n)
                    rows = part.rows[s:e]
                    yield RecordChunk(at + s, at + e, record.input_ids[at + s:at + e], rows[:, :self.num_aux],
                                      self._final(rows, "post-norm"), self._final(rows, "pre-norm"))
                self._part_done(st)
        finally:
            self._part_done(st)

    def _still_readable(self, record: HiddenStateRecord, st: _Parted) -> None:
        """A streamed record's parts may be read on: not acknowledged meanwhile (its parts went back), nor the
        reader closed (they are the next reader's, who may acknowledge them and have them written over)."""
        if not self._locks:
            raise st.lost or RuntimeError(f"this HiddenStateReader of {self.dump_dir} is closed: the streamed record "
                                          f"of {record.rid!r} comes again to the next reader")
        if st.mode != "stream":
            raise ValueError(f"record of {record.rid!r} was acknowledged: its tensors are gone")

    @staticmethod
    def _drop_rows(ring: RingReader, rows: torch.Tensor, upto: int) -> None:
        """Unmap from this process the whole pages of a part's rows [0, upto) (a view of the ring's mapping)."""
        if ring.drop_behind:
            at = rows.data_ptr() - ring.r.buf.data_ptr()
            ring.drop(at, upto * rows[0].numel() * rows.element_size())

    def _next_part(self, record: HiddenStateRecord, st: _Parted):
        """The next part of a streamed record for chunks() (None: all read), polling for it until part_wait."""
        deadline = time.monotonic() + self.part_wait
        while True:
            with self._lock:
                self._still_readable(record, st)
                if st.parts:
                    st.current = st.parts.popleft()
                    return st.current
                if st.read == st.total_rows:
                    return None
                if st.lost is not None:
                    raise st.lost
                arrived = self.poll()
                if st.parts:
                    continue
                if time.monotonic() > deadline:
                    raise self._part_timeout(record, st)
            if not arrived:
                time.sleep(self.poll_interval)

    def _part_done(self, st: _Parted) -> None:
        """chunks() is past the part it read: its ring bytes go back (its pages unmapped: drop_behind), once checked
        to be still this reader's (intact)."""
        with self._lock:
            part, st.current = st.current, None
            if part is None or not self._locks:  # a closed reader leaves its parts to the next one
                return
            st.read += part.rows.shape[0]
            if not st.ring.holds(part.offset):
                st.given_back = True
            self._release_part(st.ring, part)

    def _part_timeout(self, record: HiddenStateRecord, st: _Parted) -> TimeoutError:
        """No next part of a streamed record came: say what was read, and what holds the ring's TAIL back."""
        first_seq = record.seq
        held = st.ring.unreleased_before(first_seq)
        msg = (f"no part of the streamed record of {record.rid!r} (seq {first_seq}) after {self.part_wait}s: "
               f"{st.received} of its {st.total_rows} rows arrived, {st.read} read")
        if held:
            msg += (f"; {len(held)} records read before it and not acknowledged (seq {', '.join(map(str, held[:8]))}"
                    f"{', ...' if len(held) > 8 else ''}) hold the ring's TAIL back, so the server cannot publish "
                    "its next part once the ring is full: ack() them before reading a streamed record")
        return TimeoutError(msg)

    def intact(self, record: HiddenStateRecord) -> bool:
        """Whether every byte of `record` read so far was the record's: always for a copied record (checked as
        it was copied); for a zero-copy one, whether the server has not taken its ring bytes back yet. Only
        this reader's ack gives them back, unless someone else writes the read offset (a member of the share
        group may): the server then writes over the record's bytes, and views read meanwhile hold a torn mix.
        Ask after using the views (writing the file) and before ack(); False: discard what was made of them.
        A record acknowledged already, or of a closed reader, is not intact."""
        if not record.views:
            return True
        if record.input_ids is None or not self._locks:  # acknowledged (its tensors dropped), or the reader closed
            return False
        st = record._stream
        if st is not None:  # each part checked as chunks() moved past it; the one it reads now, here
            with self._lock:
                part = st.current
                return not st.given_back and (part is None or st.ring.holds(part.offset))
        ring = self._ring_of(record)
        return ring is not None and ring.holds(record.offset)

    def unacked(self) -> int:
        """Records brought in and not acknowledged yet (0 for an eager reader)."""
        return sum(ring.unreleased() for ring in list(self._rings) + list(self._retired.values()))

    def _timeout(self, what: str, timeout: float) -> TimeoutError:
        msg = f"no record {what}after {timeout}s"
        unacked = self.unacked()
        if unacked:
            msg += (f"; {unacked} records read and not acknowledged hold {self.unread_bytes() / 1e6:.1f} MB "
                    "of the output ring, and new requests wait for ring space: ack() records as you go")
            coming = list(self._parted.values())
            if coming:
                st = coming[0]
                msg += (f" (the record of {st.record.rid!r} is coming in parts, {st.received} of its {st.total_rows} "
                        "rows so far: the server publishes its next part only into the ring room those acks"
                        + (", and reading its chunks()," if st.mode == "stream" else "") + " give back)")
        return TimeoutError(msg)

    def _marker_first(self, rid: str) -> bool:
        """The oldest outcome waiting for `rid` is a marker (not a record)."""
        marks = self._marks.get(rid)
        return bool(marks) and (rid not in self._ready or marks[0] < self._ready[rid]._arrival)

    def _pop_marker(self, rid: str) -> str:
        marks = self._marks[rid]
        _, reason = self._skipped.pop(marks.popleft())
        if not marks:
            del self._marks[rid]
        return reason

    def pop_ready(self, rid: str) -> Optional[HiddenStateRecord]:
        """That request's record if a poll() already brought it in (and no older marker of its rid waits
        for a take()), else None (never waits)."""
        return self._pop(rid) if rid in self._ready and not self._marker_first(rid) else None

    def discard(self, rid: str) -> int:
        """Drop every outcome of `rid` brought in so far, records and markers alike (another client's
        requests, or one the consumer gave up on), acknowledging the records so their ring bytes go back
        to the server. Returns how many records were dropped. (pop_ready answers None while an older
        marker of the rid waits: a loop that discards with it would keep the record, and with ack=True
        its bytes and every later record's, for good.)"""
        n = 0
        while rid in self._ready:
            self.ack(self._pop(rid))
            n += 1
        for arrival in self._marks.pop(rid, ()):
            self._skipped.pop(arrival, None)
        return n

    def take_markers(self) -> list:
        """[(rid, reason)] of every marker brought in and not answered yet, oldest first, consumed: for a
        reader that hands them on (the Mooncake publisher, sglang_hs/publish.py) instead of answering take()."""
        out = list(self._skipped.values())
        self._skipped.clear()
        self._marks.clear()
        return out

    def not_captured(self, rid: str) -> Optional[str]:
        """Why request `rid` has no record, when the oldest outcome waiting for that rid is a marker, else
        None (never waits; the marker stays for take())."""
        return self._skipped[self._marks[rid][0]][1] if self._marker_first(rid) else None

    def ready_rids(self) -> list:
        return list(self._ready)

    def unread_bytes(self) -> int:
        """Bytes published to the rings and not yet drained: how far this reader lags the server."""
        return sum(ring.unread_bytes() for ring in self._rings)

    def largest_record_bytes(self) -> int:
        """An upper bound on the bytes of any record this server can write, so what a consumer that holds records
        whole (an assembling reader, the Mooncake publisher) must be able to hold: half its largest ring (admission
        takes a request only if twice its worst-case record fits the ring); on a server that publishes long
        records in parts (manifest `record_part_bytes`, --hs-record-part-size), a record of the whole context.
        A streaming reader (part_bytes) holds a part at a time instead."""
        half = max((ring.capacity // 2 for ring in self._rings), default=0)
        m = self.manifest
        if not m.get("record_part_bytes"):
            return half
        P, H, elem = int(m.get("rows_per_token", 1)), int(m["hidden_size"]), getattr(torch, m["dtype"]).itemsize
        rows = int(m["context_len"])
        # with the longest request id a record can name and a speculative record's metadata (each verify step's
        # accepted drafts) at its bound: admission sizes parted records by their first part, not by these
        whole = record_bytes(rows, P, H, elem, MAX_RID_BYTES, meta_bound(rows))
        return max(half, whole)

    def take(self, rid: str, timeout: Optional[float] = None) -> HiddenStateRecord:
        """That request's record, waiting for it; raises NotCaptured once its marker says it has none. A rid
        used again: each call answers the oldest request of that rid not answered yet, record or marker."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while rid not in self._ready:
            if rid in self._marks:
                break
            arrived = self.poll()
            if rid in self._ready or rid in self._marks:
                continue
            if deadline is not None and time.monotonic() > deadline:  # checked even while others arrive
                raise self._timeout(f"for request {rid!r} ", timeout)
            if not arrived:
                time.sleep(self.poll_interval)
        if self._marker_first(rid):
            raise NotCaptured(rid, self._pop_marker(rid))
        return self._pop(rid)

    def next(self, timeout: Optional[float] = None) -> HiddenStateRecord:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            arrived = self.poll()  # markers count as arrivals but are not records
            if self._ready:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise self._timeout("", timeout)
            if not arrived:
                time.sleep(self.poll_interval)
        return self._pop(next(iter(self._ready)))

    def __iter__(self) -> Iterator[HiddenStateRecord]:
        while True:
            yield self.next()
