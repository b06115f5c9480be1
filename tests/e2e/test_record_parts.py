"""Records in parts (--hs-record-part-size, issue 47 item 2's writer half) on the real CPU server.

One float32 server (module scope): the embedded tiny DeepSeek-V3, both final states (5 rows of 256 floats a token,
5,120 bytes), records of more than PART_ROWS rows leave the output ring in parts of PART_ROWS rows, an output ring of
RING bytes (room for six requests' reservations, each twice a first part; smaller than any one record of the
workload), a KV pool of POOL tokens of which the captured requests in flight may hold HOLD_BUDGET (the pool less one
full-context request: three requests of the workload at once), chunked
prefill of CHUNK tokens, radix cache and overlap scheduler on. A record in parts is gathered part by part as the
reader makes room, its request's KV slots held until its last part is gathered (and those of every request finished
behind it): SGLang counts them as used and queues new requests instead of a forward step waiting for the reader.

- A stalled reader: the requests of the workload finish (or wait in SGLang's queue) while nothing is read; the
  status shows records in parts and held requests, and no forward copy waited for a gather (`write_waits` 0: the
  held slots were never handed out again). Then the reader reads: every record whole (its parts assembled), every
  row of every record within TOL of HF float32, nothing dropped, nothing left held.
- A reader with part_bytes reads the same workload's records chunk by chunk as their parts arrive (never whole):
  every row against HF float32.

Planted (scratch copies): the hold off (hold_finished_kv's release made at once) -> forward copies wait for the
parts' gathers (write_waits > 0) and the first test fails.
"""
import concurrent.futures as cf

import pytest
import torch

import row_judge
from conftest import CHUNK, _serve
from helpers import settled, status_when
from sglang_hs import HiddenStateReader

pytestmark = pytest.mark.e2e
LAYERS, N_LAYERS, HIDDEN = [2, 4, 5], 8, 256
ROW_BYTES = (len(LAYERS) + 2) * HIDDEN * 4  # float32, --hs-last both
PART_ROWS = 8
RING = 512 << 10  # reservations (twice a first part) for 6 requests; less than two records of the workload
POOL = 1024
CONTEXT = 512
HOLD_BUDGET = POOL - CONTEXT  # tokens the captured requests in flight may hold after they finish (admission)
NEW_TOKENS = 8
SYSTEM = ("You are a careful assistant for a hardware store. Answer briefly, name the aisle and the price. "
          "Customers ask about nails, screws, hinges, paint, brushes, ladders, cables and garden tools; when an item "
          "is out of stock, say when the next delivery comes and suggest the nearest thing we do have on the shelf. "
          "Never guess a price: read it from the catalogue, and round to the cent. Keep every answer to two lines.")


@pytest.fixture(scope="module")
def parts_server(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("hs-parts") / "dump",
                      ["--dtype", "float32", "--hs-last", "both", "--chunked-prefill-size", str(CHUNK),
                       "--max-total-tokens", str(POOL), "--context-length", str(CONTEXT), "--enable-metrics",
                       "--hs-record-part-size", str(PART_ROWS * ROW_BYTES), "--hs-ring-size", str(RING)])


def _jobs(hf, prefix, n):
    """n requests (rid, prompt ids) of a shared system prompt (radix hits) and a question of their own, each
    record longer than two parts."""
    jobs = []
    for i in range(n):
        ids = row_judge.prompt_ids(hf, SYSTEM) + row_judge.prompt_ids(hf, f" Question {i}: where are {i * 7} nails?")[1:]
        jobs.append((f"{prefix}-{i}", ids))
    return jobs


def _send(server, job):
    rid, ids = job
    out = server.generate(input_ids=ids, rid=rid, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
    return rid, (ids + out["output_ids"])[:-1]


def _judge(rec, hf, want):
    return row_judge.assert_exact(rec, hf, want, LAYERS, N_LAYERS, HIDDEN)


def test_a_stalled_reader_holds_kv_slots_not_forward_steps(parts_server, hf):
    server = parts_server
    before = settled(server)["writer"]
    jobs = _jobs(hf, "stalled", 6)
    assert all((len(ids) + NEW_TOKENS - 1) * ROW_BYTES > RING for _, ids in jobs)  # no record fits the ring whole
    assert sum(len(ids) + NEW_TOKENS for _, ids in jobs) > HOLD_BUDGET  # not all admitted at once: the hold budget
    with HiddenStateReader(str(server.dump), ack=True) as reader, cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_send, server, job) for job in jobs]
        # nothing read: the ring fills with the first record's parts, the rest wait with their requests' KV held
        stalled = status_when(server, lambda s: s["writer"]["held_requests"] >= 2
                              and s["writer"]["parts"] > before["parts"], timeout=300)["writer"]
        assert stalled["held_tokens"] > 0 and stalled["write_waits"] == before["write_waits"], stalled
        recs = {}
        for rid, _ in jobs:  # the reader catches up: each record whole, its ring room given back as it goes
            recs[rid] = reader.take(rid, timeout=300)
            reader.ack(recs[rid])
        done = dict(f.result(timeout=300) for f in futures)
    worst = max(_judge(recs[rid], hf, want) for rid, want in done.items())
    after = settled(server, until=lambda s: s["writer"]["held_requests"] == 0)["writer"]
    assert after["write_waits"] == before["write_waits"], (before, after)  # no forward ever waited for a gather
    assert after["records"] == before["records"] + len(jobs) and after["dropped"] == before["dropped"], after
    assert after["parts"] - before["parts"] >= 3 * len(jobs) and after["held_tokens"] == 0, after
    assert after["part_wait_s"] > before["part_wait_s"], after  # the parts waited for the reader, not the forwards
    print(f"\n{len(jobs)} records in {after['parts'] - before['parts']} parts through a {RING}-byte ring, "
          f"{stalled['held_requests']} requests ({stalled['held_tokens']} slots) held while the reader stalled; "
          f"worst row {worst:.2e}")


def test_a_reader_with_part_bytes_reads_records_as_their_parts_arrive(parts_server, hf):
    server = parts_server
    before = settled(server)["writer"]
    jobs = _jobs(hf, "streamed", 4)
    with HiddenStateReader(str(server.dump), ack=True, part_bytes=PART_ROWS * ROW_BYTES // 2) as reader, \
            cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_send, server, job) for job in jobs]
        got = {}
        for _ in jobs:
            rec = reader.next(timeout=300)
            chunks = list((c.input_ids.clone(), c.aux_hidden_states.clone(), c.last_hidden_state.clone(),
                           c.last_pre_norm.clone()) for c in reader.chunks(rec))
            assert len(chunks) >= 2 * 3, (rec.rid, len(chunks))  # read a half part at a time, never whole
            ids, aux, last, pre = (torch.cat(x) for x in zip(*chunks))
            got[rec.rid] = row_judge.Whole(rec.rid, ids, aux, last, pre)
            reader.ack(rec)
        done = dict(f.result(timeout=300) for f in futures)
    worst = max(_judge(got[rid], hf, want) for rid, want in done.items())
    after = settled(server, until=lambda s: s["writer"]["held_requests"] == 0)["writer"]
    assert after["records"] == before["records"] + len(jobs) and after["dropped"] == before["dropped"], after
    print(f"\n{len(jobs)} records read in chunks as their parts arrived; worst row {worst:.2e}")
