"""Across machines through Mooncake (sglang_hs/publish.py, sglang_hs/extract/transport/mooncake.py), with
processes as hosts over loopback, Mooncake's TCP protocol, its master and HTTP metadata server started here
(mooncake_master of requirements/mooncake.txt), and records written into a real ring by the real writer:
- every record comes through bit for bit as the local reader reads the same records (every byte of every
  tensor, NaN and -0.0 included, shapes and strides, ids and fields), markers handed on;
- a consumer process killed (SIGKILL) mid-run with records confirmed and one in hand: the next consumer gets
  every record it had not confirmed, first, each flagged redelivered, and none it had;
- backpressure: a consumer that does not confirm gets exactly the publisher's window, and the ring fills
  (the server's admission would hold new requests); each confirmation lets exactly one more through.
The barrier is the publisher's answer to a sync (MooncakeTransport.sync), never a sleep."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import mooncake_path
from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

_MOONCAKE = mooncake_path()
if _MOONCAKE is None:
    pytest.skip("requirements/mooncake.txt is not installed (run scripts/ensure_env.sh, or set SGLANG_HS_MOONCAKE)",
                allow_module_level=True)
os.environ["SGLANG_HS_MOONCAKE"] = _MOONCAKE
os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's info and warning lines

from mooncake_run import DEADLINE, REPO, Publisher, mooncake_master  # noqa: E402
from sglang_hs.extract.transport.mooncake import MooncakeTransport, payload_layout  # noqa: E402
from sglang_hs.extract.transport import Transport  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store import ring  # noqa: E402
from sglang_hs.server.store.ring import encode_meta  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

LAYERS, H = [1, 3], 16
P = len(LAYERS) + 2  # --hs-last both: post-norm, then pre-norm
N = 24  # records of the killed-consumer run
T_MAX = 9


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with mooncake_master(str(tmp_path_factory.mktemp("mooncake") / "master.log")) as m:
        yield m


def _writer(dump, records: int, T: int = T_MAX) -> CaptureWriter:
    return CaptureWriter(str(dump), CaptureSpec.resolve(LAYERS, "both", 4, H), 8, torch.bfloat16,
                         records * ring.record_bytes(T, P, H, 2, 8, 64))


def _rows(i: int, T: int) -> torch.Tensor:
    """Record i's rows [T, P, H]: random bf16 bit patterns of its own, with a NaN and a -0.0 (equal values would
    not tell them from another NaN or from 0.0: only the bytes do)."""
    g = torch.Generator().manual_seed(1000 + i)
    rows = torch.randint(-(1 << 15), 1 << 15, (T, P, H), generator=g, dtype=torch.int16).view(torch.bfloat16)
    rows[0, 0, 0], rows[-1, -1, -1] = float("nan"), -0.0
    return rows


def _publish_all(w: CaptureWriter, count: int, marker_at: int = -1) -> list:
    """Records r0.. of lengths 1..T_MAX into the ring (and a marker at `marker_at`); the rids in ring order."""
    rids = []
    for i in range(count):
        if i == marker_at:
            w.ring.publish(f"m{i}", torch.zeros(0, dtype=torch.int32), torch.zeros(0, P, H).bfloat16(), skipped=3)
        T = 1 + i % T_MAX
        meta = encode_meta({"speculative": {"verify_steps": i, "accepted_drafts": [i % 3]}} if i % 2 else None)
        w.ring.publish(f"r{i}", torch.arange(T, dtype=torch.int32) + 7 * i, _rows(i, T), timeout=5,
                       prompt_len=max(1, T - 1), next_token=i + 5, meta=meta)
        rids.append(f"r{i}")
    return rids


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _assert_same(remote: dict, local) -> None:
    """A remote record (as mooncake_consumer.save writes it) is the local reader's, bit for bit."""
    assert remote["rid"] == local.rid
    for name, theirs in (("input_ids", local.input_ids), ("aux", local.aux_hidden_states),
                         ("last", local.last_hidden_state), ("pre", local.last_pre_norm)):
        ours = remote[name]
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (local.rid, name)
        assert _bytes(ours) == _bytes(theirs), (local.rid, name)
    assert remote["aux_stride"] == local.aux_hidden_states.stride(), local.rid
    for field in ("seq", "prompt_len", "next_token", "meta"):
        assert remote[field] == getattr(local, field), (local.rid, field)


def _as_saved(rec) -> dict:
    return {"rid": rec.rid, "input_ids": rec.input_ids, "aux": rec.aux_hidden_states, "last": rec.last_hidden_state,
            "pre": rec.last_pre_norm, "aux_stride": rec.aux_hidden_states.stride(), "seq": rec.seq,
            "prompt_len": rec.prompt_len, "next_token": rec.next_token, "meta": rec.meta,
            "redelivered": rec.redelivered, "delivery": rec.delivery}


def test_records_bit_for_bit_and_a_killed_consumer_loses_none(master, tmp_path):
    # the local path: the same records through the node-local reader
    local_dump, remote_dump, out = tmp_path / "local", tmp_path / "remote", tmp_path / "out"
    for d in (local_dump, remote_dump, out):
        d.mkdir()
    lw, rw = _writer(local_dump, N + 1), _writer(remote_dump, N + 1)
    rids = _publish_all(lw, N, marker_at=5)
    assert _publish_all(rw, N, marker_at=5) == rids
    with HiddenStateReader(str(local_dump), wait=5, ack=True) as reader:
        local = {}
        while len(local) < N:
            rec = reader.next(timeout=DEADLINE)
            local[rec.rid] = rec
        assert reader.not_captured("m5") == "reader_behind"

    biggest = payload_layout(T_MAX, P, H, 2)[1]
    pub = Publisher(master, str(remote_dump), window_mb=6 * biggest / (1 << 20))  # several records in flight
    try:
        acks = 9
        c1 = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "unit", "mooncake_consumer.py"),
                               pub.address, str(out), str(acks)], cwd=REPO)
        deadline = time.monotonic() + DEADLINE
        while not (out / "stuck").exists():  # published state: the consumer's rename
            assert c1.poll() is None, f"the consumer exited ({c1.returncode}) early"
            assert time.monotonic() < deadline, "the consumer took no record in hand"
            time.sleep(0.01)
        c1.send_signal(signal.SIGKILL)
        assert c1.wait(timeout=30) == -signal.SIGKILL
        pub.line("left: ")
        first = sorted((torch.load(out / f, weights_only=False) for f in os.listdir(out) if f.endswith(".pt")),
                       key=lambda r: r["delivery"])
        stuck = (out / "stuck").read_text()
        assert [r["rid"] for r in first] == rids[:acks + 1] and first[-1]["rid"] == stuck
        confirmed = {r["rid"] for r in first[:acks]}

        # the next consumer (this process: another host) gets every record not confirmed, first, flagged
        with MooncakeTransport(pub.address, ack=True, wait=DEADLINE) as t:
            t.sync()  # the publisher has answered: what it holds unconfirmed is announced, first the one in hand
            assert t.ready_rids()[:1] == [stuck], t.ready_rids()
            second = []
            while {r["rid"] for r in second} | confirmed != set(rids):
                rec = t.next(timeout=DEADLINE)
                second.append(_as_saved(rec))
                t.ack(rec)
            t.sync()  # the publisher has announced all it holds: nothing else comes
            assert t.ready_rids() == []
            assert t.not_captured("m5") is None  # its marker went to the first consumer (with its records)
        redelivered = [r["rid"] for r in second if r["redelivered"]]
        assert stuck in redelivered, (stuck, redelivered)
        assert not {r["rid"] for r in second} & confirmed, "a record the killed consumer confirmed came again"
        assert [r["rid"] for r in second] == rids[acks:], "lost, duplicated or out of order"
        assert [r["rid"] for r in second[:len(redelivered)]] == redelivered, "re-delivered records come first"
        for r in first + second:
            _assert_same(r, local[r["rid"]])
        print(f"{N} records bit for bit; killed with {acks} confirmed, {len(redelivered)} re-delivered: {redelivered}")
    finally:
        pub.stop()


def test_a_consumer_that_does_not_confirm_fills_the_ring_not_the_publisher(master, tmp_path):
    T, ring_records, window = 4, 8, 3
    w = _writer(tmp_path, ring_records, T)
    one = ring.record_bytes(T, P, H, 2, 2)  # r0..r7: two bytes of rid
    total = payload_layout(T, P, H, 2)[1]
    pub = Publisher(master, str(tmp_path), window_mb=(window * total + total // 2) / (1 << 20))
    try:
        with MooncakeTransport(pub.address, ack=True, wait=DEADLINE) as t:
            written = 0
            while w.ring.free_bytes() >= one:  # the server's side: admission reserves while this holds
                w.ring.publish(f"r{written}", torch.arange(T, dtype=torch.int32), _rows(written, T), timeout=5)
                written += 1
            assert written >= window + 2, written
            t.sync()
            assert t.ready_rids() == [f"r{i}" for i in range(window)], "the publisher went past its window"
            assert w.ring.free_bytes() < one, "the ring has room: the admission would not hold"
            got = [t.pop_ready(f"r{i}") for i in range(window)]
            t.ack(got[0])  # one confirmed: one record's ring bytes back, one more through
            t.sync()
            assert t.ready_rids() == [f"r{window}"]
            assert w.ring.free_bytes() >= one
            for rec in got[1:]:
                t.ack(rec)
            seen = [r.rid for r in got] + [f"r{window}"]
            t.ack(t.pop_ready(f"r{window}"))
            while len(seen) < written:
                rec = t.next(timeout=DEADLINE)
                seen.append(rec.rid)
                t.ack(rec)
            assert seen == [f"r{i}" for i in range(written)]
            t.sync()
            assert w.ring.free_bytes() == w.ring.capacity  # every byte back once all are confirmed
    finally:
        pub.stop()


def test_a_killed_publisher_loses_nothing_either(master, tmp_path):
    """The publisher acks a ring record only once confirmed: killed, the ring still holds every record it had
    put and not seen confirmed, and the next publisher hands them all on."""
    T, count = 3, 10
    w = _writer(tmp_path, count + 1, T)
    for i in range(count):
        w.ring.publish(f"r{i}", torch.arange(T, dtype=torch.int32) + i, _rows(i, T), timeout=5)
    whole = payload_layout(T, P, H, 2)[1] * count / (1 << 20)
    pub = Publisher(master, str(tmp_path), window_mb=whole)
    try:
        t = MooncakeTransport(pub.address, ack=True, wait=DEADLINE)
        for i in range(2):
            t.ack(t.take(f"r{i}", timeout=DEADLINE))
        t.sync()  # the publisher has both confirmations, and has put and announced the other eight
        assert t.ready_rids() == [f"r{i}" for i in range(2, count)]
        pub.proc.send_signal(signal.SIGKILL)
        pub.stop()
        assert pub.proc.returncode == -signal.SIGKILL
        t.close()
        pub = Publisher(master, str(tmp_path), window_mb=whole)
        with MooncakeTransport(pub.address, ack=True, wait=DEADLINE) as t2:
            t2.sync()
            assert t2.ready_rids() == [f"r{i}" for i in range(2, count)], "records lost with the publisher"
            for i in range(2, count):
                rec = t2.take(f"r{i}")
                assert _bytes(rec.aux_hidden_states) == _bytes(_rows(i, T)[:, :len(LAYERS)]), rec.rid
                t2.ack(rec)
            t2.sync()
            assert w.ring.free_bytes() == w.ring.capacity
    finally:
        pub.stop()


def test_one_consumer_at_a_time_markers_and_bad_flags(master, tmp_path, capsys):
    w = _writer(tmp_path, 2)
    w.ring.publish("m0", torch.zeros(0, dtype=torch.int32), torch.zeros(0, P, H).bfloat16(), skipped=6)
    w.ring.publish("r0", torch.arange(2, dtype=torch.int32), _rows(0, 2), timeout=5)
    pub = Publisher(master, str(tmp_path), window_mb=1)
    try:
        with MooncakeTransport(pub.address, ack=True, wait=DEADLINE) as t:
            assert isinstance(t, Transport)  # the interface the extraction and the live dataset read
            with pytest.raises(RuntimeError, match="already consumed by 127.0.0.1:"):
                MooncakeTransport(pub.address, ack=True, wait=DEADLINE)
            rec = t.take("r0", timeout=DEADLINE)
            assert t.not_captured("m0") == "over_budget"
            t.ack(rec)
    finally:
        pub.stop()
    from sglang_hs.publish import main

    base = {"--hs-dump-dir": str(tmp_path), "--listen": "127.0.0.1:0", "--mooncake-master": master["master"],
            "--mooncake-metadata": master["metadata"]}
    for args, expect in ((["--listen", "nowhere"], "--listen: expected HOST:PORT, got 'nowhere'"),
                         (["--mooncake-master", "host:99999"], "--mooncake-master: expected HOST:PORT"),
                         (["--mooncake-protocol", "udp"], "--mooncake-protocol: expected one of tcp, rdma"),
                         (["--mooncake-protocol", "rdma"], "--mooncake-device: expected the RDMA devices"),
                         (["--window-mb", "0"], "--window-mb: expected a size in MB > 0"),
                         (["--segment-mb", "8"], "--segment-mb: expected at least"),
                         (["--mooncake-metadata", "localhost:8080"], "--mooncake-metadata: expected http://")):
        argv = dict(base, **dict(zip(args[::2], args[1::2])))
        assert main([x for kv in argv.items() for x in kv]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and expect in lines[0], lines


def test_importing_needs_no_mooncake():
    code = ("import sys, sglang_hs, sglang_hs.live, sglang_hs.publish, sglang_hs.extract.transport; "
            "assert 'mooncake' not in sys.modules and 'mooncake.store' not in sys.modules, sorted(sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_HS_MOONCAKE"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=DEADLINE)


def test_a_segment_smaller_than_the_largest_record_is_named_at_start(master, tmp_path):
    """A record larger than the publisher's Mooncake segment cannot be put: it stops the publisher when it comes (it
    stays in the ring). The publisher says so at start, in one line naming --segment-mb and what would take it: here
    an 80 MiB ring admits records of up to 40 MiB, and --window-mb 1 leaves the least segment, 32 MB."""
    from sglang_hs.publish import segment_warning

    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve(LAYERS, "both", 4, H), 8, torch.bfloat16, 80 << 20)
    pub = Publisher(master, str(tmp_path), window_mb=1)
    try:
        line = pub.line("[publish] warning")
        assert "records of up to 40 MB" in line and "32 MB Mooncake segment holds (--segment-mb)" in line, line
        assert "raise --segment-mb to at least 40" in line and "--hs-max-record-tokens" in line, line
    finally:
        pub.stop()
        w.close()
    assert segment_warning(32 << 20, 32 << 20) is None  # a record that fits exactly: nothing to say
    # a server with records in parts: bounded by its context, which --hs-max-record-tokens does not cap
    parted = segment_warning(300 << 20, 32 << 20, parts=True)
    assert "(its context's, in parts)" in parted and "(a shorter --context-length)" in parted, parted
    assert "--hs-max-record-tokens" not in parted
