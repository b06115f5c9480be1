"""The scheduler side of the capture: the store indexed by KV slot, and publishing finished records.

One writer per attention-TP rank 0 (this slice: a single data-parallel group, writer 0). Files under
the dump dir, all 0600, never through a symlink:
    manifest.json      what the dump holds (versions, model, layer ids and their HF meaning, writers)
    store-w0.bin       [num_slots, P, H] rows, row s = the token whose KV lives in slot s
    ring-w0.bin        the output ring of finished records (sglang_hs/server/store/ring.py): the writer's alone
    ring-w0.offset     the ring's reader writes how far it has read here (with --hs-share-group: 0660 of the
                       group, the ring 0640 and the manifest 0640; the store stays 0600)

`copy()` runs inside every forward: the step's rows go to their KV slots (`out_cache_loc`), by the Triton
kernel on CUDA (sglang_hs/server/ops/copy_rows.py) and the C++ op on CPU (csrc/copy_rows_cpu.cpp), either
straight into the store (`--hs-copy direct`; on CUDA the store is registered, mapped host memory) or
through a device staging buffer that is shipped and scattered after the step (`--hs-copy staging`,
sglang_hs/server/store/staging.py; `before_step`/`after_step` run around every ModelRunner.forward). Prefix rows
served by the radix cache are already in the store, written when that prefix was computed; chunked
prefill needs no stitching. `finish()` runs where SGLang finishes a request (result processing, one
step late under the overlap scheduler, before the KV slots are released): it gathers the request's
rows through `req_to_token` in position order, checks the count, and publishes one record. That is the
synchronous path (SGLANG_HS_SYNC_FINISH=1); by default the scheduler only hands the request over and
the finish worker (sglang_hs/server/store/finisher.py) runs `publish_gathered` on its own thread.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable, Optional

import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.fsutil import share_file, write_private_file
from sglang_hs.server.store.ring import RingWriter, offset_name
from sglang_hs.server.store.shm import SharedRegion
from sglang_hs.version import SGLANG_VERSION, __version__

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1
FINISH_STATS = ("finish_pending", "finish_failed", "write_waits", "device_write_waits")  # counts; the *_s ones are seconds
FINISH_SECONDS = ("drain_s", "write_wait_s", "store_wait_s")
MANIFEST = "manifest.json"


def _write_manifest(dump_dir: str, manifest: dict, share_gid: Optional[int]) -> None:
    """The dump dir's one manifest. With several writers (data-parallel attention), each adds its entry,
    under a lock, to what the other writers of this server (same session) wrote, replacing a stale one."""
    if manifest.get("num_writers", 1) > 1:
        import fcntl

        fd = os.open(os.path.join(dump_dir, ".manifest.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                with open(os.path.join(dump_dir, MANIFEST)) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                old = {}
            if old.get("session") == manifest["session"]:
                mine = {w["id"] for w in manifest["writers"]}
                manifest["writers"] = sorted([w for w in old["writers"] if w["id"] not in mine] + manifest["writers"],
                                             key=lambda w: w["id"])
            write_private_file(dump_dir, MANIFEST, json.dumps(manifest, indent=1).encode(), share_gid)
        finally:
            os.close(fd)  # releases the lock
        return
    write_private_file(dump_dir, MANIFEST, json.dumps(manifest, indent=1).encode(), share_gid)


class CaptureWriter:
    def __init__(self, dump_dir: str, spec: CaptureSpec, num_slots: int, dtype: torch.dtype, ring_bytes: int,
                 model_path: str = "", architecture: str = "", writer_id: int = 0, device: str = "cpu",
                 context_len: int = 0, copy: str = "direct", staging_rows: int = 0, node: Optional[dict] = None,
                 page_size: int = 1, served: Optional[dict] = None) -> None:
        """`writer_id`: this writer's DP attention rank. `node`: this node's writers (capture_hooks.node_writers:
        dp_ranks, dp_size, nnodes, node_rank); default a single node with one DP group. `served`: the target,
        draft and chat template that serve (identity.served_identity), kept in the manifest."""
        from sglang_hs import envs

        if copy not in envs.COPY_STRATEGIES:
            raise ValueError(f"sglang-hs: unknown copy strategy {copy!r} ({', '.join(envs.COPY_STRATEGIES)})")
        if copy == "deferred" and not str(device).startswith("cuda"):
            raise ValueError(f"sglang-hs: --hs-copy deferred needs a CUDA device, not {device} (use direct or staging)")
        share_gid = envs.SGLANG_HS_SHARE_GID
        gather_threads, scatter_threads = envs.SGLANG_HS_GATHER_THREADS, envs.SGLANG_HS_SCATTER_THREADS
        for name, flag, value in (("SGLANG_HS_GATHER_THREADS", "--hs-gather-threads", gather_threads),
                                  ("SGLANG_HS_SCATTER_THREADS", "--hs-scatter-threads", scatter_threads)):
            if value <= 0:
                raise ValueError(f"sglang-hs: {name} ({flag}) must be > 0, got {value}")
        from sglang_hs._ext import ext

        C = ext()
        if not hasattr(C, "gather_rows_cpu") or "num_threads" not in (C.copy_rows_cpu.__doc__ or ""):
            raise RuntimeError("sglang-hs: the compiled extension sglang_hs._C predates this sglang-hs (it has no "
                               "gather_rows_cpu, or copy_rows_cpu has no num_threads); rebuild it: "
                               "pip install --no-build-isolation -e .")
        self.spec = spec
        self.P = spec.rows_per_token
        H = spec.hidden_size
        elem = torch.empty(0, dtype=dtype).element_size()
        for name in (f"store-w{writer_id}.bin", f"ring-w{writer_id}.bin", offset_name(f"ring-w{writer_id}.bin")):
            _remove_stale(dump_dir, name)
        nbytes = num_slots * self.P * H * elem
        try:
            self.region = SharedRegion.create(dump_dir, f"store-w{writer_id}.bin", nbytes)
        except RuntimeError as e:
            raise RuntimeError(
                f"sglang-hs: the store needs {nbytes / 1e9:.2f} GB ({num_slots} KV slots x {self.P} x {H} x {elem} "
                f"bytes) in {dump_dir} ({e}); shrink it with --max-total-tokens or --mem-fraction-static, or "
                "give the dump dir's filesystem more room") from None
        self.store = self.region.buf.view(dtype).view(num_slots, self.P, H)
        try:
            self.ring = RingWriter.create(dump_dir, f"ring-w{writer_id}.bin", ring_bytes)
            share_file(dump_dir, f"ring-w{writer_id}.bin", 0o640, share_gid)  # the group reads, only the writer writes
            share_file(dump_dir, offset_name(f"ring-w{writer_id}.bin"), 0o660, share_gid)  # a reader's read offset
        except RuntimeError as e:
            raise RuntimeError(f"sglang-hs: the output ring needs {ring_bytes / 1e9:.2f} GB in {dump_dir} ({e}); "
                               "lower --hs-ring-size") from None
        self.ring.gather_threads = gather_threads
        self.stats = {"records": 0, "rows": 0, "bytes": 0, "gather_s": 0.0, "dropped": 0, "markers": 0,
                      "reader_offsets_refused": 0,  # read offsets the ring refused (ring.py)
                      "moved_rows": 0,  # rows that followed SGLang's KV moves (move())
                      "move_wait_s": 0.0,  # the scheduler's wait in move() for the step's staged rows
                      "parts": 0,  # parts published of records in parts (--hs-record-part-size; publish_parts)
                      "part_wait_s": 0.0,  # the finish worker's wait for ring room for those parts (the reader)
                      # requests whose KV slots are held until their record is gathered, and their slots
                      # (patches/hold_finished_kv.py; the scheduler thread's)
                      "held_requests": 0, "held_tokens": 0}
        self.ring.stats = self.stats
        # The finish worker's (sglang_hs/server/store/finisher.py), here from the start: the status thread
        # reads this dict
        self.stats.update({k: 0 for k in FINISH_STATS}, **{k: 0.0 for k in FINISH_SECONDS})
        self.finisher = None  # the FinishWorker (finisher.py) the store's writes are ordered after, once it runs
        from sglang_hs.server.store.slot_ids import SlotIdCopy

        # CUDA: finished requests' slot ids to the host, off the schedule stream (its side stream taken now)
        self.slot_ids = SlotIdCopy(torch.device(device) if str(device).startswith("cuda") else None)
        manifest = {
            "format_version": FORMAT_VERSION,
            "sglang_hs_version": __version__,
            "sglang_version": SGLANG_VERSION,
            "model_path": model_path,
            "architecture": architecture,
            "dtype": str(dtype).replace("torch.", ""),
            **spec.describe(),
            "rows_per_token": self.P,
            "copy": copy,  # how rows reach the store: direct (the kernel writes it), staging or deferred
            "context_len": context_len,
            # --hs-record-part-size's row bytes (0: every record whole, at most half the ring): a record of more
            # leaves the ring in parts, so it may be as long as the context (reader.largest_record_bytes)
            "record_part_bytes": envs.SGLANG_HS_RECORD_PART_BYTES,
            "page_size": page_size,  # the KV pool's: the store holds a page of slots more than SGLang's pool
            "share_gid": share_gid,  # the group readers of other users belong to (--hs-share-group); None: private
            "served": served,  # what served the records: target, draft, speculative settings, chat template
            # ring_id: tells this ring's records from those of another server's ring (e.g. a harvester's
            # file names: sequence numbers start at 1 in every ring)
            "writers": [{"id": writer_id, "pid": os.getpid(), "ring": f"ring-w{writer_id}.bin",
                         "store": f"store-w{writer_id}.bin", "num_slots": num_slots, "ring_id": os.urandom(8).hex()}],
        }
        node = node or {"dp_ranks": [writer_id], "dp_size": 1, "nnodes": 1, "node_rank": 0}
        if writer_id not in node["dp_ranks"]:
            raise RuntimeError(f"sglang-hs: writer of DP rank {writer_id} on node {node['node_rank']}, whose writers "
                               f"serve DP ranks {node['dp_ranks']}")
        # The dump dir is this node's (shared memory does not cross machines): it lists the writers on this
        # node, one per data-parallel attention group served here (dp_ranks of dp_size over nnodes nodes)
        manifest.update(node)
        manifest["writers"][0]["dp_rank"] = writer_id
        if len(node["dp_ranks"]) > 1:  # readers wait for every writer of this node
            manifest.update(num_writers=len(node["dp_ranks"]), session=os.getsid(0))
        if str(device).startswith("cuda") and copy in ("direct", "deferred"):
            self._host_store()  # register now: never during CUDA-graph capture
        self.staging = None
        if copy in ("staging", "deferred"):
            from sglang_hs.server.store.staging import StagedCopy

            try:
                self.staging = StagedCopy(self.store, staging_rows, device, scatter_threads,
                                          host_store=self._host_store() if copy == "deferred" else None)
            except torch.OutOfMemoryError:
                raise RuntimeError(
                    f"sglang-hs: no room for the {staging_rows}-row staging buffers on {device}; lower "
                    "--hs-staging-rows or --mem-fraction-static, or use --hs-copy direct") from None
            self.stats.update(self.staging.stats)
            self.staging.stats = self.stats  # one dict: the status file, the log line and /metrics read it
        _write_manifest(dump_dir, manifest, share_gid)
        logger.info("sglang-hs store: %d slots x %d x %d %s = %.1f MB; output ring %.1f MB", num_slots, self.P, H,
                    dtype, self.region.nbytes / 1e6, ring_bytes / 1e6)
        if self.staging is not None and self.staging.deferred:
            logger.info("sglang-hs deferred copy: %d staging rows, %.1f MB of device memory; the copy stream writes "
                        "the store", staging_rows, self.staging.nbytes / 1e6)
        elif self.staging is not None:
            logger.info("sglang-hs staging: %d rows, %.1f MB (device and pinned host), scatter on up to %d threads",
                        staging_rows, self.staging.nbytes / 1e6, scatter_threads)

    def copy(self, aux: torch.Tensor, last: Optional[torch.Tensor], loc: torch.Tensor) -> None:
        T = aux.shape[0]
        if T == 0:
            return
        last = last if self.spec.last else None
        if loc.shape[0] != T:  # out_cache_loc_virtual excludes kernel padding rows: keep the real ones
            aux, last = aux[: loc.shape[0]], (last[: loc.shape[0]] if last is not None else None)
        if self.staging is not None:
            self.staging.write(aux, last, loc)
        elif aux.is_cuda:
            from sglang_hs.server.ops.copy_rows import copy_rows

            copy_rows(aux, last, loc, self._host_store())
        else:
            from sglang_hs._ext import ext

            if self.finisher is not None:  # the CPU engine's forward: wait for gathers still reading these slots
                waited = self.finisher.wait_before_write(loc)
                if waited:
                    self.stats["write_waits"] += 1
                    self.stats["write_wait_s"] += waited
            ext().copy_rows_cpu(aux, last, loc, self.store)

    def move(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Follow SGLang's move of KV from slots `src_loc` to `tgt_loc` (the pool's move_kv_cache: after a
        speculative verify, each request's accepted draft tokens' KV goes to the front of its draft window,
        spec_utils.move_accept_tokens_to_target_kvcache): their rows go with it, so req_to_token finds, at
        each accepted token's position, the row its verify forward computed. Runs on the scheduler thread
        after the step's forward. On CUDA with the direct copy the move is two device ops on the current
        stream, after the step's copy and, like it, after the gathers the step's slots waited for (the
        targets are slots of the step): no host synchronisation. Elsewhere it runs on the host once the
        step's rows are in the store; pairs with tgt == src (a chain's accepted prefix, SGLang's zero
        padding) move nothing there. `moved_rows` counts the pairs moved (on CUDA direct: every pair
        handed over, unchanged ones included: telling them apart would take a synchronisation)."""
        if tgt_loc.numel() == 0:
            return
        if tgt_loc.shape != src_loc.shape:
            raise RuntimeError(f"sglang-hs: a KV move of {tuple(src_loc.shape)} slots to {tuple(tgt_loc.shape)}")
        if tgt_loc.is_cuda and self.staging is None:
            rows = self._host_store().device_rows()
            tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
            # A slot outside the store cannot be refused without a synchronisation, and an out-of-range index
            # would stop the CUDA context: such a pair becomes the padding slot's move to itself (SGLang's own
            # move of the same ids, just before, would have failed first).
            bad = (tgt < 0) | (tgt >= rows.shape[0]) | (src < 0) | (src >= rows.shape[0])
            tgt, src = tgt.masked_fill(bad, 0), src.masked_fill(bad, 0)
            rows[tgt] = rows[src]  # sources gathered first
            self.stats["moved_rows"] += int(tgt_loc.numel())
            return
        if tgt_loc.is_cuda:  # staging/deferred: the step's rows reach the store off the compute stream
            torch.cuda.current_stream(tgt_loc.device).synchronize()
        if self.staging is not None:  # and its staged rows scattered (this thread's own key: move_wait_s)
            self.stats["move_wait_s"] += self.staging.drain()
        tgt, src = tgt_loc.reshape(-1).long().cpu(), src_loc.reshape(-1).long().cpu()
        keep = tgt != src
        if not bool(keep.any()):
            return
        tgt, src = tgt[keep], src[keep]
        if self.finisher is not None:  # the targets may be slots a pending gather still reads
            waited = self.finisher.wait_before_write(tgt)
            if waited:
                self.stats["write_waits"] += 1
                self.stats["write_wait_s"] += waited
        self.store[tgt] = self.store[src]  # gathered first: a target may be another pair's source
        self.stats["moved_rows"] += int(tgt.shape[0])

    def before_step(self) -> None:
        """Called before every ModelRunner.forward of the writer rank (by the hook, when staging)."""
        if self.staging is not None:
            self.staging.before_step()

    def after_step(self, rows: int, graph_replayed: bool) -> None:
        """Called after every ModelRunner.forward (by the hook, when staging): `rows` real rows, and
        whether a graph ran the model."""
        if self.staging is not None:
            self.staging.after_step(rows, graph_replayed)

    def copy_errors(self) -> Optional[torch.Tensor]:
        """The direct copy kernel's device error counter (SlotErrors.counts) of this store, if it has one."""
        hs = getattr(self, "_registered", None)
        return hs.errors.counts if self.staging is None and hs is not None else None

    def _host_store(self):
        hs = getattr(self, "_registered", None)
        if hs is None:
            from sglang_hs.server.ops.copy_rows import HostStore
            from sglang_hs.server.store import pinned

            hs = self._registered = HostStore(self.store, pinned.register(self.region.buf))
        return hs

    def close(self) -> None:
        """Stop the staging/deferred copy (once what was shipped is in the store) and undo the store's CUDA
        registration. Before the store is unmapped: CUDA does not notice an unmap, and a later mapping at the
        same address would fail to register ("already registered", as a GPU test saw). The server never
        calls it (the writer lives as long as its process)."""
        if self.staging is not None:
            self.staging.close()
        if getattr(self, "_registered", None) is not None:
            from sglang_hs.server.store import pinned

            pinned.unregister(self.region.buf)
            self._registered = None

    def finish(self, rid: str, token_ids, slots: torch.Tensor, prompt_len: Optional[int] = None,
               next_token: int = -1, meta: bytes = b"") -> None:
        """Publish the record of a finished request: `slots` are its KV slots in position order;
        `prompt_len`, `next_token` (the token after the last row) and `meta` (ring.encode_meta) go into the
        record (ring.py)."""
        t0 = time.perf_counter()
        T = len(token_ids)
        if slots.shape[0] != T:
            raise RuntimeError(f"sglang-hs: request {rid}: {slots.shape[0]} KV slots for {T} forwarded tokens")
        if slots.is_cuda:
            # Not .cpu() or a stream synchronize on the schedule stream: under the overlap scheduler it already
            # waits for the next step's whole forward (slot_ids.py). The request's forward, and with it the
            # direct copy into the store, completed before result processing (SGLang syncs copy_done, or reads
            # the step's next token ids on the same stream without the overlap scheduler).
            slots, errors, ready = self.slot_ids.to_host(slots, self.copy_errors())
            ready.synchronize()
            if errors is not None:  # a row whose KV slot lay outside the store: stop with one clear error
                from sglang_hs.server.ops.copy_rows import check_slot_errors

                check_slot_errors(*errors.tolist())
        if self.staging is not None:
            self.stats["store_wait_s"] += self.staging.drain()  # every computed row is in the store
        ids = torch.as_tensor(list(token_ids), dtype=torch.int32)
        self.publish_gathered(rid, ids, slots.cpu(), t0, prompt_len=prompt_len, next_token=next_token, meta=meta)

    def publish_gathered(self, rid: str, ids: torch.Tensor, slots: torch.Tensor, t0: Optional[float] = None, *,
                         prompt_len: Optional[int] = None, next_token: int = -1, meta: bytes = b"") -> None:
        """Gather store[slots] (host slot ids, every row already in the store) straight into the ring and
        publish the record. The synchronous finish runs it on the scheduler thread, the finish worker
        (sglang_hs/server/store/finisher.py) on its own; the gather (csrc/gather_rows_cpu.cpp) runs without the GIL."""
        t0 = time.perf_counter() if t0 is None else t0
        T = int(slots.shape[0])
        self.ring.publish(rid, ids, gather_from=self.store, slots=slots,  # gathered straight into the ring
                          prompt_len=prompt_len, next_token=next_token, meta=meta)
        self.stats["records"] += 1
        self._count_gathered(T, t0)

    def _count_gathered(self, T: int, t0: float) -> None:
        """T rows gathered into the ring since t0 (perf_counter): the rows, bytes and gather_s counters."""
        self.stats["rows"] += T
        self.stats["bytes"] += T * self.P * self.spec.hidden_size * self.store.element_size()
        self.stats["gather_s"] += time.perf_counter() - t0

    def publish_parts(self, rid: str, ids: torch.Tensor, slots: torch.Tensor, part_rows: int, *,
                      prompt_len: Optional[int] = None, next_token: int = -1, meta: bytes = b"",
                      give_up: Callable[[], bool] = lambda: False, wait_s: float = 1.0,
                      room: Optional[Callable[[int], bool]] = None, room_done: Callable[[], None] = lambda: None) -> int:
        """Publish a long record in parts of at most `part_rows` rows (ring format 9: the first part holds every
        token id, each part its rows [first_row, first_row + T) of the whole), each gathered into the ring as soon
        as the ring has room for it: only the finish worker calls this, for a request whose KV slots are held
        until it returns (patches/hold_finished_kv.py), so waiting here for a slow reader stalls no forward step.
        `give_up()` is asked every `wait_s` while the ring has no room (shutdown): True raises TimeoutError, the
        parts published so far stay in the ring (a reader drops a record whose parts stop). The first part goes into
        the room admission reserved for the request; each later one first takes room beyond every other request's
        reservation with `room(bytes)` (admission's part_room: twice the part, room to wrap), released by
        `room_done()` once published. Returns the parts."""
        from sglang_hs.server.store.ring import record_bytes

        N = int(slots.shape[0])
        assert part_rows >= 1 and ids.shape == (N,), (part_rows, ids.shape, N)
        no_ids = ids[:0]
        parts = 0
        for first in range(0, N, part_rows):
            w0 = time.perf_counter()
            part = slots[first : first + part_rows]
            taken = False
            if first and room is not None:
                need = 2 * record_bytes(int(part.shape[0]), self.P, self.spec.hidden_size, self.store.element_size(),
                                        len(rid.encode()), len(meta), n_ids=0)
                deadline = time.monotonic() + wait_s
                while not room(need):
                    if time.monotonic() > deadline:
                        if give_up():
                            raise TimeoutError(f"record of request {rid[:200]!r}: no ring room for its part at row "
                                               f"{first} of {N} (the reader is not reading)")
                        deadline = time.monotonic() + wait_s
                    time.sleep(0.001)
                taken = True
            t0 = time.perf_counter()  # gather_s: the gather, not the wait for the reader's room (part_wait_s)
            try:
                while True:
                    try:
                        self.ring.publish(rid, ids if first == 0 else no_ids, gather_from=self.store, slots=part,
                                          prompt_len=prompt_len, next_token=next_token, meta=meta, timeout=wait_s,
                                          first_row=first, total_rows=N)
                        break
                    except TimeoutError:
                        if give_up():
                            raise
            finally:
                if taken:
                    room_done()
            parts += 1
            self._count_gathered(int(part.shape[0]), t0)
            self.stats["part_wait_s"] += t0 - w0
            self.stats["parts"] += 1
        self.stats["records"] += 1
        return parts

    def publish_marker(self, rid: str, reason: str) -> None:
        """Publish the marker record of a request served without capture (ring.SKIP_REASONS): no rows."""
        from sglang_hs.server.store.ring import SKIP_REASONS

        code = {name: c for c, name in SKIP_REASONS.items()}[reason]
        self.ring.publish(rid, torch.empty(0, dtype=torch.int32),
                          torch.empty(0, self.P, self.spec.hidden_size, dtype=self.store.dtype), skipped=code)
        self.stats["markers"] += 1


def _remove_stale(dump_dir: str, name: str) -> None:
    """A store or ring left by a dead server is replaced (a live one holds the launcher's lock)."""
    path = os.path.join(dump_dir, name)
    if os.path.lexists(path):
        logger.warning("sglang-hs: replacing stale %s", path)
        os.unlink(path)
