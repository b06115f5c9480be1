"""Records across hosts through Mooncake beside the node-local ring, over loopback on this machine.

DeepSeek-V3-sized rows (K = 3 aux layers + the final state, H = 7168, bf16: 57,344 bytes per token), the same
records for both paths; the writer (this process) publishes prepared rows into a real output ring, as the
server's finish does. One run alternates, `--reps` times:
  ring      a reader process (sglang_hs.HiddenStateReader, eager, as LiveHiddenStates reads) drains the ring
  mooncake  python -m sglang_hs.publish reads the ring and puts each record into Mooncake's store (its own
            segment), a consumer process (MooncakeTransport, confirming each on arrival, as LiveHiddenStates
            does) fetches it over Mooncake's TCP protocol through 127.0.0.1; mooncake_master (with its HTTP
            metadata server) started here. The consumer runs with MC_STORE_MEMCPY=0 unless --allow-memcpy:
            Mooncake could otherwise take a same-host copy, which a second host never gets (the publisher
            keeps Mooncake's default: its puts into its own segment are local copies on any deployment).
The figure is record bytes (rows) delivered per second, timed at the consumer after `--warmup` records, as
medians over the repetitions.

    python benchmarks/bench_mooncake.py --out benchmarks/results    # bench_mooncake.csv (+ .png with matplotlib)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.common import machine, plot_bars, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import wait_port  # noqa: E402

K, H = 3, 7168
P = K + 1
METHODS = ("ring", "mooncake")


def _consume(kind: str, where: str, warmup: int, n: int, q, memcpy: bool = False) -> None:
    torch.set_num_threads(1)
    if not memcpy:
        os.environ["MC_STORE_MEMCPY"] = "0"  # a second host's way: over TCP, never a same-host copy
    if kind == "ring":
        from sglang_hs.reader import HiddenStateReader

        reader = HiddenStateReader(where, poll_interval=0.0005, recycle_memory=True)
    else:
        from sglang_hs.extract.transport.mooncake import MooncakeTransport

        reader = MooncakeTransport(where, ack=False, wait=120, poll_interval=0.0005)
    q.put(("ready",))
    got, t0 = 0, None
    for i in range(warmup + n):
        rec = reader.next(timeout=300)
        if i == warmup - 1:
            t0 = time.perf_counter()
        elif i >= warmup:
            got += rec.aux_hidden_states.numel() + rec.last_hidden_state.numel()
        del rec
    q.put(("done", time.perf_counter() - t0, got))
    reader.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(kind: str, tokens: int, records: int, warmup: int, ring_bytes: int, master: dict, window_mb: int,
        memcpy: bool = False) -> float:
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    base = tempfile.mkdtemp(prefix="bench-mooncake-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    threads, pub = torch.get_num_threads(), None
    try:
        writer = CaptureWriter(base, CaptureSpec.resolve([2, 30, 58], True, 61, H), 8, torch.bfloat16, ring_bytes)
        g = torch.Generator().manual_seed(0)
        rows = torch.randn(tokens, P, H, generator=g).bfloat16()
        ids = torch.arange(tokens, dtype=torch.int32)
        where = base
        if kind == "mooncake":
            pub = subprocess.Popen([sys.executable, "-m", "sglang_hs.publish", "--hs-dump-dir", base, "--listen",
                                    "127.0.0.1:0", "--mooncake-master", master["master"], "--mooncake-metadata",
                                    master["metadata"], "--window-mb", str(window_mb)],
                                   stdout=subprocess.PIPE, text=True, cwd=REPO)
            line = pub.stdout.readline()
            if "consumers connect to " not in line:
                raise RuntimeError(f"the publisher did not start: {line!r} (exit {pub.wait()})")
            where = line.split("consumers connect to ")[1].split(";")[0].strip()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_consume, args=(kind, where, warmup, records, q, memcpy))
        proc.start()
        assert q.get(timeout=120)[0] == "ready"
        torch.set_num_threads(1)
        for i in range(warmup + records):
            writer.ring.publish(f"bench-{i}", ids, rows, timeout=300)
        _, seconds, got = q.get(timeout=600)
        proc.join(30)
        assert got == records * tokens * P * H
        return got * 2 / seconds
    finally:
        torch.set_num_threads(threads)
        if pub is not None:
            pub.terminate()
            pub.wait(timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per record (57 KB each)")
    ap.add_argument("--records", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ring-mib", type=int, default=256)
    ap.add_argument("--window-mb", type=int, default=128, help="the publisher's --window-mb")
    ap.add_argument("--allow-memcpy", action="store_true",
                    help="let the consumer's Mooncake take its same-host copy shortcut")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("GLOG_minloglevel", "2")
    from sglang_hs.extract.transport.mooncake import mooncake_binary, mooncake_env

    rpc, http, metrics = _port(), _port(), _port()
    master_proc = subprocess.Popen([mooncake_binary("mooncake_master"), f"-rpc_port={rpc}",
                                    "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                                    f"-http_metadata_server_port={http}", f"-metrics_port={metrics}"],
                                   env=mooncake_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait_port(rpc, master_proc, "mooncake_master")
        wait_port(http, master_proc, "mooncake_master's metadata server")
        master = {"master": f"127.0.0.1:{rpc}", "metadata": f"http://127.0.0.1:{http}/metadata"}
        for rep in range(args.reps):
            for method in METHODS:
                bps = run(method, args.tokens, args.records, args.warmup, args.ring_mib << 20, master, args.window_mb,
                          args.allow_memcpy)
                rows.append({"machine": machine(), "method": method, "rep": rep, "tokens_per_record": args.tokens,
                             "records": args.records, "bytes": args.tokens * P * H * 2 * args.records,
                             "memcpy_shortcut": args.allow_memcpy, "GBps": round(bps / 1e9, 3)})
                print(f"rep {rep} {method:>9}: {bps / 1e9:6.2f} GB/s", flush=True)
                write_csv(os.path.join(args.out, "bench_mooncake.csv"), rows)
    finally:
        master_proc.terminate()
        master_proc.wait(timeout=30)
    med = {m: statistics.median(r["GBps"] for r in rows if r["method"] == m) for m in METHODS}
    summary = [{"machine": machine(), "method": m, "reps": args.reps, "tokens_per_record": args.tokens,
                "median_GBps": v, "of_ring": round(v / med["ring"], 3)} for m, v in med.items()]
    write_summary(args.out, "bench_mooncake", summary, f"median GB/s ({machine()}):",
                  lambda r: f"  {r['method']:>9} {r['median_GBps']:6.2f} GB/s ({r['of_ring']:.2f} of the ring)")
    plot_bars(os.path.join(args.out, "bench_mooncake.png"), med, "GB/s (median)",
              f"records over Mooncake (TCP, loopback) vs the local ring, {args.tokens}-token records of 57 KB/token"
              f"\n{machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
