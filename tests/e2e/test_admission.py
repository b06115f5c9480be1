"""Admission control: with nobody reading, a small output ring fills, new requests wait in SGLang's
queue (never inside a forward step), and once a reader drains the ring every record arrives exact, row
for row against HF float32; held past --hs-admission-timeout, a request fails with a clear error and the
server serves on; a request longer than the ring can ever hold (--hs-max-record-tokens on a longer context) is
refused at once with a 400 naming the limit. The capture's Prometheus metrics on SGLang's /metrics count the same things. (A
`/generate` with a list of prompts, admitted member by member, is in test_reader_restart.py, on the
small-ring server without a time limit.)

Every check of the server's counters waits for published state (sglang_hs.status): a condition on a
status file written after the moment it is about, or a settled one (every request answered has its
outcome counted), and /metrics once it shows that snapshot's seq."""
import concurrent.futures as cf
import time

import pytest
import requests

import row_judge
from helpers import metrics_of, serving, settled, status_when
from sglang_hs import HiddenStateReader
from sglang_hs.server.store.ring import record_bytes

pytestmark = pytest.mark.e2e
N, PROMPT, NEW = 12, 60, 4
LAYERS, N_LAYERS, H, P, ELEM = [2, 4, 5], 8, 256, 4, 4  # float32: 3 aux layers + the final state
RING = 2 << 20  # 2 MiB: each request reserves 2 x ~250 KB, so ~4 fit at once
HOLD_LIMIT = 30  # --hs-admission-timeout, seconds
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_ring_server(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hs-admission") / "dump"
    yield from serving(dump, ["--dtype", "float32", "--hs-last", "--hs-ring-size", str(RING),
                              "--hs-admission-timeout", str(HOLD_LIMIT), "--enable-metrics",
                              "--hs-max-record-tokens", "200"])  # the ring holds 200-token records, not 4096


def _prompt(i):
    return [5 + (i * 31 + j * 7) % 900 for j in range(PROMPT)]


def _drain(reader, rids, seconds):
    """The records of `rids` as they arrive (each poll reads what is published), until all are in."""
    got, deadline = {}, time.monotonic() + seconds
    while set(got) != set(rids) and time.monotonic() < deadline:
        reader.poll()
        for rid in [r for r in reader.ready_rids() if r in rids]:
            got[rid] = reader.take(rid)
        time.sleep(0.05)
    return got


def _exact(rec, hf, want_ids):
    return row_judge.assert_exact(rec, hf, want_ids, LAYERS, N_LAYERS, H)


def test_full_ring_holds_requests_then_everything_arrives(small_ring_server, hf):
    server = small_ring_server
    assert N * record_bytes(PROMPT + NEW - 1, P, H, ELEM, 8) > RING  # more than the ring holds
    prompts = [_prompt(i) for i in range(N)]
    before = settled(server)  # whatever earlier tests sent is counted: the baseline of the exact counts below
    with HiddenStateReader(str(server.dump)) as reader, cf.ThreadPoolExecutor(N) as pool:  # opened, not reading
        assert reader.poll() == 0  # SGLang's start-up warm-up request is not emitted
        futures = [pool.submit(server.generate, input_ids=p, rid=f"adm-{i}", sampling_params=GREEDY)
                   for i, p in enumerate(prompts)]
        # Until the ring is over half full, requests are answered and others are held. Held longer than
        # HOLD_LIMIT they would fail: wait for the published state, well inside it.
        status = status_when(server, lambda s: s["admission"]["held_now"] > 0 and s["output_ring_fill"] > 0.5
                             and any(f.done() for f in futures), timeout=HOLD_LIMIT)
        assert sum(f.done() for f in futures) < N, f"nobody reads a {RING}-byte ring: {status}"
        assert status["admission"]["admission_waits"] > before["admission"]["admission_waits"], status
        m = metrics_of(server, status)  # /metrics once it shows this snapshot (or a later one: still held)
        assert m["sglang_hs:admission_held"] > 0 and m["sglang_hs:admission_waits_total"] > 0, m
        assert m["sglang_hs:output_ring_fill_ratio"] > 0.5 and m["sglang_hs:requests_unaccounted"] > 0, m
        # Now read: held requests are admitted as the ring drains; every record arrives whole and exact.
        got = _drain(reader, {f"adm-{i}" for i in range(N)}, 300)
        outs = [f.result(timeout=60) for f in futures]
    assert sorted(got) == sorted(f"adm-{i}" for i in range(N))
    for i, (p, out) in enumerate(zip(prompts, outs)):
        _exact(got[f"adm-{i}"], hf, (p + out["output_ids"])[:-1])
    status = settled(server)
    w, w0 = status["writer"], before["writer"]
    assert w["records"] - w0["records"] == N and w["dropped"] == 0, status
    assert w["rows"] - w0["rows"] == N * (PROMPT + NEW - 1), status
    assert status["admission"]["held_now"] == 0 and status["admission"]["failed"] == before["admission"]["failed"]
    assert "admission waiting" in server.output
    m = metrics_of(server, status)
    assert m["sglang_hs:records_published_total"] == w["records"] and m["sglang_hs:records_dropped_total"] == 0, m
    assert m["sglang_hs:rows_captured_total"] == w["rows"], m
    assert m["sglang_hs:bytes_published_total"] == w["bytes"] >= N * (PROMPT + NEW - 1) * P * H * ELEM, m
    assert m["sglang_hs:admission_held"] == 0 and m["sglang_hs:admission_failed_total"] == 0, m
    assert m["sglang_hs:requests_unaccounted"] == 0, m
    # the finish worker's own: present (its counters only grow; the gauges are 0 once all is published)
    assert {"sglang_hs:finish_wait_seconds_total", "sglang_hs:store_write_waits_total", "sglang_hs:finish_pending",
            "sglang_hs:store_wait_seconds_total", "sglang_hs:scatter_wait_seconds_total"} <= set(m), m


def test_requests_held_past_the_limit_fail_clearly_and_the_server_serves_on(small_ring_server, hf):
    server = small_ring_server
    before = settled(server)
    rids = [f"late-{i}" for i in range(N)]
    with HiddenStateReader(str(server.dump)) as reader, cf.ThreadPoolExecutor(N) as pool:
        reader.poll()
        assert not reader.ready_rids(), "an earlier test left records unread"
        futures = {rid: pool.submit(requests.post, f"{server.url}/generate", timeout=300, json=dict(
            input_ids=_prompt(100 + i), rid=rid, sampling_params=GREEDY)) for i, rid in enumerate(rids)}
        # Nobody reads: the first few fill the ring, the rest are held, then failed after HOLD_LIMIT.
        replies = {rid: f.result(timeout=HOLD_LIMIT + 120) for rid, f in futures.items()}
        failed = {rid for rid, r in replies.items() if r.status_code != 200 or
                  r.json()["meta_info"]["finish_reason"]["type"] == "abort"}
        assert 0 < len(failed) < N, {rid: r.status_code for rid, r in replies.items()}
        for rid in failed:
            assert "held" in replies[rid].text and "--hs-ring-size" in replies[rid].text, replies[rid].text
        status = settled(server)  # every reply is in: each outcome is counted
        assert status["admission"]["failed"] - before["admission"]["failed"] == len(failed), status
        assert status["admission"]["held_now"] == 0, status
        assert status["writer"]["records"] - before["writer"]["records"] == N - len(failed), status
        assert metrics_of(server, status)["sglang_hs:admission_failed_total"] == status["admission"]["failed"]
        assert "held" in server.output and "by admission control" in server.output
        # The admitted ones' records are all there, exact; the failed ones never produce a record.
        got = _drain(reader, set(rids), 60)
        assert set(got) == set(rids) - failed
        for i, rid in enumerate(rids):
            if rid in got:
                _exact(got[rid], hf, (_prompt(100 + i) + replies[rid].json()["output_ids"])[:-1])
        assert reader.poll() == 0  # settled above: nothing more is coming
        # The server is healthy: SGLang's watchdog did not fire, and a new request is served and captured.
        out = server.generate(input_ids=_prompt(999), rid="after-limit",
                              sampling_params={"max_new_tokens": 2, "temperature": 0})
        _exact(reader.take("after-limit", timeout=60), hf, (_prompt(999) + out["output_ids"])[:-1])


def test_a_request_the_ring_can_never_hold_is_refused_at_once_naming_the_limit(small_ring_server, hf):
    """--hs-max-record-tokens 200 on the tiny model's 4096-token context: the 2 MiB ring holds two 200-token
    records, so 150 prompt + 400 max_new_tokens can never be admitted. Refused with a 400 at once (not held until
    --hs-admission-timeout), nothing reserved or written for it; counted as oversized, and the next request served
    and captured exact."""
    server = small_ring_server
    before = settled(server)
    with HiddenStateReader(str(server.dump)) as reader:
        reader.poll()
        assert not reader.ready_rids(), "an earlier test left records unread"
        r = requests.post(f"{server.url}/generate", timeout=300, json=dict(
            input_ids=_prompt(300)[:PROMPT] * 2 + _prompt(301)[:30], rid="too-long",
            sampling_params={"max_new_tokens": 400, "temperature": 0}))
        assert r.status_code == 400, (r.status_code, r.text)
        assert "request refused: 150 prompt + 400 max_new_tokens = 550 tokens" in r.text, r.text
        assert "at most " in r.text and "tokens fit" in r.text and "--hs-ring-size" in r.text, r.text
        status = settled(server)
        assert status["admission"]["oversized"] - before["admission"]["oversized"] == 1, status
        assert status["admission"]["failed"] - before["admission"]["failed"] == 1, status
        assert status["admission"]["held_now"] == 0 and status["writer"]["records"] == before["writer"]["records"]
        assert reader.poll() == 0 and "too-long" not in reader.ready_rids()  # settled: nothing is coming for it
        out = server.generate(input_ids=_prompt(302), rid="after-too-long",
                              sampling_params={"max_new_tokens": 2, "temperature": 0})
        _exact(reader.take("after-too-long", timeout=60), hf, (_prompt(302) + out["output_ids"])[:-1])
