"""A reader process killed mid-run and restarted resumes from the ring: with acknowledged reading
(HiddenStateReader(ack=True), acking after each record is saved) every finished request ends up saved
exactly once across both runs, complete and in order, while the server keeps serving (its small ring
fills while no reader runs, and admission control holds new requests until the new reader catches up)."""
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
    return [line.split() for line in open(log).read().splitlines()] if os.path.exists(log) else []


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
        _wait(lambda: sum(e[0] == "saved" for e in _log(log)) >= 8, 120, lambda: "the first consumer saved nothing")
        first.send_signal(signal.SIGKILL)  # mid-stream, wherever it is
        first.wait(30)
        time.sleep(3)  # the server goes on serving; the ring fills, admission holds the rest
        second = _consumer(server, out, log)
        try:
            expected = dict(f.result(timeout=300) for f in futures)
            _wait(lambda: len(list(out.glob("*.pt"))) == N, 120, lambda: f"saved {len(list(out.glob('*.pt')))} of {N}")
        finally:
            second.send_signal(signal.SIGKILL)
            second.wait(30)

    assert "admission waiting" in server.output  # the ring filled while no reader ran; requests were held
    entries = _log(log)
    starts = [i for i, e in enumerate(entries) if e[0] == "start"]
    assert len(starts) == 2
    run1 = [e[1] for e in entries[: starts[1]] if e[0] == "saved"]
    run2 = entries[starts[1] + 1:]
    repeats = [e[1] for e in run2 if e[0] == "repeat"]
    saved2 = [e[1] for e in run2 if e[0] == "saved"]
    # Exactly once: nothing lost, nothing saved twice; the only record delivered again is one the first
    # reader had saved (perhaps not yet logged) but not acknowledged when it died, and it comes first.
    saved1 = run1 + [rid for rid in repeats if rid not in run1]
    assert sorted(saved1 + saved2) == sorted(expected)
    assert len(repeats) <= 1 and (not repeats or run2[0][0] == "repeat")
    for rid, ids in expected.items():
        rec = torch.load(out / f"{rid}.pt")
        T = len(ids)
        assert rec["input_ids"].tolist() == ids, rid
        assert rec["aux"].shape == (T, 3, 256) and rec["last"].shape == (T, 256)
        assert torch.isfinite(rec["aux"].float()).all() and rec["aux"].float().abs().amax() > 0
