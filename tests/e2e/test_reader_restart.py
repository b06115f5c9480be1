"""The small-ring server without a time limit on holding (float32, a 2 MiB ring, --hs-admission-timeout 0,
text batches sent to the scheduler as one batched message like pre-tokenized ones): whatever the reader
does, held requests wait for it, and every record is judged row for row against HF float32.

1. A reader process killed mid-run and restarted resumes from the ring: with acknowledged reading
   (HiddenStateReader(ack=True), acking after each record is saved) every finished request ends up saved
   exactly once across both runs, complete and in order, while the server keeps serving (its small ring
   fills while no reader runs, and admission control holds new requests until the new reader catches up).
   The consumer acknowledges out of order (pairs reversed, ack_consumer.py) and is killed between the two
   acks of a pair: the record it acknowledged (B) must not release the one before it (A), not yet saved;
   the new reader gets A and B again, B identical to what was saved.
2. A `/generate` with a list of prompts (one batched message to the scheduler) is admitted member by
   member like single requests, while a slow reader frees the ring one record at a time."""
import concurrent.futures as cf
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import requests
import torch

import row_judge
import sglang_hs
import sglang_hs.status
from helpers import serving, settled, status_when
from sglang_hs import HiddenStateReader
from sglang_hs.server.store.ring import record_bytes

pytestmark = pytest.mark.e2e
N = 40
CONSUMER = os.path.join(os.path.dirname(__file__), "ack_consumer.py")
LAYERS, N_LAYERS, H, P, ELEM = [2, 4, 5], 8, 256, 4, 4  # float32: 3 aux layers + the final state
RING = 2 << 20
CONTEXT = 200  # the ring holds one record of a request at the maximal context (twice, as admission reserves)


@pytest.fixture(scope="module")
def small_ring_server(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hs-small-ring") / "dump"
    assert 2 * record_bytes(CONTEXT, P, H, ELEM, 64) < RING
    # ~8 records of ~100 tokens fit: the ring fills within a second or two of the reader dying
    yield from serving(dump, ["--dtype", "float32", "--hs-last", "--hs-ring-size", str(RING),
                              "--hs-admission-timeout", "0", "--enable-tokenizer-batch-encode",
                              "--context-length", str(CONTEXT), "--chunked-prefill-size", "64"])


def _exact(rec, hf, want_ids):
    return row_judge.assert_exact(rec, hf, want_ids, LAYERS, N_LAYERS, H)


def _consumer(server, out, log):
    return subprocess.Popen([sys.executable, CONSUMER, str(server.dump), str(out), str(log), "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _log(log):
    """The consumer's complete log lines, split."""
    if not os.path.exists(log):
        return []
    text = open(log).read()
    return [line.split() for line in text[: text.rfind("\n") + 1].splitlines()]


def _mid_pair(entries):
    """(A, B) when the consumer's last step acknowledged B, saved after A, the record before it, which it
    holds and has not saved; else None."""
    if len(entries) >= 3 and entries[-3][0] == "hold" and entries[-2][0] == "saved" and entries[-1][0] == "acked":
        a, b = entries[-3][1], entries[-1][1]
        if entries[-2][1] == b != a:
            return a, b
    return None


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _kill_between_the_acks_of_a_pair(proc, log, timeout=120):
    """SIGKILL the consumer at a moment it has acknowledged B and not yet saved A (after 8 records saved).
    It is stopped first, so the log read is its final state. Returns (A, B)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the consumer never acknowledged out of order"
        entries = _log(log)
        pair = _mid_pair(entries) if sum(e[0] == "saved" for e in entries) >= 8 else None
        if pair:
            proc.send_signal(signal.SIGSTOP)
            while not _stopped(proc.pid):
                time.sleep(0.001)
            if _mid_pair(_log(log)) == pair:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                return pair
            proc.send_signal(signal.SIGCONT)  # it moved on meanwhile: the next pair
        time.sleep(0.005)


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def test_reader_killed_and_restarted_saves_every_request_exactly_once(small_ring_server, tmp_path, hf):
    server, out, log = small_ring_server, tmp_path / "out", tmp_path / "log"
    out.mkdir()
    rng = random.Random(3)
    reqs = [(f"restart-{i:02d}", [rng.randint(5, 1000) for _ in range(rng.randint(5, CONTEXT - 10))],
             rng.choice([1, 8])) for i in range(N)]
    first = _consumer(server, out, log)
    _wait(lambda: _log(log), 60, lambda: "the first consumer did not start")

    def send(req):
        rid, ids, gen = req
        reply = server.generate(input_ids=ids, rid=rid, sampling_params={"max_new_tokens": gen, "temperature": 0,
                                                                          "ignore_eos": True})
        return rid, ids + reply["output_ids"][:-1]

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send, r) for r in reqs]
        held, acked = _kill_between_the_acks_of_a_pair(first, log)
        # the server goes on serving with no reader: the ring fills, admission holds the rest
        status_when(server, lambda s: s["admission"]["held_now"] > 0, timeout=300)
        second = _consumer(server, out, log)
        try:
            expected = dict(f.result(timeout=300) for f in futures)
            _wait(lambda: len(list(out.glob("*.pt"))) == N, 120,
                  lambda: f"saved {len(list(out.glob('*.pt')))} of {N}; never saved: "
                          f"{sorted(set(r[0] for r in reqs) - {p.stem for p in out.glob('*.pt')})}")
        finally:
            second.send_signal(signal.SIGKILL)
            second.wait(30)

    assert "admission waiting" in server.output  # the ring filled while no reader ran; requests were held
    entries = _log(log)
    starts = [i for i, e in enumerate(entries) if e[0] == "start"]
    assert len(starts) == 2
    handled1 = [e for e in entries[: starts[1]] if e[0] in ("saved", "repeat")]
    handled2 = [e for e in entries[starts[1] + 1:] if e[0] in ("saved", "repeat")]
    assert [e[0] for e in handled1] == ["saved"] * len(handled1) and handled1[-1][1] == acked
    # The new reader starts with the pair the first was in the middle of: A, held and not saved, and B,
    # saved and acknowledged after it, whose ack had to wait for A's (the consumer handles B first again).
    assert [e[1] for e in handled2[:2]] == [acked, held], handled2[:3]
    assert handled2[0] == ["repeat", acked, "same"]  # delivered again, identical to the file it saved
    repeats = [e for e in handled2 if e[0] == "repeat"]
    assert all(e[2] == "same" for e in repeats) and {e[1] for e in repeats} <= {held, acked}, repeats
    # A may have been renamed into place just before the kill, its log line not yet written: a repeat then.
    saved1 = [e[1] for e in handled1] + [e[1] for e in repeats if e[1] == held]
    saved2 = [e[1] for e in handled2 if e[0] == "saved"]
    assert sorted(saved1 + saved2) == sorted(expected)  # each request saved exactly once, none lost
    for rid, ids in expected.items():
        saved = torch.load(out / f"{rid}.pt")
        rec = SimpleNamespace(rid=rid, input_ids=saved["input_ids"], aux_hidden_states=saved["aux"],
                              last_hidden_state=saved["last"], last_pre_norm=None)
        _exact(rec, hf, ids)  # every row of what the consumers saved, against HF float32


BATCH = 16  # prompts per batched /generate: 16 float32 records of ~250 KB, twice the 2 MiB ring
PROMPT, NEW = 60, 4


def _prompt(i):
    return [5 + (i * 31 + j * 7) % 900 for j in range(PROMPT)]


def _text(i):
    """36 to 42 words of the embedded corpus (about 45 to 60 tokens)."""
    words = open(os.path.join(os.path.dirname(sglang_hs.__file__), "data", "corpus.txt")).read().split()
    return " ".join(words[(i * 13) % 200:][: 36 + i % 7])


def _held_batch_then_slow_reader(server, body, rids, extra_rid, extra_prompt):
    """Send one batched /generate while nobody reads; once admission holds part of it, check the scheduler
    still answers, queue a single request behind it, then read one record at a time (each acknowledged
    before the next is taken, so the ring frees one record at a time). Returns the replies and records."""
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    before = settled(server)  # earlier tests' requests all counted: the baseline
    with HiddenStateReader(str(server.dump), ack=True) as reader, cf.ThreadPoolExecutor(2) as pool:
        batch = pool.submit(requests.post, f"{server.url}/generate", timeout=600,
                            json=dict(body, rid=rids, sampling_params=sp))
        # Nobody reads: the first members' records fill the ring and the rest must be held by admission
        # control, not let in to make the scheduler wait in publish until it gives up and drops records.
        status = status_when(server, lambda s: (s["output_ring_fill"] > 0.5 and s["admission"]["held_now"] > 0)
                             or batch.done() or s["writer"]["dropped"] > before["writer"]["dropped"], timeout=300)
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
                pytest.fail(f"{e}: {len(got)} of {len(wanted)} records arrived; {sglang_hs.status.read(server.dump)}"
                            f"\n{server.tail(30)}")
            if rec.rid in wanted:
                assert rec.rid not in got, f"record of {rec.rid} published twice"
                got[rec.rid] = rec
            reader.ack(rec)
        replies = batch.result(timeout=300)
        assert replies.status_code == 200, replies.text
        outs, single_out = replies.json(), single.result(timeout=300)
        after = settled(server)  # every reply is in: nothing more is coming
        assert reader.poll() == 0  # no second record of any of them
    w, w0 = after["writer"], before["writer"]
    assert w["records"] - w0["records"] == len(wanted) and w["dropped"] == 0, (before, after)
    assert after["admission"]["failed"] == before["admission"]["failed"], after
    assert after["admission"]["admission_waits"] > before["admission"]["admission_waits"], after
    assert after["admission"]["held_now"] == 0, after
    return outs, single_out, got


def test_a_batch_of_pretokenized_prompts_is_admitted_member_by_member(small_ring_server, hf):
    server = small_ring_server
    prompts = [_prompt(200 + i) for i in range(BATCH)]
    assert BATCH * record_bytes(PROMPT + NEW - 1, P, H, ELEM, 12) > RING  # the batch's records exceed the ring
    rids = [f"batch-ids-{i:02d}" for i in range(BATCH)]
    outs, single, got = _held_batch_then_slow_reader(server, {"input_ids": prompts}, rids, "single-behind-ids",
                                                    _prompt(299))
    assert len(outs) == BATCH
    for rid, p, out in zip(rids, prompts, outs):
        assert len(out["output_ids"]) == NEW
        _exact(got[rid], hf, (p + out["output_ids"])[:-1])
    _exact(got["single-behind-ids"], hf, (_prompt(299) + single["output_ids"])[:-1])


def test_a_batch_of_text_prompts_is_admitted_member_by_member(small_ring_server, hf):
    server = small_ring_server
    texts = [_text(i) for i in range(BATCH)]
    rids = [f"batch-text-{i:02d}" for i in range(BATCH)]
    outs, single, got = _held_batch_then_slow_reader(
        server, {"text": texts, "return_prompt_token_ids": True}, rids, "single-behind-text", _prompt(298))
    assert len(outs) == BATCH
    total = 0
    for rid, out in zip(rids, outs):
        ids = out["prompt_token_ids"]
        assert len(ids) > 20 and len(out["output_ids"]) == NEW
        _exact(got[rid], hf, (ids + out["output_ids"])[:-1])
        total += record_bytes(len(ids) + NEW - 1, P, H, ELEM, len(rid))
    assert total > RING  # the batch's records exceed the ring
    _exact(got["single-behind-text"], hf, (_prompt(298) + single["output_ids"])[:-1])
