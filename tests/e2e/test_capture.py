"""Captured hidden states, read back by another process, against HF transformers and across scheduling.

This is the bf16 server users run, judged statistically; every row is judged on its own on float32
servers in test_exact_rows.py. Reference: HF `output_hidden_states` in float32 on the same generated checkpoint, for exactly the
tokens the record says were forwarded. Row error = ||got - ref|| / ||ref|| per token. Measured here:
median 0.007-0.010 for every layer and the final state (bf16 through MLA + MoE), 0.44-0.90 against
the neighbouring indices. A few rows are far off for a known reason: where MoE routing is a near tie
in the reference, bf16 (and the batch it runs in) picks the other expert group. Seen: a token whose
layer-6 group-selection margin is 0.0006 (median 0.08) had a final-state error of 0.39 in a batch of
16 while its layer 2/4/5 rows matched to 0.011; 4 of 300 rows in that run. So each record must have
median < 0.03 against its own index and median > 0.2 against i-1 and i+1 (this pins the layer
convention: an off-by-one fails), and, pooled over a test, at most 5% of rows may exceed 0.05.
"""
import concurrent.futures as cf

import pytest
import torch

from conftest import CHUNK
from sglang_hs import HiddenStateReader

pytestmark = pytest.mark.e2e
OWN_MEDIAN, OWN_P90, NEIGHBOUR_MEDIAN = 0.03, 0.05, 0.2
LAYERS, N_LAYERS = [2, 4, 5], 8


@pytest.fixture(scope="module")
def reader(capture_server, dump_dir):
    with HiddenStateReader(str(dump_dir)) as r:  # closed with the module: the dump's lock goes with it
        yield r


@pytest.fixture
def served(capture_server, reader):
    """(server, reader) of the bf16 capture server: what users run, judged statistically here. Every
    row is judged on its own on float32 servers, for both copy strategies (test_exact_rows.py)."""
    return capture_server, reader


def _rel(got, ref):
    return (got.float() - ref).norm(dim=-1) / ref.norm(dim=-1)


def check_against_hf(rec, hf, pooled=None):
    """Per-record checks; appends the record's row errors to `pooled` (see assert_pooled)."""
    hs = hf(rec.input_ids.tolist())
    errors = []
    for k, lid in enumerate(LAYERS):
        own = _rel(rec.aux_hidden_states[:, k], hs[lid])
        assert own.median() < OWN_MEDIAN, (rec.rid, lid, own)
        for j in (lid - 1, lid + 1):
            assert _rel(rec.aux_hidden_states[:, k], hs[j]).median() > NEIGHBOUR_MEDIAN, (rec.rid, lid, j)
        errors.append(own)
    last = _rel(rec.last_hidden_state, hs[N_LAYERS])
    assert last.median() < OWN_MEDIAN, (rec.rid, last)
    errors.append(last)
    if pooled is not None:
        pooled.append(torch.cat(errors))
    else:
        assert_pooled([torch.cat(errors)])


def assert_pooled(pooled):
    e = torch.cat(pooled)
    far = (e > OWN_P90).float().mean().item()
    print(f"{e.numel()} rows: median {e.median():.4f}, {100 * far:.1f}% above {OWN_P90}")
    assert far <= 0.05, f"{100 * far:.1f}% of rows above {OWN_P90}"


def _prompt(hf, text):
    return [hf.tok.bos_token_id] + hf.tok(text, add_special_tokens=False)["input_ids"]


TEXTS = [
    "Speculative decoding makes generation faster without changing its result. A small draft model "
    "proposes several tokens ahead, the large target model checks all of them in one forward pass, and "
    "every proposal the target agrees with is accepted for free.",
    "The scheduler groups requests into batches. A long prompt is cut into chunks so that one request",
    "Shared memory lets one process write and another read without copying through the kernel.",
    "Good tools are correct first, then fast, then pleasant to use.",
]


def test_manifest_records_the_convention(reader):
    m = reader.manifest
    assert m["layer_ids"] == LAYERS and m["last"] is True and m["hidden_size"] == 256
    assert m["hf_output_hidden_states_index"] == LAYERS + [N_LAYERS]
    assert m["num_hidden_layers"] == N_LAYERS and m["dtype"] == "bfloat16" and m["sglang_version"] == "0.5.23"
    assert "output_hidden_states[i]" in m["convention"]
    assert m["architecture"] == "DeepseekV3ForCausalLM" and m["copy"] == "direct"


def test_chunked_prefill_and_decode_rows_match_hf(served, hf):
    capture_server, reader = served
    ids = _prompt(hf, TEXTS[0])
    assert len(ids) > 2 * CHUNK
    out = capture_server.generate(input_ids=ids, rid="cap-decode", sampling_params={"max_new_tokens": 6, "temperature": 0})
    rec = reader.take("cap-decode", timeout=60)
    full = ids + out["output_ids"]
    assert rec.num_tokens == len(full) - 1 and rec.input_ids.tolist() == full[:-1]
    check_against_hf(rec, hf)


def test_prefill_only_request_has_one_row_per_prompt_token(served, hf):
    capture_server, reader = served
    ids = _prompt(hf, TEXTS[3])
    capture_server.generate(input_ids=ids, rid="cap-prefill", sampling_params={"max_new_tokens": 1, "temperature": 0})
    rec = reader.take("cap-prefill", timeout=60)
    assert rec.input_ids.tolist() == ids
    check_against_hf(rec, hf)


def test_radix_cache_prefix_rows_come_from_the_store(served, hf):
    """A 30+-token shared prefix and an exact repeat: the server does not forward the cached tokens,
    yet every record is complete and right, because prefix rows are read from the store by KV slot."""
    capture_server, reader = served
    prefix = _prompt(hf, TEXTS[0])[:32]
    assert len(prefix) == 32
    a = prefix + _prompt(hf, " first ending about batches")[1:]
    b = prefix + _prompt(hf, " a different ending entirely, longer than the first one")[1:]
    sp = {"max_new_tokens": 3, "temperature": 0}
    out_a = capture_server.generate(input_ids=a, rid="radix-a", sampling_params=sp)
    out_b = capture_server.generate(input_ids=b, rid="radix-b", sampling_params=sp)
    out_a2 = capture_server.generate(input_ids=a, rid="radix-a-again", sampling_params=sp)
    assert out_b["meta_info"]["cached_tokens"] >= 30 and out_a2["meta_info"]["cached_tokens"] >= len(a) - 1
    recs = {rid: reader.take(rid, timeout=60) for rid in ("radix-a", "radix-b", "radix-a-again")}
    pooled = []
    for rid, ids, out in (("radix-a", a, out_a), ("radix-b", b, out_b), ("radix-a-again", a, out_a2)):
        full = ids + out["output_ids"]
        assert recs[rid].input_ids.tolist() == full[:-1]
        check_against_hf(recs[rid], hf, pooled)
    assert_pooled(pooled)
    n = len(a)
    assert torch.equal(recs["radix-a"].aux_hidden_states[:n], recs["radix-a-again"].aux_hidden_states[:n])


def test_concurrent_requests_each_get_their_own_rows(served, hf):
    capture_server, reader = served
    jobs = []
    for i in range(16):
        text = TEXTS[i % 4][: 30 + 7 * i]
        jobs.append((f"conc-{i}", _prompt(hf, text), 1 + i % 4))
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda j: capture_server.generate(
            input_ids=j[1], rid=j[0], sampling_params={"max_new_tokens": j[2], "temperature": 0}), jobs))
    pooled = []
    for (rid, ids, _), out in zip(jobs, outs):
        rec = reader.take(rid, timeout=60)
        full = ids + out["output_ids"]
        assert rec.input_ids.tolist() == full[:-1], rid
        check_against_hf(rec, hf, pooled)
    assert_pooled(pooled)


def test_same_records_with_scheduling_features_off(capture_server, reader, plain_sched_server, plain_dump_dir, hf):
    """No chunking, no radix cache, no overlap scheduler: identical ids and row counts, and
    values within bf16 tolerance of the capture server's (chunked, radix, overlap) records."""
    pooled = []
    with HiddenStateReader(str(plain_dump_dir)) as plain:  # closed at once: test_load reads that dump later
        for i, text in enumerate(TEXTS):
            ids = _prompt(hf, text)
            sp = {"max_new_tokens": 1, "temperature": 0}
            capture_server.generate(input_ids=ids, rid=f"sched-{i}", sampling_params=sp)
            plain_sched_server.generate(input_ids=ids, rid=f"sched-{i}", sampling_params=sp)
            r1, r2 = reader.take(f"sched-{i}", timeout=60), plain.take(f"sched-{i}", timeout=60)
            assert torch.equal(r1.input_ids, r2.input_ids)
            assert r1.aux_hidden_states.shape == r2.aux_hidden_states.shape
            diff = _rel(r1.aux_hidden_states, r2.aux_hidden_states.float())
            assert diff.median() < OWN_MEDIAN, diff
            check_against_hf(r2, hf, pooled)
    assert_pooled(pooled)
