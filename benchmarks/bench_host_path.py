"""The host side of the capture at DeepSeek-V3 sizes, no model: how long the scheduler thread spends in
capture per step, and how fast each piece after the store moves the bytes, against plain copies.

A store of DeepSeek-V3 rows (K = 3 aux layers + the final state, H = 7168, bf16: 57,344 bytes per KV slot;
`--slots` 32,768 = 1.9 GB by default) and an output ring (`--ring-mib`, 2 GiB) under a fresh folder in
/dev/shm, made by the real CaptureWriter; a HiddenStateReader in another process (as in production). Each
step finishes requests of 256 to 4096 tokens adding up to 8192 tokens (`--step-tokens`), their KV slots
drawn like a busy allocator's (a free list in no particular order after long traffic: a request takes its
head, a finished one goes back at its tail, so slots are scattered and reused). Per step, side by side:

  memcpy               libc memcpy of the step's bytes, DRAM to DRAM, into a preallocated buffer   ceiling
                       (the yardstick of every "of memcpy" ratio)
  torch_copy           torch copy_ of the same bytes (ratios to it are in the summary CSV too)     ceiling
  index_select         torch.index_select of the step's rows from the store into a preallocated
                       buffer: how the finish path gathered before its C++ op                     baseline
  capture [variant]    scheduler-thread time for the step's finishing requests: what SGLang's scheduler
                       waits for (`sync`: CaptureWriter.finish of each request; `async`: the hand-over
                       to the finish worker)
  scatter [N threads]  the staging strategy's host side (`--hs-copy staging`): the step's rows from a host
                       buffer into the store at their KV slots (csrc/copy_rows_cpu.cpp on N threads,
                       `--scatter-threads`, as the scatter thread runs it; on a GPU it must keep up
                       with the copy to host, ~50 GB/s)
  gather [variant]     store -> ring: until every record of the step is published (the C++ gather,
                       csrc/gather_rows_cpu.cpp: streaming stores, `--gather-threads` threads)
  reader [copy|view]   the consumer process's take() of the step's records, all published beforehand:
                       `copy` drains them out of the ring (HiddenStateReader's default, one copy each),
                       `view` hands out views of the ring (ack=True, zero_copy=True: no copy; the
                       records are acked once consumed), as the extraction CLI reads now
  specforge_tmpfs|disk, safetensors_tmpfs|disk [sink way]
                       the extraction CLI's sinks (sglang_hs/extract/sinks/: one file per record, temp
                       name, fsync, rename; its 4 writer threads) writing the records of the last take
                       (views of the ring) to a folder in /dev/shm and one on disk (`--disk-dir`); ways
                       (SINK_OPTS): `shared` the record's rows written as they lie, no CRC (the sinks'
                       default), `copies` contiguous copies first (safetensors: torch.cat, as before),
                       `copies+crc` SpecForge's sink as it was (copies, torch.save's CRC-32 of each entry)
  file_write_tmpfs|disk  the same bytes sequentially into one file, fsync'd: the filesystem's ceiling
  ring [copy|view]     the output ring alone: the writer publishes prepared rows while the consumer
                       takes them, until the consumer has the last: `copy` two copies (into the ring,
                       out of it), `view` one (into the ring; the consumer acks each view)
  e2e [variant/copy|view]  the whole host path at once: finish -> ring -> reader -> SpecForge files on
                       tmpfs (capture, reader and sink running concurrently), until the last file is
                       renamed; `copy`: the path as it was (drained copies, SpecForge's sink with copies
                       and CRC), `view`: as it is now (views of the ring acked once their file is in
                       place, the sink writing the rows as they lie)
  capture_concurrent [variant/...]   the scheduler-thread time of that e2e run (consumer busy meanwhile)
  e2e_sustained [async/view]   the same path fed `--sustained-steps` steps' requests back to back (the
                       next step's records are gathered while the last one's files are written, as in
                       a server that keeps finishing requests); GB/s of all their bytes until the last
                       file is in place. `e2e` of one step also counts filling and emptying the pipeline:
                       nothing to write until the first record is gathered, one file left to write
                       (one thread) after the last
  specforge_huge, file_write_huge, e2e_sustained_huge   with `--huge-dir`: the same on a tmpfs mounted
                       with huge=within_size, where a file's pages come 2 MB at a time (on /dev/shm's
                       4 KB pages the kernel's page allocation, not the copy, bounds a file write)

The gather, sink, plain-write and e2e rows also have the CPU time meanwhile (cpu_s, user + system, of the
process doing it; of both for e2e), cores_busy (cpu_s / seconds: at the machine's core count it is
CPU-bound) and core_s_per_GB (the host cores a rate takes, also on a host with more of them).

GB/s is the step's row bytes (tokens x 57,344) / seconds for every figure, so they compare directly.
Each process runs `--threads` torch threads (1: writer and consumer on a core each). `--steps` measured
steps after `--warmup`; medians with min and max. Variants of the scheduler side (`--variants`, both
by default, side by side in one run; each runs once per reader way, so capture and gather
have two samples a step): `sync` (CaptureWriter.finish on the scheduler thread, the path of
SGLANG_HS_SYNC_FINISH=1) and `async` (the finish worker, the default: the scheduler thread only hands
over). Each is a class in VARIANTS: step() returns once the scheduler's part is
done, wait_published() once the records are in the ring. Everything under /dev/shm and the disk folder is removed at the end, on Ctrl-C and SIGTERM too.

    python benchmarks/bench_host_path.py --out benchmarks/results    # bench_host_path.csv, _summary.csv, .png
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import hashlib
import multiprocessing as mp
import os
import queue
import random
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, write_csv, write_summary  # noqa: E402

K, H = 3, 7168
P = K + 1
ELEM = 2  # bf16
ROW_BYTES = P * H * ELEM  # 57,344
LAYERS = [2, 30, 58]  # any 3 of DeepSeek-V3's 61; only their count matters here
VOCAB = 129280
MACHINE = machine()
TARGETS = {"capture_ms": 1.0, "e2e_GBps": 2.5, "of_memcpy": 0.7}  # the tracking issue's (16, item 1)

# measure -> (kind, description); the order of the plot and the summary
MEASURES = {
    "memcpy": ("ceiling", "libc memcpy of the step's bytes"),
    "torch_copy": ("ceiling", "torch copy_ of the same bytes"),
    "index_select": ("baseline", "index_select of the step's rows (the gather before the C++ op)"),
    "scatter": ("path", "host buffer -> store by slot (staging scatter)"),
    "gather": ("path", "store -> ring (finish)"),
    "ring": ("path", "ring write+read (prepared rows)"),
    "reader": ("path", "reader take() in the consumer"),
    "e2e": ("path", "store -> ring -> reader -> SpecForge on tmpfs"),
    "e2e_sustained": ("path", "the same, steps back to back"),
    "e2e_sustained_huge": ("path", "the same, files on a huge-page tmpfs"),
    "specforge_tmpfs": ("file", "SpecForge .ckpt sink, tmpfs"),
    "safetensors_tmpfs": ("file", "safetensors sink, tmpfs"),
    "file_write_tmpfs": ("ceiling", "sequential write + fsync, tmpfs"),
    "specforge_huge": ("file", "SpecForge .ckpt sink, huge-page tmpfs"),
    "file_write_huge": ("ceiling", "sequential write + fsync, huge-page tmpfs"),
    "specforge_disk": ("file", "SpecForge .ckpt sink, disk"),
    "safetensors_disk": ("file", "safetensors sink, disk"),
    "file_write_disk": ("ceiling", "sequential write + fsync, disk"),
    "capture": ("scheduler", "scheduler-thread time in capture per step"),
    "capture_concurrent": ("scheduler", "the same, inside the e2e run"),
}
# the sinks' ways of writing a record (attributes of the classes in sglang_hs/extract/sinks/): "shared", today's
# default, writes the record's rows as they lie (SpecForge: two views of one storage, no CRC-32; safetensors:
# the rows tensor itself); "copies" the SpecForge layout of contiguous copies without CRC (safetensors: the
# torch.cat of before); "copies+crc" SpecForge's sink as it was before (contiguous copies, torch.save's CRC-32)
SINK_OPTS = {"-": {}, "shared": {}, "copies": {"share_rows": False}, "copies+crc": {"share_rows": False, "crc32": True}}
SINK_TARGETS = [("specforge_tmpfs", "copies+crc", "specforge", "tmpfs"), ("specforge_tmpfs", "copies", "specforge", "tmpfs"),
                ("specforge_tmpfs", "shared", "specforge", "tmpfs"), ("safetensors_tmpfs", "copies", "safetensors", "tmpfs"),
                ("safetensors_tmpfs", "shared", "safetensors", "tmpfs"), ("file_write_tmpfs", "-", None, "tmpfs"),
                ("specforge_disk", "shared", "specforge", "disk"), ("safetensors_disk", "shared", "safetensors", "disk"),
                ("file_write_disk", "-", None, "disk"),
                ("specforge_huge", "shared", "specforge", "huge"), ("file_write_huge", "-", None, "huge")]
# the reader's ways (HiddenStateReader): "copy" drains every record out of the ring (eager, one copy each);
# "view" (ack=True, zero_copy=True) hands out views of the ring, acked once consumed (the extraction CLI's)
READERS = ("copy", "view")
E2E_SINK = {"copy": "copies+crc", "view": "shared"}  # e2e [copy]: the path as it was; [view]: as it is now


# -- the scheduler side, one class per variant --------------------------------------------------------
class SyncFinish:
    """Today's path: CaptureWriter.finish() of each request finishing in the step, on the scheduler
    thread; it gathers the rows through the slots straight into the ring and publishes the record."""
    name = "sync"

    def __init__(self, writer) -> None:
        self.writer = writer

    def step(self, reqs) -> None:
        for rid, ids, slots in reqs:
            self.writer.finish(rid, ids, slots)

    def wait_published(self) -> None:
        pass  # published when finish() returned

    def close(self) -> None:
        pass


class AsyncFinish:
    """The finish worker (sglang_hs/server/store/finisher.py), what the server runs by default: per request the
    scheduler thread hands over the record (token ids, a host copy of the slot ids, the slots' last
    reader set); SGLang's free that follows is its own (writes wait instead: bench_full_pool.py); the gather and publish run on
    the worker thread, without the GIL in the copy. The scheduler-thread time counts both, and the
    worker's results taken at the next hand-over."""
    name = "async"

    def __init__(self, writer) -> None:
        from sglang_hs.server.store.finisher import FinishWorker

        self.worker = FinishWorker(writer)

    def step(self, reqs) -> None:
        for rid, ids, slots in reqs:
            self.worker.submit(rid, ids, slots)  # SGLang's free follows, untouched (finisher.py)

    def wait_published(self) -> None:
        self.worker.drain()

    def close(self) -> None:
        self.worker.close()


VARIANTS = {"sync": SyncFinish, "async": AsyncFinish}


def run_variant(variant, reqs):
    """(scheduler-thread seconds, seconds until every record is published)."""
    t0 = time.perf_counter()
    variant.step(reqs)
    t1 = time.perf_counter()
    variant.wait_published()
    return t1 - t0, time.perf_counter() - t0


# -- the workload -------------------------------------------------------------------------------------
class BusyAllocator:
    """SGLang's token-to-KV-slot allocator (page size 1) after long traffic: the free list is in no
    particular order, a request takes its head, a finished request's slots go back at its tail (in the
    order its tokens happened to free them). Slot 0 is the padding slot, never handed out."""

    def __init__(self, num_slots: int, g: torch.Generator) -> None:
        self.g = g
        self.free = torch.randperm(num_slots - 1, generator=g) + 1

    def alloc(self, n: int) -> torch.Tensor:
        if n > self.free.shape[0]:
            raise ValueError(f"{n} slots wanted, {self.free.shape[0]} free: raise --slots")
        s, self.free = self.free[:n], self.free[n:]
        return s

    def release(self, s: torch.Tensor) -> None:
        self.free = torch.cat([self.free, s[torch.randperm(s.shape[0], generator=self.g)]])


def request_lengths(total: int, lo: int, hi: int, rng: random.Random):
    """Lengths in [lo, hi] adding up to `total` (the last one takes what is left)."""
    out, rem = [], total
    while rem > 0:
        n = rem if rem <= hi else rng.randint(lo, min(hi, rem - lo))
        out.append(n)
        rem -= n
    return out


def make_step(alloc: BusyAllocator, lengths, rng: random.Random):
    """[(token ids as the scheduler has them: a list, KV slots in position order: int32 like req_to_token)]."""
    return [([rng.randrange(VOCAB) for _ in range(n)], alloc.alloc(n).to(torch.int32)) for n in lengths]


def named(reqs, prefix: str):
    return [(f"{prefix}-{i}", ids, slots) for i, (ids, slots) in enumerate(reqs)]


def fill(t: torch.Tensor, g: torch.Generator, block_rows: int = 256) -> None:
    """Random bf16 rows, a random block repeated (touching every page; randn of GBs takes long here)."""
    block = torch.randn(min(block_rows, t.shape[0]), *t.shape[1:], generator=g).to(t.dtype)
    for i in range(0, t.shape[0], block.shape[0]):
        n = min(block.shape[0], t.shape[0] - i)
        t[i:i + n].copy_(block[:n])


def cpu_seconds() -> float:
    """This process's CPU time so far, user + system, all its threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_fields(cpu: float, seconds: float, nbytes: int) -> dict:
    """CSV columns of a measure's CPU time: cores_busy (at the core count: CPU-bound) and core_s_per_GB."""
    return {"cpu_s": round(cpu, 3), "cores_busy": round(cpu / seconds, 2), "core_s_per_GB": round(cpu / (nbytes / 1e9), 3)}


def row_digest(row: torch.Tensor) -> str:
    return hashlib.sha1(row.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def fs_type(path: str, with_options: bool = False):
    """The type of the filesystem `path` is on ("?" when unknown); with_options: (type, mount options)."""
    path, best, typ, opts = os.path.realpath(path), "", "?", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mnt, t, o = line.split()[1:4]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, typ, opts = mnt, t, o
    except OSError:
        pass
    return (typ, opts) if with_options else typ


# -- the consumer process ----------------------------------------------------------------------------
def commands(cmd_q, parent: int):
    """A consumer process's commands from its parent, one at a time, until the parent is gone."""
    while True:
        try:
            yield cmd_q.get(timeout=1)
        except queue.Empty:
            if os.getppid() != parent:
                return


def _consumer(dump_dir: str, cmd_q, res_q, threads: int, sink_threads: int, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us, after its Ctrl-C
    from sglang_hs.extract.writer import WRITERS
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.reader import HiddenStateReader

    torch.set_num_threads(threads)
    pool = cf.ThreadPoolExecutor(sink_threads, thread_name_prefix="bench-sink")
    reader, held = None, []

    def use(mode):
        """The reader of `mode` (READERS), opened in place of the other one (one reader per dump dir)."""
        nonlocal reader
        release()
        if reader is None or reader.mode != mode:
            if reader is not None:
                reader.close()
            zero_copy = mode == "view"
            reader = HiddenStateReader(dump_dir, poll_interval=0.0005, recycle_memory=True, ack=zero_copy,
                                       zero_copy=zero_copy)  # recycle_memory: as the extraction CLI
            reader.mode = mode
        return reader

    def release():
        """Ack the records held from the last take (their ring bytes go back; no-op for copies)."""
        nonlocal held
        for rec in held:
            reader.ack(rec)
        held = []

    use("copy")
    res_q.put(("ready",))

    def take(rids):
        return [reader.take(rid, timeout=300) for rid in rids]

    def nbytes(recs):
        return sum(r.num_tokens * ROW_BYTES for r in recs)

    def write_sink(name, folder, recs, bounded, opts, ack=False):
        """The CLI's way: sink.write on its writer threads, at most 2 x WRITERS unwritten, each record acked
        once its file is in place when `ack` (zero-copy records); `opts`: the sink's attributes (SINK_OPTS).
        Returns file bytes."""
        sink, futs, unacked = SINKS[name](folder), [], []
        for attr, value in opts.items():
            setattr(sink, attr, value)

        def ack_written():
            for f, rec in [x for x in unacked if x[0].done()]:
                reader.ack(rec)
                unacked.remove((f, rec))

        for i, rec in enumerate(recs):
            if bounded:
                unwritten = [f for f in futs if not f.done()]
                if len(unwritten) >= 2 * WRITERS:
                    cf.wait(unwritten, return_when=cf.FIRST_COMPLETED)
            mask = torch.ones(rec.num_tokens, dtype=torch.long)
            futs.append(pool.submit(sink.write, i, rec.input_ids, mask, rec.aux_hidden_states, rec.last_hidden_state))
            if ack:
                unacked.append((futs[-1], rec))
                ack_written()
        nbytes = sum(f.result() for f in futs)
        if ack:
            ack_written()
        return nbytes

    def write_plain(folder, recs):
        """Each record's rows, as they lie in memory, one after another into one file; fsync."""
        path = os.path.join(folder, "plain.bin")
        with open(path, "wb", buffering=0) as f:
            for rec in recs:
                aux = rec.aux_hidden_states  # a view of the record's [T, P, H] rows, offset 0
                rows = aux.as_strided((rec.num_tokens * P * H,), (1,), aux.storage_offset())
                f.write(memoryview(rows.view(torch.uint8).numpy()))
            os.fsync(f.fileno())
        return os.path.getsize(path)

    for cmd in commands(cmd_q, parent):
        op = cmd[0]
        try:
            if op == "stop":
                return
            if op == "release":
                release()
                res_q.put(("release",))
            elif op == "take":  # the reader alone: every record is in the ring already
                use(cmd[2])
                t0 = time.perf_counter()
                held = take(cmd[1])
                dt = time.perf_counter() - t0
                first, last = held[0], held[-1]
                check = [(r.rid, r.num_tokens, row_digest(torch.cat([r.aux_hidden_states[0].reshape(-1),
                                                                      r.last_hidden_state[0]])))
                         for r in (first, last)]
                res_q.put(("take", dt, nbytes(held), check))
            elif op == "sinks":  # the records just taken, to each sink and the plain write in turn
                out = []
                for measure, variant, sink, folder in cmd[1]:
                    os.makedirs(folder, mode=0o700, exist_ok=True)
                    cpu0, t0 = cpu_seconds(), time.perf_counter()
                    fbytes = write_sink(sink, folder, held, False, SINK_OPTS[variant]) if sink else \
                        write_plain(folder, held)
                    out.append((measure, variant, time.perf_counter() - t0, nbytes(held), fbytes,
                                cpu_seconds() - cpu0))
                    shutil.rmtree(folder)
                release()
                res_q.put(("sinks", out))
            elif op in ("drain", "e2e"):  # concurrent with the writer: armed first, then the writer starts
                rids, folder, mode = cmd[1], cmd[2], cmd[3]
                use(mode)
                if folder:
                    os.makedirs(folder, mode=0o700, exist_ok=True)
                cpu0 = cpu_seconds()
                res_q.put(("armed",))
                if op == "drain":
                    recs, n = [], 0
                    for rid in rids:  # a copy is kept; a view is acked at once (the ring's own cost)
                        recs.append(reader.take(rid, timeout=300))
                        n += nbytes(recs[-1:])
                        reader.ack(recs[-1])
                    fbytes = 0
                    t_end = time.perf_counter()  # CLOCK_MONOTONIC: the same clock as the writer process's
                    del recs
                else:
                    n = 0

                    def records():  # as they arrive, each dropped once written, as the CLI does
                        nonlocal n
                        for rid in rids:
                            rec = reader.take(rid, timeout=300)
                            n += rec.num_tokens * ROW_BYTES
                            yield rec

                    fbytes = write_sink("specforge", folder, records(), True, SINK_OPTS[cmd[4]], mode == "view")
                    t_end = time.perf_counter()  # CLOCK_MONOTONIC: the same clock as the writer process's
                cpu = cpu_seconds() - cpu0
                if folder:
                    shutil.rmtree(folder)
                res_q.put((op, t_end, n, fbytes, cpu))
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception:  # noqa: BLE001 - reported to the parent, which stops the run
            res_q.put(("error", traceback.format_exc()))


class Consumer:
    def __init__(self, dump_dir: str, threads: int, sink_threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.cmd_q, self.res_q = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_consumer, args=(dump_dir, self.cmd_q, self.res_q, threads, sink_threads,
                                                        os.getpid()), daemon=True)
        self.proc.start()
        self.recv("ready", 120)

    def send(self, *cmd) -> None:
        self.cmd_q.put(cmd)

    def release(self) -> None:
        """The consumer acks the views it holds (its last take's), so the ring has room for the next step."""
        self.send("release")
        self.recv("release")

    def recv(self, op: str, timeout: float = 900):
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.res_q.get(timeout=1)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the consumer process died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {op!r} from the consumer after {timeout}s") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"consumer process:\n{msg[1]}")
            if msg[0] != op:
                raise RuntimeError(f"consumer sent {msg[0]!r}, expected {op!r}")
            return msg[1:]

    def close(self) -> None:
        if self.proc.is_alive():
            self.cmd_q.put(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


# -- the run ------------------------------------------------------------------------------------------
def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_room(args, step_bytes: int, ring_bytes: int) -> None:
    from sglang_hs.server.store.ring import record_bytes

    # the step's records at once (the reader takes them after the capture), plus the SKIP marker's worst
    # case where the ring wraps: a record of the longest request that does not fit before the end
    most = args.step_tokens // args.min_tokens + 1
    worst = record_bytes(args.step_tokens, P, H, ELEM, 0) + most * 512 + record_bytes(args.max_tokens, P, H, ELEM, 64)
    if worst > ring_bytes:
        raise SystemExit(f"--ring-mib {args.ring_mib}: a step's records need up to {worst / 2**20:.0f} MiB in the ring")
    if args.step_tokens * args.sustained_steps > args.slots - 1:
        raise SystemExit(f"--slots {args.slots}: fewer than the {args.step_tokens * args.sustained_steps} tokens of "
                         f"{args.sustained_steps} step(s) (--sustained-steps) + the padding slot")
    files = int(step_bytes * args.sustained_steps * 1.05) + (64 << 20)
    shm = args.slots * ROW_BYTES + ring_bytes + files
    if free_bytes(args.shm_dir) < shm:
        raise SystemExit(f"{args.shm_dir}: {free_bytes(args.shm_dir) / 1e9:.1f} GB free, this run needs "
                         f"{shm / 1e9:.1f} GB (store, ring, the sustained run's files): lower --slots, --ring-mib or "
                         "--sustained-steps")
    if args.huge_dir and free_bytes(args.huge_dir) < files:
        raise SystemExit(f"--huge-dir {args.huge_dir}: {free_bytes(args.huge_dir) / 1e9:.1f} GB free, "
                         f"{files / 1e9:.1f} GB needed")
    disk_files = int(step_bytes * 1.05) + (64 << 20)
    if free_bytes(args.disk_dir) < disk_files:
        raise SystemExit(f"--disk-dir {args.disk_dir}: {free_bytes(args.disk_dir) / 1e9:.1f} GB free, "
                         f"{disk_files / 1e9:.1f} GB needed")


def one_step(step, warm, args, writer, variants, consumer, alloc, rng, bufs, tmp_out, disk_out, huge_out):
    """Every measure once for one step of finishing requests; returns CSV rows."""
    lengths = request_lengths(args.step_tokens, args.min_tokens, args.max_tokens, rng)
    reqs = make_step(alloc, lengths, rng)
    tokens = sum(lengths)
    nbytes = tokens * ROW_BYTES
    src, dst = bufs
    rows = []

    def add(measure, seconds, variant="-", **extra):
        r = {"machine": MACHINE, "step": step, "warmup": int(warm), "variant": variant, "measure": measure,
             "kind": MEASURES[measure][0], "requests": len(reqs), "tokens": tokens, "bytes": nbytes,
             "seconds": round(seconds, 6), "ms": round(seconds * 1e3, 3), "GBps": round(nbytes / seconds / 1e9, 3)}
        r.update(extra)
        rows.append(r)

    flat_src, flat_dst = src.view(-1)[:nbytes], dst.view(-1)[:nbytes]
    t0 = time.perf_counter()
    ctypes.memmove(flat_dst.data_ptr(), flat_src.data_ptr(), nbytes)  # glibc's memcpy (no overlap here)
    add("memcpy", time.perf_counter() - t0)
    t0 = time.perf_counter()
    flat_dst.copy_(flat_src)
    add("torch_copy", time.perf_counter() - t0)

    all_slots = torch.cat([s for _, s in reqs]).long()
    out = dst.view(torch.bfloat16).view(-1, P, H)[:tokens]
    t0 = time.perf_counter()
    torch.index_select(writer.store, 0, all_slots, out=out)
    add("index_select", time.perf_counter() - t0)

    from sglang_hs._ext import ext

    # the host buffer of a staged step: the step's own rows (index_select just gathered them into `out`), so
    # the scatter rewrites the store with what it holds and the later measures' row checks keep their teeth
    staged = out.view(tokens, P * H)
    for n in args.scatter_threads:
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        ext().copy_rows_cpu(staged, None, all_slots, writer.store, n)
        dt = time.perf_counter() - t0
        add("scatter", dt, f"{n} thread{'s' * (n != 1)}", **cpu_fields(cpu_seconds() - cpu0, dt, nbytes))

    for v, mode in [(v, mode) for v in variants for mode in READERS]:  # capture + gather, then the reader alone
        consumer.release()  # the ring gets the last take's views back
        named_reqs = named(reqs, f"s{step}-{v.name}-{mode}")
        cpu0 = cpu_seconds()
        sched, pub = run_variant(v, named_reqs)
        cpu = cpu_seconds() - cpu0  # the scheduler side and the finish worker
        add("capture", sched, v.name)
        add("gather", pub, v.name, **cpu_fields(cpu, pub, nbytes))
        consumer.send("take", [r[0] for r in named_reqs], mode)
        dt, got, check = consumer.recv("take")
        assert got == nbytes, (got, nbytes)
        for (rid, T, digest), i in zip(check, (0, -1)):  # the rows arrived: the store's, in position order
            want = row_digest(writer.store[int(named_reqs[i][2][0])].reshape(-1))
            if (rid, T, digest) != (named_reqs[i][0], len(named_reqs[i][1]), want):
                raise RuntimeError(f"record {rid}: {T} rows, first row {digest}; expected {named_reqs[i][0]}, "
                                   f"{len(named_reqs[i][1])} rows, {want}")
        add("reader", dt, mode)

    # the records of the last take (views of the ring: they go from the ring straight into the files)
    folders = {"tmpfs": tmp_out, "disk": disk_out, "huge": huge_out}
    consumer.send("sinks", [(m, v, sink, os.path.join(folders[where], f"{m}-{v}")) for m, v, sink, where in SINK_TARGETS
                            if folders[where]])
    (results,) = consumer.recv("sinks")
    for measure, variant, dt, got, fbytes, cpu in results:
        assert got == nbytes
        add(measure, dt, variant, file_bytes=fbytes, **cpu_fields(cpu, dt, nbytes))

    # the ring alone: prepared rows published while the consumer takes them (copies them out, or acks views)
    prepared = src.view(torch.bfloat16).view(-1, P, H)
    for mode in READERS:
        named_reqs = named(reqs, f"s{step}-ring-{mode}")
        consumer.send("drain", [r[0] for r in named_reqs], None, mode)
        consumer.recv("armed")
        t0, o = time.perf_counter(), 0
        for rid, ids, _ in named_reqs:
            T = len(ids)
            writer.ring.publish(rid, torch.as_tensor(ids, dtype=torch.int32), rows=prepared[o:o + T])
            o += T
        t_write = time.perf_counter() - t0
        t_end, got, _, _ = consumer.recv("drain")
        assert got == nbytes
        add("ring", t_end - t0, mode, write_seconds=round(t_write, 6))

    def e2e(v, named_reqs, out, mode):
        """The whole path at once into `out`: (scheduler-thread seconds, seconds until the last file, file bytes,
        cpu_fields of both processes meanwhile)."""
        consumer.send("e2e", [r[0] for r in named_reqs], os.path.join(out, "e2e"), mode, E2E_SINK[mode])
        consumer.recv("armed")
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        sched, _ = run_variant(v, named_reqs)
        t_end, got, fbytes, consumer_cpu = consumer.recv("e2e")
        cpu = cpu_seconds() - cpu0 + consumer_cpu  # the writer process (scheduler side, finish worker) + consumer
        assert got == sum(len(ids) for _, ids, _ in named_reqs) * ROW_BYTES
        return sched, t_end - t0, fbytes, cpu_fields(cpu, t_end - t0, got)

    for v, mode in [(v, mode) for v in variants for mode in READERS]:  # the whole path at once
        sched, dt, fbytes, cpu = e2e(v, named(reqs, f"s{step}-{v.name}-{mode}-e2e"), tmp_out, mode)
        add("e2e", dt, f"{v.name}/{mode}", file_bytes=fbytes, **cpu)
        add("capture_concurrent", sched, f"{v.name}/{mode}")

    if args.sustained_steps > 1 and "async" in [v.name for v in variants]:
        v = next(v for v in variants if v.name == "async")
        more = [reqs] + [make_step(alloc, request_lengths(args.step_tokens, args.min_tokens, args.max_tokens, rng),
                                   rng) for _ in range(args.sustained_steps - 1)]
        for measure, out in (("e2e_sustained", tmp_out), ("e2e_sustained_huge", huge_out)):
            if not out:
                continue
            named_reqs = named([r for step_reqs in more for r in step_reqs], f"s{step}-{measure}")
            total = sum(len(ids) for _, ids, _ in named_reqs) * ROW_BYTES
            _, dt, fbytes, cpu = e2e(v, named_reqs, out, "view")
            add(measure, dt, "async/view", file_bytes=fbytes, **cpu)
            rows[-1].update(tokens=total // ROW_BYTES, bytes=total, GBps=round(total / dt / 1e9, 3),
                            requests=len(named_reqs))
        for step_reqs in more[1:]:
            for _, slots in step_reqs:
                alloc.release(slots.long())

    for _, slots in reqs:
        alloc.release(slots.long())
    return rows


def summarise(rows):
    measured = [r for r in rows if not r["warmup"]]
    keys = list(dict.fromkeys((r["measure"], r["variant"]) for r in measured))
    keys.sort(key=lambda k: list(MEASURES).index(k[0]))
    memcpy = statistics.median(r["GBps"] for r in measured if r["measure"] == "memcpy")
    torch_copy = statistics.median(r["GBps"] for r in measured if r["measure"] == "torch_copy")
    out = []
    for m, v in keys:
        rs = [r for r in measured if (r["measure"], r["variant"]) == (m, v)]
        g = [r["GBps"] for r in rs]
        ms = [r["ms"] for r in rs]
        s = {"measure": m, "variant": v, "kind": MEASURES[m][0], "what": MEASURES[m][1], "steps": len(rs),
             "tokens_per_step": rs[0]["tokens"], "GBps_median": round(statistics.median(g), 3),
             "GBps_min": min(g), "GBps_max": max(g), "ms_median": round(statistics.median(ms), 3),
             "ms_min": min(ms), "ms_max": max(ms),
             "of_memcpy": round(statistics.median(g) / memcpy, 3),
             "of_torch_copy": round(statistics.median(g) / torch_copy, 3)}
        if "core_s_per_GB" in rs[0]:  # gather, sinks, e2e: their CPU time, the host cores a rate takes
            s["cores_busy_median"] = round(statistics.median(r["cores_busy"] for r in rs), 2)
            s["core_s_per_GB_median"] = round(statistics.median(r["core_s_per_GB"] for r in rs), 3)
        out.append(s)
    return out


def targets(summary):
    """The tracking issue's targets against this run: (line, met) pairs."""
    get = {(s["measure"], s["variant"]): s for s in summary}
    lines = []
    for (m, v), s in get.items():
        if m == "capture":
            lines.append((f"scheduler-thread time in capture per {s['tokens_per_step']}-token step [{v}]: "
                          f"{s['ms_median']:.2f} ms (min {s['ms_min']:.2f}, max {s['ms_max']:.2f}); target "
                          f"< {TARGETS['capture_ms']:g} ms", s["ms_median"] < TARGETS["capture_ms"]))
        if m.startswith("e2e"):
            lines.append((f"host path end to end (store -> ring -> reader -> SpecForge on tmpfs)"
                          f"{', steps back to back' if m.startswith('e2e_sustained') else ''}"
                          f"{', files on a huge-page tmpfs' if m.endswith('_huge') else ''} [{v}]: "
                          f"{s['GBps_median']:.2f} GB/s; target >= {TARGETS['e2e_GBps']:g}",
                          s["GBps_median"] >= TARGETS["e2e_GBps"]))
        if m in ("gather", "ring"):
            lines.append((f"{m}{f' [{v}]' if v != '-' else ''}: {s['GBps_median']:.2f} GB/s = {s['of_memcpy']:.2f} "
                          f"of memcpy ({s['of_torch_copy']:.2f} of torch copy_); target >= {TARGETS['of_memcpy']:g}",
                          s["of_memcpy"] >= TARGETS["of_memcpy"]))
    return lines


def plot(summary, path: str, title: str) -> None:
    plt = _pyplot()
    if plt is None:
        return
    from matplotlib.patches import Patch

    colors = {"ceiling": "#999", "baseline": "#db8", "path": "#2a7", "file": "#27a", "scheduler": "#c52"}
    # a zero-copy take() moves no bytes (it parses a header): no GB/s bar for it
    bw = [s for s in summary if s["kind"] != "scheduler" and not (s["measure"] == "reader" and s["variant"] == "view")]
    sched = [s for s in summary if s["kind"] == "scheduler"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 6.5), gridspec_kw={"width_ratios": [3, 1.3]})
    labels = [s["what"] + (f" [{s['variant']}]" if s["variant"] != "-" else "") for s in bw]
    y = list(range(len(bw)))[::-1]
    med = [s["GBps_median"] for s in bw]
    err = [[m - s["GBps_min"] for m, s in zip(med, bw)], [s["GBps_max"] - m for m, s in zip(med, bw)]]
    ax.barh(y, med, xerr=err, color=[colors[s["kind"]] for s in bw], capsize=3)
    for yi, m, s in zip(y, med, bw):
        cores = f", {s['core_s_per_GB_median']:.2f} core-s/GB" if "core_s_per_GB_median" in s else ""
        ax.text(s["GBps_max"], yi, f"  {m:.2f} ({s['of_memcpy']:.2f}){cores}", va="center", fontsize=7)
    memcpy = next(s["GBps_median"] for s in bw if s["measure"] == "memcpy")
    ax.axvline(TARGETS["of_memcpy"] * memcpy, color="#2a7", ls=":", lw=1)
    ax.axvline(TARGETS["e2e_GBps"], color="k", ls="--", lw=1)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("GB/s of row bytes (median, whiskers min-max; in brackets: of memcpy; CPU seconds per GB)")
    ax.set_xlim(0, max(max(s["GBps_max"] for s in bw), TARGETS["e2e_GBps"]) * 1.45)
    handles = [Patch(color=c, label=k) for k, c in colors.items() if k != "scheduler"]
    handles += [plt.Line2D([], [], color="#2a7", ls=":", label=f"{TARGETS['of_memcpy']:g} x memcpy (gather, ring target)"),
                plt.Line2D([], [], color="k", ls="--", label=f"{TARGETS['e2e_GBps']:g} GB/s (end-to-end target)")]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.1), ncol=4)
    x = list(range(len(sched)))
    ms = [s["ms_median"] for s in sched]
    ax2.bar(x, ms, yerr=[[m - s["ms_min"] for m, s in zip(ms, sched)], [s["ms_max"] - m for m, s in zip(ms, sched)]],
            color=colors["scheduler"], capsize=3)
    for xi, m in zip(x, ms):
        ax2.text(xi, m, f"{m:.1f}  ", ha="right", va="bottom", fontsize=8)
    ax2.set_yscale("log")
    ax2.axhline(TARGETS["capture_ms"], color="k", ls="--", lw=1)
    ax2.text(-0.4, TARGETS["capture_ms"], f"target {TARGETS['capture_ms']:g} ms", va="bottom", fontsize=7)
    ax2.set_ylim(min([s["ms_min"] for s in sched] + [TARGETS["capture_ms"]]) / 2,
                 max([s["ms_max"] for s in sched] + [TARGETS["capture_ms"]]) * 2)
    ax2.set_xticks(x)
    ax2.set_xticklabels([f"{s['measure'].replace('_', ' ')} [{s['variant']}]" for s in sched], fontsize=7,
                        rotation=45, ha="right")
    ax2.set_ylabel(f"ms per {sched[0]['tokens_per_step'] if sched else ''}-token step, scheduler thread (log)")
    save_figure(plt, fig, path, title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--slots", type=int, default=32768, help="KV slots of the store (57,344 bytes each)")
    ap.add_argument("--ring-mib", type=int, default=2048, help="output ring size; must hold one step's records")
    ap.add_argument("--step-tokens", type=int, default=8192, help="tokens of the requests finishing per step")
    ap.add_argument("--min-tokens", type=int, default=256, help="shortest finishing request")
    ap.add_argument("--max-tokens", type=int, default=4096, help="longest finishing request")
    ap.add_argument("--steps", type=int, default=5, help="measured steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the summary")
    ap.add_argument("--variants", default="sync,async", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each process")
    ap.add_argument("--gather-threads", type=int, default=None,
                    help="threads of the C++ gather into the ring (default: the server's, --hs-gather-threads)")
    ap.add_argument("--scatter-threads", default="1,2",
                    help="comma-separated thread counts of the staging scatter measure (default 1,2)")
    ap.add_argument("--sustained-steps", type=int, default=3,
                    help="steps fed back to back in e2e_sustained (1: leave it out)")
    ap.add_argument("--sink-threads", type=int, default=0, help="file writer threads (default: the CLI's)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the store, the ring and the tmpfs files")
    ap.add_argument("--disk-dir", default=None, help="folder on disk for the disk files (default: --out)")
    ap.add_argument("--huge-dir", default=None,
                    help="a folder on a tmpfs mounted with huge=within_size (or always): the SpecForge sink, a plain "
                         "write and e2e_sustained also write their files there (root makes one with: mount -t tmpfs "
                         "-o huge=within_size,size=8G tmpfs DIR)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from sglang_hs.extract.writer import WRITERS

    variants_wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants_wanted if v not in VARIANTS]
    if unknown or not variants_wanted:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if not 0 < args.min_tokens <= args.max_tokens or args.step_tokens < args.min_tokens or args.steps < 1:
        ap.error("need 0 < --min-tokens <= --max-tokens, --step-tokens >= --min-tokens, --steps >= 1")
    args.sink_threads = args.sink_threads or WRITERS
    from sglang_hs import envs

    args.gather_threads = args.gather_threads or envs.DEFAULT_GATHER_THREADS
    try:
        args.scatter_threads = [int(n) for n in args.scatter_threads.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--scatter-threads: comma-separated thread counts, got {args.scatter_threads!r}")
    if min(args.scatter_threads, default=0) < 1:
        ap.error(f"--scatter-threads: thread counts >= 1, got {args.scatter_threads}")
    if args.gather_threads < 1 or args.sustained_steps < 1:
        ap.error("--gather-threads and --sustained-steps must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    args.disk_dir = os.path.abspath(args.disk_dir or args.out)
    ring_bytes = args.ring_mib << 20
    step_bytes = args.step_tokens * ROW_BYTES
    check_room(args, step_bytes, ring_bytes)

    def _on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _on_term)
    threads = torch.get_num_threads()
    base = disk_out = huge_out = consumer = None
    variants, rows = [], []
    where = f"disk: {fs_type(args.disk_dir)} {args.disk_dir}; tmpfs: {fs_type(args.shm_dir)} {args.shm_dir}"
    if args.huge_dir:
        typ, opts = fs_type(args.huge_dir, with_options=True)
        huge = [o for o in opts.split(",") if o.startswith("huge=")]
        if typ != "tmpfs" or not huge or huge[0] in ("huge=never", "huge=deny"):
            ap.error(f"--huge-dir {args.huge_dir}: not on a tmpfs mounted with huge=within_size|always|advise "
                     f"({typ}, {opts or 'no options'})")
        where += f"; huge-page tmpfs ({huge[0]}): {args.huge_dir}"
    csv_path = os.path.join(args.out, "bench_host_path.csv")
    try:
        base = tempfile.mkdtemp(prefix="bench-host-path-", dir=args.shm_dir)
        disk_out = tempfile.mkdtemp(prefix=".bench-host-path-", dir=args.disk_dir)
        if args.huge_dir:
            huge_out = tempfile.mkdtemp(prefix="bench-host-path-", dir=args.huge_dir)
        from sglang_hs.server.capture_spec import CaptureSpec
        from sglang_hs.server.store.writer import CaptureWriter

        torch.set_num_threads(args.threads)
        dump = os.path.join(base, "hs")
        os.makedirs(dump, mode=0o700)
        g = torch.Generator().manual_seed(args.seed)
        rng = random.Random(args.seed)
        print(f"store {args.slots} slots x {ROW_BYTES} B = {args.slots * ROW_BYTES / 1e9:.2f} GB, ring "
              f"{ring_bytes / 2**30:.2f} GiB in {base}; steps of {args.step_tokens} tokens "
              f"({step_bytes / 1e9:.2f} GB) in requests of {args.min_tokens}-{args.max_tokens}; {where}", flush=True)
        writer = CaptureWriter(dump, CaptureSpec.resolve(LAYERS, True, 61, H), args.slots, torch.bfloat16, ring_bytes)
        writer.ring.gather_threads = args.gather_threads
        t0 = time.perf_counter()
        fill(writer.store, g)
        src = torch.empty(step_bytes, dtype=torch.uint8)
        fill(src.view(torch.bfloat16).view(-1, P, H), g)
        dst = torch.ones(step_bytes, dtype=torch.uint8)  # memcpy's and index_select's destination, touched
        print(f"filled in {time.perf_counter() - t0:.1f}s; starting the consumer process", flush=True)
        consumer = Consumer(dump, args.threads, args.sink_threads)
        variants = [VARIANTS[v](writer) for v in variants_wanted]
        alloc = BusyAllocator(args.slots, g)
        for _ in range(3):  # traffic before the run: the free list is already in no particular order
            alloc.release(alloc.alloc(min(args.step_tokens, args.slots - 1)))
        for i in range(args.warmup + args.steps):
            warm = i < args.warmup
            step_rows = one_step(i, warm, args, writer, variants, consumer, alloc, rng, (src, dst), base, disk_out,
                                 huge_out)
            rows += step_rows
            write_csv(csv_path, rows)
            by = {(r["measure"], r["variant"]): r for r in step_rows}
            caps = ", ".join(f"{v.name} {by[('capture', v.name)]['ms']:.2f} ms" for v in variants)
            gbs = "  ".join(f"{m}{'' if v == '-' else '[' + v + ']'} {r['GBps']:.2f}" for (m, v), r in by.items()
                            if MEASURES[m][0] != "scheduler")
            print(f"{'warm-up' if warm else 'step'} {i - args.warmup + 1 if not warm else i + 1}: "
                  f"{step_rows[0]['requests']} requests, capture {caps} | GB/s {gbs}", flush=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        for v in variants:
            v.close()
        if consumer is not None:
            consumer.close()
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, old_term)
        for folder in (base, disk_out, huge_out):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    summary = summarise(rows)

    def summary_line(s):
        v = "" if s["variant"] == "-" else f" [{s['variant']}]"
        if s["kind"] == "scheduler":
            return f"  {s['measure'] + v:>24}: {s['ms_median']:8.2f} ms   ({s['ms_min']:.2f}-{s['ms_max']:.2f})"
        cpu = f"; {s['cores_busy_median']:.2f} cores busy, {s['core_s_per_GB_median']:.3f} core-s/GB" \
            if "cores_busy_median" in s else ""
        return (f"  {s['measure'] + v:>24}: {s['GBps_median']:8.2f} GB/s ({s['GBps_min']:.2f}-{s['GBps_max']:.2f}) "
                f"= {s['of_memcpy']:.2f} of memcpy{cpu}")

    write_summary(args.out, "bench_host_path", summary, f"\nmedian of {args.steps} steps (min-max), {machine()}; {where}",
                  summary_line)
    print("targets (issue 16):")
    for line, met in targets(summary):
        print(f"  [{'met' if met else 'NOT met'}] {line}")
    plot(summary, os.path.join(args.out, "bench_host_path.png"),
         f"host path at DeepSeek-V3 row size (57,344 B/token), {args.step_tokens}-token steps of "
         f"{args.min_tokens}-{args.max_tokens}-token requests, store {args.slots} slots; {args.threads} torch "
         f"thread(s)/process, {args.gather_threads} gather thread(s), {args.sink_threads} sink threads\n{machine()}; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
