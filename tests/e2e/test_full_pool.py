"""Exact records with the KV pool full, as a production server runs (issue 32, item 3).

A production server keeps its KV pool full: the radix cache holds every finished prefix until eviction
makes room for the next request. Here two float32 servers (tests/e2e/conftest.py) have a pool of POOL
tokens, and a stream of concurrent requests several times its size, in waves, keeps it full: three
shared system prompts with a distinct question each (prefix hits), exact repeats of earlier prompts
(whole-prompt hits, or misses once their prefix was evicted), chunked prefill, the overlap scheduler on
and the finish worker slowed (_slow_finish: gathers still pending when their slots are freed and
handed out again). SGLang's own eviction counter (sglang:evicted_tokens_total, /metrics) must show the
radix cache evicting many times over, so the tests cannot pass on an idle pool.

- float32_pool_server (the exact oracle's direct-copy server, test_exact_rows.py, shared): every request
  captured, --hs-copy direct; every row of every record, both final states, judged against HF float32
  (row_judge, TOL).
- full_pool_opt_in_server: --hs-capture opt-in, --hs-copy staging with an 8-row stage; most requests
  are not captured (each leaves a marker, reason not_opted_in), a few opt in and are judged row by row.
"""
import concurrent.futures as cf

import pytest
import requests

import row_judge
from helpers import settled
from sglang_hs.status import metrics
from conftest import POOL
from sglang_hs import HiddenStateReader, NotCaptured

pytestmark = pytest.mark.e2e
LAYERS, N_LAYERS = [2, 4, 5], 8
WAVES, PER_WAVE, REPEATS = 4, 8, 2  # REPEATS of each wave's requests repeat a prompt of the wave before
NEW_TOKENS = 6
SYSTEMS = ("You are a careful assistant for a hardware store. Answer briefly and name the aisle.",
           "System: the user is learning to cook. Explain each step plainly, with quantities in grams.",
           "Instructions: translate the question into formal English, then answer it in one sentence.")


def _workload(hf):
    """WAVES waves of PER_WAVE jobs (rid, prompt ids): a system prompt + a question of its own, and in
    every wave but the first REPEATS exact repeats of prompts from the wave before."""
    waves, n = [], 0
    for w in range(WAVES):
        wave = []
        for i in range(PER_WAVE - (REPEATS if w else 0)):
            ids = row_judge.prompt_ids(hf, SYSTEMS[n % 3]) + row_judge.prompt_ids(hf, f" Question {n}: why {n * 7}?")[1:]
            wave.append((f"fp-{w}-{i}", ids))
            n += 1
        if w:
            wave += [(f"fp-{w}-again-{k}", waves[-1][k][1]) for k in range(REPEATS)]
        waves.append(wave)
    return waves


def _metric(server, name):
    """Sum over label sets of SGLang's Prometheus sample `name` (0 when absent)."""
    return metrics(server.url, prefix="sglang:").get(name, 0.0)


def _run(server, hf, opted_in):
    """Send the workload wave by wave (each wave's requests at once); returns ([(rid, ids, out)], evicted
    tokens, eviction passes) and checks the pool was full: the radix cache evicted many pools' worth, in
    many passes, and both prefix hits and misses happened."""
    info = requests.get(f"{server.url}/server_info", timeout=60).json()
    assert info["disable_overlap_schedule"] is False, "the overlap scheduler must be on"
    assert info["max_total_num_tokens"] <= POOL + 16, info["max_total_num_tokens"]  # the pool is POOL (+ a page)
    evicted0 = _metric(server, "sglang:evicted_tokens_total")
    passes0 = _metric(server, "sglang:eviction_duration_seconds_count")
    done = []
    for wave in _workload(hf):
        def send(job):
            rid, ids = job
            sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
            if rid in opted_in:
                sp["custom_params"] = {"hs_capture": True}
            return rid, ids, server.generate(input_ids=ids, rid=rid, sampling_params=sp)

        with cf.ThreadPoolExecutor(len(wave)) as pool:
            done += list(pool.map(send, wave))
    evicted = _metric(server, "sglang:evicted_tokens_total") - evicted0
    passes = _metric(server, "sglang:eviction_duration_seconds_count") - passes0
    sent = sum(len(ids) + len(out["output_ids"]) for _, ids, out in done)
    cached = [out["meta_info"]["cached_tokens"] for _, _, out in done]
    print(f"\n{len(done)} requests, {sent} tokens through a {POOL}-token pool: {evicted:.0f} tokens evicted in "
          f"{passes:.0f} passes; cached tokens per request {cached}")
    assert sent > 8 * POOL
    # Full: SGLang evicts only when the free list cannot hold an allocation; every few steps, not once.
    assert evicted >= 4 * POOL and passes >= WAVES * 2, (evicted, passes)
    # hits and misses (a miss may still find the BOS every prompt starts with: the server is shared with
    # test_exact_rows.py, whose prompts start with it too)
    assert sum(c >= 16 for c in cached) >= WAVES and sum(c <= 1 for c in cached) >= 1, cached
    return done


def _judge(rec, hf, want_ids):
    return row_judge.assert_exact(rec, hf, want_ids, LAYERS, N_LAYERS, 256)


def test_every_record_exact_with_the_pool_full(float32_pool_server, hf):
    """Every request captured (--hs-copy direct): every row of every record within TOL of HF float32 while
    the radix cache evicts every few steps; nothing dropped, failed or left pending."""
    server = float32_pool_server
    reader = HiddenStateReader(str(server.dump))
    try:
        assert reader.manifest["dtype"] == "float32" and reader.manifest["copy"] == "direct"
        before = settled(server)["writer"]  # earlier requests all counted: the baseline
        done = _run(server, hf, opted_in=set())
        worst = max(_judge(reader.take(rid, timeout=60), hf, (ids + out["output_ids"])[:-1]) for rid, ids, out in done)
        after = settled(server)["writer"]
        assert after["records"] == before["records"] + len(done) and after["finish_pending"] == 0, (before, after)
        assert after["dropped"] == before["dropped"] and after["finish_failed"] == 0, after
        print(f"{len(done)} records exact, worst row {worst:.2e}")
    finally:
        reader.close()


def test_opt_in_markers_and_the_few_captured_exact_with_the_pool_full(full_pool_opt_in_server, hf):
    """--hs-capture opt-in, --hs-copy staging: one request in eight opts in; each is exact row by row, every
    other request has its marker (not_opted_in) and no record, with the pool full as above."""
    server = full_pool_opt_in_server
    reader = HiddenStateReader(str(server.dump))
    try:
        assert reader.manifest["copy"] == "staging"
        before = settled(server)["writer"]  # earlier requests all counted: the baseline
        opted_in = {rid for w, wave in enumerate(_workload(hf)) for rid, _ in wave[w % 3::PER_WAVE]}
        done = _run(server, hf, opted_in)
        assert 0 < len(opted_in) < len(done) / 4
        worst = 0.0
        for rid, ids, out in done:
            if rid in opted_in:
                worst = max(worst, _judge(reader.take(rid, timeout=60), hf, (ids + out["output_ids"])[:-1]))
            else:
                with pytest.raises(NotCaptured) as e:
                    reader.take(rid, timeout=60)
                assert e.value.reason == "not_opted_in", (rid, e.value.reason)
        assert not [r for r in reader.ready_rids() if r.startswith("fp-")]
        after = settled(server)["writer"]
        assert after["records"] == before["records"] + len(opted_in) and after["finish_pending"] == 0, (before, after)
        assert after["dropped"] == before["dropped"] and after["finish_failed"] == 0, after
        print(f"{len(opted_in)} captured records exact (worst row {worst:.2e}), "
              f"{len(done) - len(opted_in)} markers")
    finally:
        reader.close()
