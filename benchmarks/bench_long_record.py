"""One long record at DeepSeek-V3 row size through today's whole-record host path (issue 47, item 4): how fast
it moves and how much memory it holds while it does, the baseline for records that leave the ring in parts.

A store of DeepSeek-V3 rows (K = 3 aux layers + the final state, H = 7168, bf16: 57,344 bytes per KV slot;
`--slots`, 8,192 = 0.47 GB by default, far beyond the last-level cache) and an output ring of exactly one
record (so every repetition's record lands at offset 0; admission would reserve twice that, which the
machine's memory does not allow at 128K) under a fresh folder in /dev/shm, made by the real CaptureWriter. A
record of `--tokens` tokens (comma-separated, default 65,536 and 131,072) is handed to the finish worker
(sglang_hs/server/store/finisher.py) with KV slots scattered over the store (slot i = a permutation of the
store's slots, repeated: a 128K record reads each slot 16 times, every read from DRAM); a consumer process
(spawned, as a trainer or the extraction CLI runs) takes it with HiddenStateReader and writes it with the
extraction CLI's SpecForge sink (temp name, fsync, rename) into `--disk-dir` (disk by default: /dev/shm has
no room for the file beside the ring), then acks it. Reader ways (`--readers`):

  view     ack=True, zero_copy=True: the record's tensors are views of the ring, acked once the file is in
           place (the extraction CLI's way before --part-mb)
  chunked  the same, with part_bytes (`--part-mb`, the CLI's default 256 MiB): the sink writes the record a chunk at
           a time from HiddenStateReader.chunks, which unmaps each chunk's ring pages behind it (the CLI now)
  spill    the live dataset's way for a long record now (live.spill_sample): a copying reader with part_bytes hands
           it as views, its sample's two state tensors are written a chunk at a time into (unlinked) files in
           --disk-dir and mapped; then acked
  copy     the default reader: the record copied out of the ring, then written (the live dataset's way before:
           one copy per record, handed to the trainer)
  parts    records in parts (--hs-record-part-size = --part-mb): the finish worker publishes the record a part at a
           time (its KV slots held, as the server does) into a ring of twice a first part plus two parts, far
           smaller than the record, while the chunked reader writes each part's rows as it arrives and gives its
           ring room back (the server with --hs-record-part-size and the CLI now)

Per repetition: gather (submit -> the record is published in the ring), write (the consumer's take ->
file renamed) and e2e (submit -> file renamed) seconds and GB/s of the record's row bytes; and the peak
resident memory of each process, sampled every 20 ms from /proc/PID/status as anonymous memory (RssAnon:
copies, buffers) and shared memory (RssShmem: pages of the store and ring mapped and touched), plus the
page cache of the output file is the kernel's (not counted). Medians (min-max) of `--reps`.

    python benchmarks/bench_long_record.py --out benchmarks/results   # bench_long_record.csv, _summary.csv, .png
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_host_path  # noqa: E402
from benchmarks.bench_host_path import ELEM, H, LAYERS, P, ROW_BYTES, fill  # noqa: E402
from benchmarks.common import _pyplot, machine, save_figure, write_csv, write_summary  # noqa: E402

READERS = ("view", "chunked", "spill", "copy", "parts")
GB = 1e9


def rss(pid: int) -> dict:
    """RssAnon and RssShmem of process `pid`, bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


class PeakRss:
    """Peak RssAnon, RssShmem and their sum per process, sampled every `every` seconds in a thread."""

    def __init__(self, pids: dict, every: float = 0.02) -> None:
        self.pids, self.every = pids, every
        self.peak = {name: {"anon": 0, "shmem": 0, "total": 0} for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                try:
                    r = rss(pid)
                except OSError:
                    continue
                p = self.peak[name]
                p["anon"] = max(p["anon"], r.get("RssAnon", 0))
                p["shmem"] = max(p["shmem"], r.get("RssShmem", 0))
                p["total"] = max(p["total"], r.get("RssAnon", 0) + r.get("RssShmem", 0))
            self._stop.wait(self.every)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peak


def _consumer(dump_dir: str, cmd_q, res_q, parent: int, part_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us, after its Ctrl-C
    from sglang_hs.extract.sinks import SINKS
    from sglang_hs.extract.sinks.base import TrainingSample
    from sglang_hs.extract.writer import sink_chunks
    from sglang_hs.live import spill_sample
    from sglang_hs.reader import HiddenStateReader

    torch.set_num_threads(1)
    readers = {}
    res_q.put(("ready", os.getpid()))
    for cmd in bench_host_path.commands(cmd_q, parent):
        if cmd[0] == "stop":
            for r in readers.values():
                r.close()
            return
        try:
            _, rid, mode, folder = cmd
            if mode not in readers:  # one reader per dump dir at a time
                for r in readers.values():
                    r.close()
                readers.clear()
                views = mode in ("view", "chunked", "parts")
                readers[mode] = HiddenStateReader(dump_dir, poll_interval=0.0005, recycle_memory=True,
                                                  ack=mode != "copy", zero_copy=views,
                                                  part_bytes=part_bytes if mode in ("chunked", "spill", "parts")
                                                  else None)
            reader = readers[mode]
            os.makedirs(folder, mode=0o700, exist_ok=True)
            res_q.put(("armed",))
            rec = reader.take(rid, timeout=600)
            t_taken = time.perf_counter()
            ones = torch.ones(rec.num_tokens, dtype=torch.long)
            if mode == "spill":
                out = spill_sample(reader, rec, ones, "specforge", torch.bfloat16, folder)
                n = sum(t.numel() * t.element_size() for t in out.values())
                del out
            else:
                sink = SINKS["specforge"](folder)
                n = sink.write(TrainingSample(0, rec.input_ids, ones, rec.aux_hidden_states, rec.last_hidden_state),
                               chunks=sink_chunks(reader, sink, rec) if mode in ("chunked", "parts") else None)
            t_written = time.perf_counter()  # CLOCK_MONOTONIC, as the parent's
            tokens = rec.num_tokens
            if mode != "copy":
                reader.ack(rec)
            del rec
            shutil.rmtree(folder)
            res_q.put(("done", t_taken, t_written, tokens, n))
        except Exception:  # noqa: BLE001 - reported to the parent, which stops the run
            res_q.put(("error", traceback.format_exc()))


class Consumer(bench_host_path.Consumer):
    """bench_host_path's consumer process (its recv and close), running this benchmark's _consumer."""

    def __init__(self, dump_dir: str, part_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.cmd_q, self.res_q = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_consumer, args=(dump_dir, self.cmd_q, self.res_q, os.getpid(), part_bytes),
                                daemon=True)
        self.proc.start()
        (self.pid,) = self.recv("ready", 120)
        self.part_bytes = part_bytes


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))


def one_record(writer, worker, consumer, T: int, rep: int, mode: str, slots_perm: torch.Tensor, disk: str) -> dict:
    rid = f"long-{T}-{mode}-{rep}"
    ids = torch.randint(0, 129280, (T,), dtype=torch.int32)
    slots = slots_perm.repeat((T + len(slots_perm) - 1) // len(slots_perm))[:T].clone()
    folder = os.path.join(disk, rid)
    consumer.cmd_q.put(("take", rid, mode, folder))
    consumer.recv("armed")
    peaks = PeakRss({"writer": os.getpid(), "consumer": consumer.pid})
    t0 = time.perf_counter()
    worker.submit(rid, ids, slots, held=mode == "parts")  # in parts: published as the consumer makes ring room
    if mode == "parts":  # its last parts wait for the consumer: drained once it is done (or its error is seen)
        worker.flush()
        t_taken, t_written, tokens, file_bytes = consumer.recv("done", 1200)
        worker.drain()
        t_gathered = time.perf_counter()
    else:
        worker.drain()
        t_gathered = time.perf_counter()
        t_taken, t_written, tokens, file_bytes = consumer.recv("done", 1200)
    peak = peaks.stop()
    assert tokens == T
    nbytes = T * ROW_BYTES
    row = {"tokens": T, "reader": mode, "rep": rep, "record_GB": nbytes / GB, "file_GB": file_bytes / GB,
           "part_GB": consumer.part_bytes / GB if mode in ("chunked", "spill", "parts") else 0.0,
           "ring_GB": writer.ring.capacity / GB,
           "gather_s": t_gathered - t0, "write_s": t_written - t_taken, "e2e_s": t_written - t0,
           "gather_GBps": nbytes / GB / (t_gathered - t0), "write_GBps": nbytes / GB / (t_written - t_taken),
           "e2e_GBps": nbytes / GB / (t_written - t0)}
    for name, p in peak.items():
        for key, v in p.items():
            row[f"{name}_{key}_GB"] = v / GB
    return row


def summarise(rows):
    out = []
    for key in dict.fromkeys((r["tokens"], r["reader"]) for r in rows):
        rs = [r for r in rows if (r["tokens"], r["reader"]) == key]
        s = {"tokens": key[0], "reader": key[1], "reps": len(rs), "record_GB": rs[0]["record_GB"],
             "part_GB": rs[0].get("part_GB", 0.0), "ring_GB": rs[0].get("ring_GB", float("nan"))}
        for m in ("gather_GBps", "write_GBps", "e2e_GBps", "consumer_anon_GB", "consumer_shmem_GB",
                  "consumer_total_GB", "writer_anon_GB"):
            vals = [r[m] for r in rs]
            s[f"{m}_median"], s[f"{m}_min"], s[f"{m}_max"] = statistics.median(vals), min(vals), max(vals)
        out.append(s)
    for s in out:  # against today's view reader of the same length, in the same run
        base = next((b for b in out if b["tokens"] == s["tokens"] and b["reader"] == "view"), None)
        s["write_vs_view"] = s["write_GBps_median"] / base["write_GBps_median"] if base else float("nan")
        s["e2e_vs_view"] = s["e2e_GBps_median"] / base["e2e_GBps_median"] if base else float("nan")
        s["peak_vs_view"] = s["consumer_total_GB_median"] / base["consumer_total_GB_median"] if base else float("nan")
        s["peak_vs_part"] = s["consumer_total_GB_median"] / s["part_GB"] if s["part_GB"] else float("nan")
    return out


def plot(summary, path: str, title: str) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{s['tokens'] // 1024}K {s['reader']}" for s in summary]
    x = range(len(summary))
    for i, (m, name) in enumerate((("gather_GBps", "gather"), ("write_GBps", "take + write"), ("e2e_GBps", "e2e"))):
        a.bar([j + 0.27 * (i - 1) for j in x], [s[f"{m}_median"] for s in summary], 0.27, label=name)
    a.set_xticks(list(x), labels)
    a.set_ylabel("GB/s (record row bytes)")
    a.legend(fontsize=8)
    b.bar([j - 0.2 for j in x], [s["consumer_anon_GB_median"] for s in summary], 0.4, label="consumer anon")
    b.bar([j - 0.2 for j in x], [s["consumer_shmem_GB_median"] for s in summary], 0.4,
          bottom=[s["consumer_anon_GB_median"] for s in summary], label="consumer shmem (ring pages)")
    b.bar([j + 0.2 for j in x], [s["record_GB"] for s in summary], 0.4, label="the record's bytes", color="#888")
    b.set_xticks(list(x), labels)
    b.set_ylabel("peak resident GB")
    b.legend(fontsize=8)
    save_figure(plt, fig, path, title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", default="65536,131072", help="comma-separated record lengths")
    ap.add_argument("--readers", default="view,chunked,spill,copy,parts", help=f"comma-separated, of: {', '.join(READERS)}")
    ap.add_argument("--part-mb", type=float, default=256, help="chunked, spill and parts: the chunk bound, MiB (the "
                    "CLI's --part-mb; parts: also the server's --hs-record-part-size)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each length and reader")
    ap.add_argument("--slots", type=int, default=8192, help="KV slots of the store (57,344 bytes each)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the store and the ring")
    ap.add_argument("--disk-dir", default=None, help="folder for the files (default: a temporary one under /tmp)")
    ap.add_argument("--max-gb", type=float, default=8.5,
                    help="skip a length and reader whose store + ring + copy would take more than this (GB), or more "
                         "than the memory available now")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tokens: comma-separated token counts, got {args.tokens!r}")
    modes = [m.strip() for m in args.readers.split(",") if m.strip()]
    if not lengths or min(lengths) < 1:
        ap.error(f"--tokens: comma-separated token counts >= 1, got {args.tokens!r}")
    if not modes or set(modes) - set(READERS):
        ap.error(f"--readers: comma-separated, of {', '.join(READERS)}; got {args.readers!r}")
    if not 0 < args.part_mb < 1 << 20:
        ap.error(f"--part-mb: a size in MiB > 0, got {args.part_mb}")
    for flag, value in (("--reps", args.reps), ("--slots", args.slots)):
        if value < 1:
            ap.error(f"{flag}: a number >= 1, got {value}")
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.admission import part_rows_of
    from sglang_hs.server.store.finisher import FinishWorker
    from sglang_hs.server.store.ring import record_bytes
    from sglang_hs.server.store.writer import CaptureWriter

    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    random.seed(args.seed)
    store_bytes = args.slots * ROW_BYTES
    rows, skipped = [], []
    disk = tempfile.mkdtemp(prefix=".bench-long-record-", dir=args.disk_dir or "/tmp")
    where = f"store and ring in {args.shm_dir}, files in {disk}"
    try:
        part = int(args.part_mb * (1 << 20))
        part_rows = part_rows_of(part, ROW_BYTES)
        for T in lengths:
            for mode in modes:
                # one record (each lands at offset 0); in parts: twice a first part (all ids) and two more parts
                ring = record_bytes(T, P, H, ELEM, 64) if mode != "parts" or T <= part_rows else \
                    2 * record_bytes(part_rows, P, H, ELEM, 64, n_ids=T) + 2 * record_bytes(part_rows, P, H, ELEM, 64,
                                                                                            n_ids=0)
                need = store_bytes + ring + (T * ROW_BYTES if mode == "copy" else 0)
                if need > args.max_gb * GB or need > available_bytes() - 2 * GB:
                    why = (f"{T} tokens, {mode}: store + ring{' + copy' if mode == 'copy' else ''} = {need / GB:.1f} GB, "
                           f"over --max-gb {args.max_gb} or the {available_bytes() / GB:.1f} GB available less 2")
                    print(f"skipped: {why}", flush=True)
                    skipped.append(why)
                    continue
                base = tempfile.mkdtemp(prefix="bench-long-record-", dir=args.shm_dir)
                worker = consumer = None
                try:
                    dump = os.path.join(base, "hs")
                    os.makedirs(dump, mode=0o700)
                    writer = CaptureWriter(dump, CaptureSpec.resolve(LAYERS, True, 61, H), args.slots, torch.bfloat16,
                                           ring)
                    fill(writer.store, g)
                    worker = FinishWorker(writer)
                    if mode == "parts":
                        worker.enable_parts(part)
                    consumer = Consumer(dump, part)
                    perm = torch.randperm(args.slots, generator=g).to(torch.int64)
                    for rep in range(args.reps):
                        r = one_record(writer, worker, consumer, T, rep, mode, perm, disk)
                        rows.append(r)
                        write_csv(os.path.join(args.out, "bench_long_record.csv"), rows)
                        print(f"{T} tokens ({r['record_GB']:.2f} GB) [{mode}] rep {rep + 1}: gather {r['gather_GBps']:.2f}"
                              f" GB/s, take+write {r['write_GBps']:.2f}, e2e {r['e2e_GBps']:.2f}; peak consumer anon "
                              f"{r['consumer_anon_GB']:.2f} GB + shmem {r['consumer_shmem_GB']:.2f}, writer anon "
                              f"{r['writer_anon_GB']:.2f}", flush=True)
                finally:
                    if consumer is not None:
                        consumer.close()
                    if worker is not None:
                        worker.close()
                    shutil.rmtree(base, ignore_errors=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    summary = summarise(rows)
    write_summary(args.out, "bench_long_record", summary,
                  f"\nmedian of {args.reps} (min-max), {machine()}; {where}" + "".join(f"\nskipped: {s}" for s in skipped),
                  lambda s: (f"  {s['tokens']:>7} tokens {s['record_GB']:.2f} GB [{s['reader']}]: e2e "
                             f"{s['e2e_GBps_median']:.2f} GB/s ({s['e2e_GBps_min']:.2f}-{s['e2e_GBps_max']:.2f}), gather "
                             f"{s['gather_GBps_median']:.2f}, take+write {s['write_GBps_median']:.2f} (x"
                             f"{s['write_vs_view']:.2f} of view); consumer peak {s['consumer_anon_GB_median']:.2f} GB "
                             f"anon + {s['consumer_shmem_GB_median']:.2f} GB ring pages (x{s['peak_vs_view']:.3f} of "
                             f"view" + (f", x{s['peak_vs_part']:.2f} of a part" if s['part_GB'] else "") + f"); ring "
                             f"{s['ring_GB']:.2f} GB"))
    if summary:
        plot(summary, os.path.join(args.out, "bench_long_record.png"),
             f"one long DeepSeek-V3 record (57,344 B/token) through the whole-record path; {machine()}; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
