"""Admission control: with nobody reading, a small output ring fills, new requests wait in SGLang's
queue (never inside a forward step), and once a reader drains the ring every record arrives intact;
held past --hs-admission-timeout, a request fails with a clear error and the server serves on. The
capture's Prometheus metrics on SGLang's /metrics count the same things. A `/generate` with a list of
prompts (one batched message to the scheduler) is admitted member by member like single requests."""
import concurrent.futures as cf
import glob
import json
import os
import time

import pytest
import requests
import torch

import sglang_hs
from helpers import serving
from sglang_hs import HiddenStateReader
from sglang_hs.server.store.ring import record_bytes

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


@pytest.fixture(scope="module")
def batch_ring_server(tmp_path_factory):
    """The same small ring with no time limit on holding (members of a batch wait as long as the reader takes,
    however slow this machine is), and text batches sent to the scheduler as one batched message like
    pre-tokenized ones (--enable-tokenizer-batch-encode)."""
    dump = tmp_path_factory.mktemp("hs-admission-batch") / "dump"
    yield from serving(dump, ["--hs-last", "--hs-ring-size", str(RING), "--hs-admission-timeout", "0",
                              "--enable-tokenizer-batch-encode", "--context-length", "200"])


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
    deadline = time.monotonic() + HOLD_LIMIT  # held longer, requests fail: a condition, not a timing
    while True:  # until the ring is over half full, some requests are answered and others are held
        status = _status(server.dump)
        done = sum(f.done() for f in futures)
        if (status["admission"]["held_now"] > 0 and status["output_ring_fill"] > 0.5 and done > 0) \
                or time.monotonic() > deadline:
            break
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
    # the finish worker's own: present (its counters only grow; the gauges are 0 once all is published)
    assert {"sglang_hs:finish_wait_seconds_total", "sglang_hs:store_write_waits_total", "sglang_hs:finish_pending",
            "sglang_hs:store_wait_seconds_total", "sglang_hs:scatter_wait_seconds_total"} <= set(m), m


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


BATCH = 16  # prompts per batched /generate: 16 records of ~130 KB, twice the 1 MiB ring


def _status_now(dump):
    """The overlay's status file as it is (rewritten by its own thread, also while the scheduler is busy)."""
    return json.load(open(glob.glob(os.path.join(dump, "overlay-*.json"))[0]))


def _wait_status(dump, predicate, seconds):
    deadline = time.monotonic() + seconds
    while True:
        status = _status_now(dump)
        if predicate(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def _text(i):
    """36 to 42 words of the embedded corpus (about 45 to 60 tokens)."""
    words = open(os.path.join(os.path.dirname(sglang_hs.__file__), "data", "corpus.txt")).read().split()
    return " ".join(words[(i * 13) % 200:][: 36 + i % 7])


def _held_batch_then_slow_reader(server, body, rids, extra_rid, extra_prompt):
    """Send one batched /generate while nobody reads; once admission holds part of it, check the scheduler
    still answers, queue a single request behind it, then read one record at a time (each acknowledged
    before the next is taken, so the ring frees one record at a time). Returns the replies and records."""
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    before = _status_now(server.dump)
    with HiddenStateReader(str(server.dump), ack=True) as reader:
        pool = cf.ThreadPoolExecutor(2)
        batch = pool.submit(requests.post, f"{server.url}/generate", timeout=600,
                            json=dict(body, rid=rids, sampling_params=sp))
        # Nobody reads: the first members' records fill the ring and the rest must be held by admission
        # control, not let in to make the scheduler wait in publish until it gives up and drops records.
        status = _wait_status(server.dump, lambda s: (s["output_ring_fill"] > 0.5 and s["admission"]["held_now"] > 0)
                              or batch.done() or s["writer"]["dropped"] > before["writer"]["dropped"], 300)
        assert status["writer"]["dropped"] == before["writer"]["dropped"], f"records dropped: {status}"
        assert status["admission"]["held_now"] > 0, f"no member of the batch was held: {status}"
        assert status["output_ring_fill"] > 0.5 and not batch.done(), status
        # The scheduler keeps serving with the ring full and the batch held: /server_info is answered by the
        # scheduler itself.
        info = requests.get(f"{server.url}/server_info", timeout=120)
        assert info.status_code == 200 and info.json()["internal_states"], info.text
        assert not batch.done()
        # A single request arriving now queues behind the held members, and is served once they are.
        single = pool.submit(server.generate, input_ids=extra_prompt, rid=extra_rid, sampling_params=sp)
        got = {}
        wanted = set(rids) | {extra_rid}
        while set(got) != wanted:
            try:
                rec = reader.next(timeout=300)
            except TimeoutError as e:
                pytest.fail(f"{e}: {len(got)} of {len(wanted)} records arrived; {_status_now(server.dump)}\n"
                            f"{server.tail(30)}")
            if rec.rid in wanted:
                assert rec.rid not in got, f"record of {rec.rid} published twice"
                got[rec.rid] = rec
            reader.ack(rec)
        replies = batch.result(timeout=300)
        assert replies.status_code == 200, replies.text
        outs, single_out = replies.json(), single.result(timeout=300)
        assert reader.poll() == 0  # no second record of any of them
    after = _wait_status(server.dump, lambda s: s["writer"]["records"] - before["writer"]["records"] >= len(wanted), 30)
    assert after["writer"]["records"] - before["writer"]["records"] >= len(wanted), (before, after)
    assert after["writer"]["dropped"] == 0, after
    assert after["admission"]["failed"] == before["admission"]["failed"], after
    assert after["admission"]["admission_waits"] > before["admission"]["admission_waits"], after
    assert after["admission"]["held_now"] == 0, after
    return outs, single_out, got


def test_a_batch_of_pretokenized_prompts_is_admitted_member_by_member(batch_ring_server):
    server = batch_ring_server
    prompts = [_prompt(200 + i) for i in range(BATCH)]
    assert BATCH * record_bytes(PROMPT + NEW - 1, 4, 256, 2, 8) > RING  # the batch's records exceed the ring
    rids = [f"batch-ids-{i:02d}" for i in range(BATCH)]
    outs, single, got = _held_batch_then_slow_reader(server, {"input_ids": prompts}, rids, "single-behind-ids",
                                                    _prompt(299))
    assert len(outs) == BATCH
    for rid, p, out in zip(rids, prompts, outs):
        rec = got[rid]
        assert len(out["output_ids"]) == NEW
        assert rec.input_ids.tolist() == (p + out["output_ids"])[:-1], rid
        assert rec.aux_hidden_states.shape == (PROMPT + NEW - 1, 3, 256)
        assert rec.last_hidden_state.shape == (PROMPT + NEW - 1, 256)
        assert torch.isfinite(rec.aux_hidden_states.float()).all()
    rec = got["single-behind-ids"]
    assert rec.input_ids.tolist() == (_prompt(299) + single["output_ids"])[:-1]


def test_a_batch_of_text_prompts_is_admitted_member_by_member(batch_ring_server):
    server = batch_ring_server
    texts = [_text(i) for i in range(BATCH)]
    rids = [f"batch-text-{i:02d}" for i in range(BATCH)]
    outs, single, got = _held_batch_then_slow_reader(
        server, {"text": texts, "return_prompt_token_ids": True}, rids, "single-behind-text", _prompt(298))
    assert len(outs) == BATCH
    total = 0
    for rid, out in zip(rids, outs):
        rec, ids = got[rid], out["prompt_token_ids"]
        assert len(ids) > 20 and len(out["output_ids"]) == NEW
        assert rec.input_ids.tolist() == (ids + out["output_ids"])[:-1], rid
        assert rec.aux_hidden_states.shape == (len(ids) + NEW - 1, 3, 256)
        assert rec.last_hidden_state.shape == (len(ids) + NEW - 1, 256)
        assert torch.isfinite(rec.aux_hidden_states.float()).all()
        total += record_bytes(len(ids) + NEW - 1, 4, 256, 2, len(rid))
    assert total > RING  # the batch's records exceed the ring
    assert got["single-behind-text"].input_ids.tolist() == (_prompt(298) + single["output_ids"])[:-1]
