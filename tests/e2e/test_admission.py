"""Admission control: with nobody reading, a small output ring fills, new requests wait in SGLang's
queue (never inside a forward step), and once a reader drains the ring every record arrives intact;
held past --hs-admission-timeout, a request fails with a clear error and the server serves on. The
capture's Prometheus metrics on SGLang's /metrics count the same things."""
import concurrent.futures as cf
import glob
import json
import os
import time

import pytest
import requests
import torch

from helpers import serving
from sglang_hs import HiddenStateReader
from sglang_hs.store.ring import record_bytes

pytestmark = pytest.mark.e2e
N, PROMPT, NEW = 12, 60, 4
RING = 1 << 20  # 1 MiB: each request reserves 2 x ~125 KB, so ~4 fit at once
HOLD_LIMIT = 30  # --hs-admission-timeout, seconds


@pytest.fixture(scope="module")
def small_ring_server(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hs-admission") / "dump"
    yield from serving(dump, ["--hs-last", "--hs-ring-size", str(RING), "--hs-admission-timeout", str(HOLD_LIMIT),
                              "--enable-metrics",
                              "--context-length", "200"])  # a 1 MiB ring must hold one record at the maximal context


def _status(dump):
    time.sleep(1.2)
    return json.load(open(glob.glob(os.path.join(dump, "overlay-*.json"))[0]))


def _prompt(i):
    return [5 + (i * 31 + j * 7) % 900 for j in range(PROMPT)]


def _drain(reader, rids, seconds):
    got, deadline = {}, time.monotonic() + seconds
    while set(got) != set(rids) and time.monotonic() < deadline:
        reader.poll()
        for rid in [r for r in reader._ready if r in rids]:
            got[rid] = reader.take(rid)
        time.sleep(0.05)
    return got


def _metrics(server):
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("sglang_hs:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def test_full_ring_holds_requests_then_everything_arrives(small_ring_server):
    server = small_ring_server
    reader = HiddenStateReader(str(server.dump))  # opened, but not reading yet
    assert reader.poll() == 0  # SGLang's start-up warm-up request is not emitted
    assert N * record_bytes(PROMPT + NEW - 1, 4, 256, 2, 8) > RING  # more than the ring holds
    prompts = [_prompt(i) for i in range(N)]
    pool = cf.ThreadPoolExecutor(N)
    futures = [pool.submit(server.generate, input_ids=p, rid=f"adm-{i}",
                           sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
               for i, p in enumerate(prompts)]
    time.sleep(15)
    done = sum(f.done() for f in futures)
    status = _status(server.dump)
    assert 0 < done < N, f"{done} of {N} requests finished with nobody reading a {RING}-byte ring"
    assert status["admission"]["held_now"] > 0 and status["admission"]["admission_waits"] > 0, status
    assert status["output_ring_fill"] > 0.5, status
    m = _metrics(server)
    assert m["sglang_hs:admission_held"] > 0 and m["sglang_hs:admission_waits_total"] > 0, m
    assert m["sglang_hs:output_ring_fill_ratio"] > 0.5, m
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
    m = _metrics(server)
    assert m["sglang_hs:records_published_total"] >= N and m["sglang_hs:records_dropped_total"] == 0, m
    assert m["sglang_hs:rows_captured_total"] >= N * (PROMPT + NEW - 1), m
    assert m["sglang_hs:bytes_published_total"] >= N * (PROMPT + NEW - 1) * 4 * 256 * 2, m
    assert m["sglang_hs:admission_held"] == 0 and m["sglang_hs:admission_failed_total"] == 0, m


def test_requests_held_past_the_limit_fail_clearly_and_the_server_serves_on(small_ring_server):
    server = small_ring_server
    reader = HiddenStateReader(str(server.dump))
    reader.poll()
    reader._ready.clear()  # whatever an earlier test left unread
    pool = cf.ThreadPoolExecutor(N)
    rids = [f"late-{i}" for i in range(N)]
    futures = {rid: pool.submit(requests.post, f"{server.url}/generate", timeout=300, json=dict(
        input_ids=_prompt(100 + i), rid=rid,
        sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}))
        for i, rid in enumerate(rids)}
    # Nobody reads: the first few fill the ring, the rest are held, then failed after HOLD_LIMIT.
    replies = {rid: f.result(timeout=HOLD_LIMIT + 120) for rid, f in futures.items()}
    failed = {rid for rid, r in replies.items() if r.status_code != 200 or
              r.json()["meta_info"]["finish_reason"]["type"] == "abort"}
    assert 0 < len(failed) < N, {rid: r.status_code for rid, r in replies.items()}
    for rid in failed:
        assert "held" in replies[rid].text and "--hs-ring-size" in replies[rid].text, replies[rid].text
    status = _status(server.dump)
    assert status["admission"]["failed"] == len(failed) and status["admission"]["held_now"] == 0, status
    assert _metrics(server)["sglang_hs:admission_failed_total"] == len(failed)
    assert "held" in server.output and "by admission control" in server.output
    # The admitted ones' records are all there; the failed ones never produce a record.
    got = _drain(reader, set(rids), 60)
    assert set(got) == set(rids) - failed
    time.sleep(1)
    assert reader.poll() == 0
    # The server is healthy: SGLang's watchdog did not fire, and a new request is served and captured.
    out = server.generate(input_ids=_prompt(999), rid="after-limit",
                          sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert reader.take("after-limit", timeout=60).input_ids.tolist() == (_prompt(999) + out["output_ids"])[:-1]
