"""A reader process killed mid-run and restarted resumes from the ring: with acknowledged reading
(HiddenStateReader(ack=True), acking after each record is saved) every finished request ends up saved
exactly once across both runs, complete and in order, while the server keeps serving (its small ring
fills while no reader runs, and admission control holds new requests until the new reader catches up).
The consumer acknowledges out of order (pairs reversed, ack_consumer.py) and is killed between the two
acks of a pair: the record it acknowledged (B) must not release the one before it (A), not yet saved;
the new reader gets A and B again, B identical to what was saved."""
import concurrent.futures as cf
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import serving

pytestmark = pytest.mark.e2e
N = 40
CONSUMER = os.path.join(os.path.dirname(__file__), "ack_consumer.py")


@pytest.fixture(scope="module")
def small_ring_server(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hs-restart") / "dump"
    # ~10 records of ~100 tokens fit: the ring fills within a second or two of the reader dying
    yield from serving(dump, ["--hs-last", "--hs-ring-size", "2MiB", "--context-length", "256",
                              "--chunked-prefill-size", "64"])


def _consumer(server, out, log):
    return subprocess.Popen([sys.executable, CONSUMER, str(server.dump), str(out), str(log), "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _log(log):
    """The consumer's complete log lines, split."""
    if not os.path.exists(log):
        return []
    text = open(log).read()
    return [line.split() for line in text[: text.rfind("\n") + 1].splitlines()]


def _mid_pair(entries):
    """(A, B) when the consumer's last step acknowledged B, saved after A, the record before it, which it
    holds and has not saved; else None."""
    if len(entries) >= 3 and entries[-3][0] == "hold" and entries[-2][0] == "saved" and entries[-1][0] == "acked":
        a, b = entries[-3][1], entries[-1][1]
        if entries[-2][1] == b != a:
            return a, b
    return None


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _kill_between_the_acks_of_a_pair(proc, log, timeout=120):
    """SIGKILL the consumer at a moment it has acknowledged B and not yet saved A (after 8 records saved).
    It is stopped first, so the log read is its final state. Returns (A, B)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the consumer never acknowledged out of order"
        entries = _log(log)
        pair = _mid_pair(entries) if sum(e[0] == "saved" for e in entries) >= 8 else None
        if pair:
            proc.send_signal(signal.SIGSTOP)
            while not _stopped(proc.pid):
                time.sleep(0.001)
            if _mid_pair(_log(log)) == pair:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                return pair
            proc.send_signal(signal.SIGCONT)  # it moved on meanwhile: the next pair
        time.sleep(0.005)


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def test_reader_killed_and_restarted_saves_every_request_exactly_once(small_ring_server, tmp_path):
    server, out, log = small_ring_server, tmp_path / "out", tmp_path / "log"
    out.mkdir()
    rng = random.Random(3)
    reqs = [(f"restart-{i:02d}", [rng.randint(5, 1000) for _ in range(rng.randint(5, 200))], rng.choice([1, 8]))
            for i in range(N)]
    first = _consumer(server, out, log)
    _wait(lambda: _log(log), 60, lambda: "the first consumer did not start")

    def send(req):
        rid, ids, gen = req
        reply = server.generate(input_ids=ids, rid=rid, sampling_params={"max_new_tokens": gen, "temperature": 0,
                                                                          "ignore_eos": True})
        return rid, ids + reply["output_ids"][:-1]

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send, r) for r in reqs]
        held, acked = _kill_between_the_acks_of_a_pair(first, log)
        time.sleep(3)  # the server goes on serving; the ring fills, admission holds the rest
        second = _consumer(server, out, log)
        try:
            expected = dict(f.result(timeout=300) for f in futures)
            _wait(lambda: len(list(out.glob("*.pt"))) == N, 120,
                  lambda: f"saved {len(list(out.glob('*.pt')))} of {N}; never saved: "
                          f"{sorted(set(r[0] for r in reqs) - {p.stem for p in out.glob('*.pt')})}")
        finally:
            second.send_signal(signal.SIGKILL)
            second.wait(30)

    assert "admission waiting" in server.output  # the ring filled while no reader ran; requests were held
    entries = _log(log)
    starts = [i for i, e in enumerate(entries) if e[0] == "start"]
    assert len(starts) == 2
    handled1 = [e for e in entries[: starts[1]] if e[0] in ("saved", "repeat")]
    handled2 = [e for e in entries[starts[1] + 1:] if e[0] in ("saved", "repeat")]
    assert [e[0] for e in handled1] == ["saved"] * len(handled1) and handled1[-1][1] == acked
    # The new reader starts with the pair the first was in the middle of: A, held and not saved, and B,
    # saved and acknowledged after it, whose ack had to wait for A's (the consumer handles B first again).
    assert [e[1] for e in handled2[:2]] == [acked, held], handled2[:3]
    assert handled2[0] == ["repeat", acked, "same"]  # delivered again, identical to the file it saved
    repeats = [e for e in handled2 if e[0] == "repeat"]
    assert all(e[2] == "same" for e in repeats) and {e[1] for e in repeats} <= {held, acked}, repeats
    # A may have been renamed into place just before the kill, its log line not yet written: a repeat then.
    saved1 = [e[1] for e in handled1] + [e[1] for e in repeats if e[1] == held]
    saved2 = [e[1] for e in handled2 if e[0] == "saved"]
    assert sorted(saved1 + saved2) == sorted(expected)  # each request saved exactly once, none lost
    for rid, ids in expected.items():
        rec = torch.load(out / f"{rid}.pt")
        T = len(ids)
        assert rec["input_ids"].tolist() == ids, rid
        assert rec["aux"].shape == (T, 3, 256) and rec["last"].shape == (T, 256)
        assert torch.isfinite(rec["aux"].float()).all() and rec["aux"].float().abs().amax() > 0
