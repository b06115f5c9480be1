"""Admission control: with nobody reading, a small output ring fills, new requests wait in SGLang's
queue (never inside a forward step), and once a reader drains the ring every record arrives intact."""
import concurrent.futures as cf
import glob
import json
import os
import time

import pytest
import torch

from helpers import Launcher, leftover_server_processes
from sglang_hs import HiddenStateReader
from sglang_hs.store.ring import record_bytes

pytestmark = pytest.mark.e2e
N, PROMPT, NEW = 12, 60, 4
RING = 1 << 20  # 1 MiB: each request reserves 2 x ~125 KB, so ~4 fit at once


@pytest.fixture(scope="module")
def small_ring_server(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hs-admission") / "dump"
    server = Launcher(["--hs-dump-dir", str(dump), "--hs-last", "--hs-ring-size", str(RING)])
    server.dump = dump
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 128 + 15, server.tail()
        assert not leftover_server_processes(server.output)


def _status(dump):
    time.sleep(1.2)
    return json.load(open(glob.glob(os.path.join(dump, "overlay-*.json"))[0]))


def test_full_ring_holds_requests_then_everything_arrives(small_ring_server):
    server = small_ring_server
    reader = HiddenStateReader(str(server.dump))  # opened, but not reading yet
    assert reader.poll() == 0  # SGLang's start-up warm-up request is not emitted
    assert N * record_bytes(PROMPT + NEW - 1, 4, 256, 2, 8) > RING  # more than the ring holds
    prompts = [[5 + (i * 31 + j * 7) % 900 for j in range(PROMPT)] for i in range(N)]
    pool = cf.ThreadPoolExecutor(N)
    futures = [pool.submit(server.generate, input_ids=p, rid=f"adm-{i}",
                           sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
               for i, p in enumerate(prompts)]
    time.sleep(15)
    done = sum(f.done() for f in futures)
    status = _status(server.dump)
    assert 0 < done < N, f"{done} of {N} requests finished with nobody reading a {RING}-byte ring"
    assert status["admission"]["held_now"] > 0 and status["admission"]["admission_waits"] > 0, status
    # Now read: held requests are admitted as the ring drains; every record arrives whole.
    got = {}
    deadline = time.monotonic() + 300
    while len(got) < N and time.monotonic() < deadline:
        reader.poll()
        for rid in list(reader._ready):
            if rid.startswith("adm-"):
                got[rid] = reader.take(rid)
        time.sleep(0.05)
    outs = [f.result(timeout=60) for f in futures]
    assert sorted(got) == sorted(f"adm-{i}" for i in range(N))
    for i, (p, out) in enumerate(zip(prompts, outs)):
        rec = got[f"adm-{i}"]
        assert rec.input_ids.tolist() == (p + out["output_ids"])[:-1]
        assert rec.aux_hidden_states.shape == (PROMPT + NEW - 1, 3, 256)
        assert torch.isfinite(rec.aux_hidden_states.float()).all()
    status = _status(server.dump)
    assert status["writer"]["records"] >= N and status["writer"].get("dropped", 0) == 0
    assert status["admission"]["held_now"] == 0
    assert "admission waiting" in server.output
