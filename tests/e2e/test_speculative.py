"""Capture on a server that decodes speculatively (issue 44): SGLang's NGRAM drafter on the CPU engine.

Each decode step of such a server is a verify pass: one forward of the target over a tree of 12 draft
tokens per request (written at KV slots of the request's draft window, rows included), after which the
accepted drafts' KV is moved to the front of the window and the rest is dropped. A record must hold
exactly the rows of the tokens the request ends with, each the row a plain forward of that sequence
gives: every row is judged against HF transformers float32 (tests/e2e/row_judge.py) on the token ids
the server sent. How drafts get accepted with a tiny random model: n-gram drafting needs no draft model,
only text that repeats, and the tiny model's greedy continuations fall into short loops of their own,
which the n-gram corpus then proposes; SGLang's own per-request counters (meta_info spec_*) show that
drafts were accepted and rejected in the judged requests, and the overlay's status that rows followed
KV moves (`moved_rows`), i.e. that accepted drafts were not all at the front of the tree.
"""
import concurrent.futures as cf
import json

import pytest
import requests

import row_judge
from helpers import settled
from sglang_hs import HiddenStateReader

pytestmark = pytest.mark.e2e
LAYERS, N_LAYERS, H = [2, 4, 5], 8, 256
GREEDY = {"temperature": 0}
TEXTS = ("one two three four five six seven eight. " * 5,
         "The cat sat on the mat and the dog sat on the log. " * 4,
         "Speculative decoding proposes tokens; the target checks them in one pass. " * 3,
         "a b c d e f g a b c d e f g a b c d e f g a b c d")


@pytest.fixture(scope="module")
def served(ngram_server):
    reader = HiddenStateReader(str(ngram_server.dump))
    assert reader.manifest["dtype"] == "float32" and reader.manifest["rows_per_token"] == 5
    yield ngram_server, reader
    reader.close()


def _exact(rec, hf, want):
    return row_judge.assert_exact(rec, hf, want, LAYERS, N_LAYERS, H)


def _drafts(meta):
    """(verify passes, drafts accepted, drafts proposed) of one request, from SGLang's own counters."""
    return meta["spec_verify_ct"], meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"]


def test_concurrent_speculative_requests_are_exact_row_for_row(served, hf):
    """Four requests at once (prompts of 25-60 tokens, chunked at 16), 48 greedy tokens each: every row of
    every record exact, drafts accepted and rejected in each, and rows moved after KV."""
    server, reader = served
    before = settled(server)["writer"]
    jobs = [(f"spec-{i}", row_judge.prompt_ids(hf, text)) for i, text in enumerate(TEXTS)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: server.generate(input_ids=j[1], rid=j[0], sampling_params={
            "max_new_tokens": 48, **GREEDY}), jobs))
    for (rid, ids), out in zip(jobs, outs):
        verifies, accepted, proposed = _drafts(out["meta_info"])
        assert verifies > 0 and 0 < accepted < proposed, (rid, out["meta_info"])  # both kinds in this record
        rec = reader.take(rid, timeout=60)
        assert rec.prompt_len == len(ids)
        _exact(rec, hf, (ids + out["output_ids"])[:-1])
    after = settled(server)["writer"]
    assert after["moved_rows"] > before["moved_rows"], (before, after)  # accepted drafts off the tree's front


def test_radix_hit_stop_string_stream_and_logprobs(served, hf):
    """A prompt served from the radix cache then decoded speculatively; a stop string that ends the output
    inside a verify's accepted run; a streamed request; prompt and output logprobs."""
    server, reader = served
    ids = row_judge.prompt_ids(hf, TEXTS[0])
    first = server.generate(input_ids=ids, rid="spec-warm", sampling_params={"max_new_tokens": 24, **GREEDY})
    _exact(reader.take("spec-warm", timeout=60), hf, (ids + first["output_ids"])[:-1])
    again = server.generate(input_ids=ids, rid="spec-hit", sampling_params={"max_new_tokens": 40, **GREEDY})
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 1, again["meta_info"]
    assert again["output_ids"][:24] == first["output_ids"]  # greedy: speculation changes nothing
    _exact(reader.take("spec-hit", timeout=60), hf, (ids + again["output_ids"])[:-1])
    # prompt logprobs from the start: SGLang computes the whole prompt again (no cache hit), then verifies
    lp = server.generate(input_ids=ids, rid="spec-logprob", sampling_params={"max_new_tokens": 40, **GREEDY},
                         return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    assert len(lp["meta_info"]["output_token_logprobs"]) == 40 and lp["output_ids"] == again["output_ids"]
    _exact(reader.take("spec-logprob", timeout=60), hf, (ids + lp["output_ids"])[:-1])
    # stop at the second occurrence of a word the greedy output repeats: inside an accepted run
    words = hf.tok.decode(again["output_ids"]).split()
    stop = next(w for w in words if words.count(w) > 1)
    out = server.generate(input_ids=ids, rid="spec-stop", sampling_params={"max_new_tokens": 40, "stop": [stop],
                                                                           **GREEDY})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    rec = reader.take("spec-stop", timeout=60)
    assert rec.input_ids.tolist() == (ids + out["output_ids"])[: rec.num_tokens]
    _exact(rec, hf, rec.input_ids.tolist())
    r = requests.post(f"{server.url}/generate", stream=True, timeout=300, json={
        "input_ids": ids[:30], "rid": "spec-stream", "stream": True,
        "sampling_params": {"max_new_tokens": 32, **GREEDY}})
    chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line and line.startswith("data: {")]
    assert r.status_code == 200 and chunks
    rec = reader.take("spec-stream", timeout=60)
    assert rec.input_ids.tolist()[:30] == ids[:30] and rec.num_tokens == 30 + 32 - 1
    _exact(rec, hf, rec.input_ids.tolist())
    settled(server)
    reader.poll()
    assert reader.ready_rids() == []
