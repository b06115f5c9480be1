"""Request ids as any HTTP client may send them, on the real CPU server (the session's bf16 capture
server). A rid longer than a record header can name (65,535 bytes of utf-8) is refused with a 400 naming
the limit, through /generate, as a member of a batched /generate and through the OpenAI endpoint; no record
is left for it, and the server keeps serving: the next request's record is exact (its token ids, its rows
against HF transformers). Before the fix the scheduler stopped (struct.error after the ring's sequence
number moved) and every later reader refused the ring."""
import pytest
import requests

from helpers import settled
from test_capture import _prompt, check_against_hf
from sglang_hs import HiddenStateReader

pytestmark = pytest.mark.e2e
LONG = 70_000  # bytes


@pytest.fixture(scope="module")
def reader(capture_server, dump_dir):
    with HiddenStateReader(str(dump_dir)) as r:
        yield r


def _served_exactly(server, reader, hf, rid, text):
    ids = _prompt(hf, text)
    out = server.generate(input_ids=ids, rid=rid, sampling_params={"max_new_tokens": 3, "temperature": 0})
    rec = reader.take(rid, timeout=120)
    assert rec.input_ids.tolist() == (ids + out["output_ids"])[:-1] and rec.output_ids == out["output_ids"]
    check_against_hf(rec, hf)


def _refused(reply):
    assert reply.status_code == 400, (reply.status_code, reply.text[:300])
    assert "at most 65535 bytes" in reply.text and len(reply.text) < 2000, reply.text[:300]


def test_a_rid_too_long_for_a_record_is_refused_and_the_server_serves_on(capture_server, reader, hf):
    server = capture_server
    long_rid = "L" * LONG
    ids = _prompt(hf, "Good tools are correct first.")
    _refused(requests.post(f"{server.url}/generate", timeout=300, json={
        "input_ids": ids, "rid": long_rid, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}))
    _served_exactly(server, reader, hf, "after-long-rid", "Shared memory lets one process write and another read.")
    # a batch with one such member: the request is refused with the same reason, every member with it
    reply = requests.post(f"{server.url}/generate", timeout=300, json={
        "input_ids": [ids, ids[:-1]], "rid": ["batch-short", "B" * LONG],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    _refused(reply)
    # the OpenAI endpoint takes the client's rid too (protocol.py CompletionRequest.rid)
    _refused(requests.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": "default", "prompt": ids, "max_tokens": 2, "temperature": 0, "rid": "C" * LONG}))
    _served_exactly(server, reader, hf, "after-long-rids", "The scheduler groups requests into batches.")
    settled(server)  # every request answered so far is published: one poll is an absence check now
    reader.poll()
    assert not [r for r in reader.ready_rids() if len(r) > 1000]  # no record under a refused rid
    # the refused batch's short member never ran: no record and no marker (its client got the 400)
    assert "batch-short" not in reader.ready_rids() and reader.not_captured("batch-short") is None
    assert "struct.error" not in server.output and "finish worker failed" not in server.output
