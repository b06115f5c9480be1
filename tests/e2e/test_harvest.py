"""Harvesting from live traffic on one float32 server (conftest.harvest_server: --hs-capture opt-in
--hs-capture-sample 0.1 --hs-when-behind skip, a 2 MiB ring):

0. production style: OpenAI chat requests, 10% sampled, harvested by `python -m sglang_hs.extract
   --from-dump` that is SIGKILLed mid-load, in the middle of a file, with records it read and records it
   has not read yet unacknowledged in the ring, and started again: every request is served, the files are
   exactly the sampled requests', once each, the ring is fully acknowledged in the end, and load in SpecForge 0.2.0's released reader with rows exact against
   HF float32 and the loss mask exactly on the generated tokens (the prompt is the chat template's, the
   generated tokens decode to the reply);
1. a mixed load (/generate and OpenAI chat, some requests opting in through custom_params): exactly the
   opted-in and sampled requests have records, each judged row by row against HF float32 (row_judge);
   every other one has a marker (`reader.take` raises NotCaptured, reason not_sampled), and the status
   file and /metrics count them;
2. nobody reading: the ring fills, and every further request is still served (none is held), those that
   found no room counted as skipped (reader_behind); once a reader drains, every record there is whole
   and exact, and each request has either its record, a marker, or is counted as unmarked.
"""
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import row_judge
from helpers import drain_outcomes, metrics_of, settled
from sglang_hs import HiddenStateReader
from sglang_hs.reader import NotCaptured
from conftest import HARVEST_SAMPLE_KEY
from sglang_hs.server.store.admission import sample_point as _sample_point

pytestmark = pytest.mark.e2e
LAYERS, N_LAYERS = [2, 4, 5], 8
SAMPLE = 0.1


def sample_point(rid):
    """Where the harvest server's keyed sampling hash puts `rid` (conftest.HARVEST_SAMPLE_KEY)."""
    return _sample_point(rid, bytes.fromhex(HARVEST_SAMPLE_KEY))
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _not_captured(server, snapshot, reason):
    """/metrics' requests not captured for `reason`, once it shows `snapshot`'s figures or later ones."""
    return metrics_of(server, snapshot, by=("reason",)).get(("sglang_hs:requests_not_captured_total", reason), 0)


# `python -m sglang_hs.extract` that stops itself (SIGSTOP) as it starts writing its n-th file: the record
# in hand and every one after it are then unacknowledged, and the file is not in place
STOPS_AT_WRITE = """
import os, signal, sys
from sglang_hs.extract import cli, sinks
n, write = [int(sys.argv.pop(1))], sinks.Sink.write
def stopping_write(self, *a, **kw):
    n[0] -= 1
    if n[0] == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    return write(self, *a, **kw)
sinks.Sink.write = stopping_write
sys.exit(cli.main())
"""


@pytest.fixture
def harvesters():
    """The harvester processes a test starts; any still there when it ends (a failed test) is killed."""
    procs = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _harvester(procs, dump, out, log, stop_at_write=None):
    """`python -m sglang_hs.extract --from-dump`, once it holds the dump (it says so on stderr)."""
    n = log.read_text().count("[extract] harvesting") if log.exists() else 0
    run = [sys.executable, "-m", "sglang_hs.extract"] if stop_at_write is None else \
        [sys.executable, "-c", STOPS_AT_WRITE, str(stop_at_write)]
    proc = subprocess.Popen([*run, "--from-dump", str(dump), "--output", str(out), "--format", "specforge"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "a"))
    procs.append(proc)
    deadline = time.monotonic() + 120
    while log.read_text().count("[extract] harvesting") == n:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


def _wait_stopped(proc, log, seconds=300):
    """Until `proc` stops itself (SIGSTOP; os.waitpid reports it once)."""
    deadline = time.monotonic() + seconds
    while True:
        pid, how = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid:
            assert os.WIFSTOPPED(how), (how, log.read_text())
            return
        assert time.monotonic() < deadline, ("it did not stop", log.read_text())
        time.sleep(0.1)


def _journaled(out):
    path = os.path.join(out, "harvest.jsonl")
    lines = [json.loads(x) for x in open(path).read().splitlines(True) if x.endswith("\n")] if os.path.exists(path) else []
    return [e for e in lines if "index" in e]


def _wait_journaled(out, n, proc, log, seconds=120):
    deadline = time.monotonic() + seconds
    while len(_journaled(out)) < n:
        assert proc.poll() is None and time.monotonic() < deadline, (len(_journaled(out)), n, log.read_text())
        time.sleep(0.1)


def test_production_chat_traffic_sampled_and_harvested_by_a_harvester_killed_and_restarted(harvest_server, hf,
                                                                                             tmp_path, harvesters):
    """Runs before the module's `harvest` reader exists: the harvester is the dump's one reader."""
    import importlib.util

    import torch

    unit = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit", "test_trainer_readers.py")
    spec = importlib.util.spec_from_file_location("test_trainer_readers", unit)  # SpecForge 0.2.0, as installed there
    readers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readers)
    (build_offline_eagle3_dataset,) = readers._import_or_skip("specforge.data.preprocessing", ["build_offline_eagle3_dataset"])
    server, out, log = harvest_server, tmp_path / "harvested", tmp_path / "harvester.log"
    rids = [f"prod-{i}" for i in range(60)]
    sampled = {r for r in rids if sample_point(r) < SAMPLE}
    first = [r for r in rids[:10] if r in sampled]  # harvested, then the harvester stops at the 2nd file of the rest
    assert first and len(sampled) - len(first) >= 3 and 0.03 <= len(sampled) / len(rids) <= 0.2, sorted(sampled)
    topics = ["harvest", "traffic", "tokens", "rows", "drafts", "servers"]
    messages = {r: [{"role": "user", "content": f"Question {i}: tell me about {topics[i % 6]} " * (1 + i % 3)}]
                for i, r in enumerate(rids)}

    def send(rid):
        return server.chat(messages[rid], max_tokens=6, temperature=0, rid=rid)

    records0 = settled(server)["writer"]["records"]  # every earlier request counted: the baseline
    # stops itself as it begins the second file of the second half's records
    harvester = _harvester(harvesters, server.dump, out, log, stop_at_write=len(first) + 2)
    replies = {}
    with cf.ThreadPoolExecutor(4) as pool:
        for rid, f in zip(rids[:10], pool.map(send, rids[:10])):
            replies[rid] = f
        _wait_journaled(out, len(first), harvester, log)
        futures = {rid: pool.submit(send, rid) for rid in rids[10:]}
        _wait_stopped(harvester, log)
        replies.update({rid: f.result(timeout=300) for rid, f in futures.items()})  # served while it is stopped
        status = settled(server)  # every reply is in: each outcome is counted
        assert status["writer"]["records"] - records0 == len(sampled), status  # all published, to the ring
        assert status["output_ring_fill"] > 0, status  # ... and not all acknowledged
        harvested = {e["rid"] for e in _journaled(out)}
        assert len(harvested) == len(first) + 1 and set(first) < harvested, sorted(harvested)
        harvester.send_signal(signal.SIGKILL)  # the file in hand not in place; it and the next: unacknowledged
        assert harvester.wait(60) == -signal.SIGKILL
        harvester = _harvester(harvesters, server.dump, out, log)
    assert all(r["choices"][0]["message"]["content"] is not None for r in replies.values())  # every one served
    _wait_journaled(out, len(sampled), harvester, log)
    # every record acknowledged, and nothing more came
    status = settled(server, until=lambda s: s["output_ring_fill"] == 0, timeout=120)
    assert status["writer"]["records"] - records0 == len(sampled), status
    harvester.send_signal(signal.SIGTERM)
    assert harvester.wait(120) == 0, log.read_text()
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["status"] == "stopped by SIGTERM" and manifest["samples_on_disk"] == len(sampled), manifest
    # the restarted one wrote what the killed one left: the file in hand and every record after it
    assert manifest["samples_written"] + manifest["samples_already_done"] == len(sampled) - len(first) - 1, manifest
    entries = _journaled(out)
    by_index = {e["index"]: e for e in entries}
    assert sorted(e["rid"] for e in entries) == sorted(sampled) and len(by_index) == len(entries)  # once each

    ds = build_offline_eagle3_dataset(str(out), max_len=4096)
    assert len(ds) == len(sampled)
    H, worst = manifest["hidden_size"], 0.0
    for i in range(len(ds)):
        path = ds.datapaths[i]
        e = by_index[int(os.path.basename(path)[len("data_"):-len(".ckpt")])]
        item, saved = ds[i], torch.load(path)
        ids, p, T = saved["input_ids"].tolist(), e["prompt_len"], e["tokens"]
        prompt = hf.tok.apply_chat_template(messages[e["rid"]], add_generation_prompt=True, tokenize=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]  # a BatchEncoding in transformers 5
        assert ids[:p] == list(prompt) and T == len(ids) > p, e  # the prompt the server built, then generated
        sent = ids[p:] + [e["next_token"]]
        reply = replies[e["rid"]]["choices"][0]["message"]["content"]
        assert hf.tok.decode(sent, skip_special_tokens=True) == reply, (e, reply)
        assert saved["loss_mask"].tolist() == [0] * p + [1] * (T - p)  # exactly the generated tokens
        assert item["loss_mask"][0].tolist() == [0] * p + [1] * (T - p - 1) + [0]  # SpecForge zeroes the last
        assert item["input_ids"][0].tolist() == ids
        rec = SimpleNamespace(rid=e["rid"], input_ids=item["input_ids"][0],
                              aux_hidden_states=item["hidden_state"][0].reshape(T, len(LAYERS), H),
                              last_hidden_state=item["target"][0], last_pre_norm=None)
        assert item["hidden_state"].dtype == item["target"].dtype == torch.bfloat16  # specforge files are bf16
        worst = max(worst, row_judge.assert_exact(rec, hf, ids, LAYERS, N_LAYERS, H, tol=row_judge.BF16_TOL))
    print(f"\n{len(sampled)} of {len(rids)} chat requests harvested, worst row error {worst:.2e}; "
          f"{manifest['skipped']}")


@pytest.fixture(scope="module")
def harvest(harvest_server):
    reader = HiddenStateReader(str(harvest_server.dump))
    assert reader.manifest["dtype"] == "float32"
    yield harvest_server, reader
    reader.close()


def _judge(rec, hf, want_ids, manifest):
    return row_judge.assert_exact(rec, hf, want_ids, LAYERS, N_LAYERS, manifest["hidden_size"])


def test_only_sampled_and_opted_in_requests_are_captured_and_exact(harvest, hf):
    server, reader = harvest
    rids = [f"mix-{i}" for i in range(24)]
    opt_in = {r for i, r in enumerate(rids) if i % 4 == 0}
    chat = {r for i, r in enumerate(rids) if i % 3 == 1}
    selected = opt_in | {r for r in rids if sample_point(r) < SAMPLE}
    assert 0 < len(selected - opt_in) and len(selected) < len(rids)  # both kinds present in this mix

    def send(i, rid):
        extra = {"custom_params": {"hs_capture": True}} if rid in opt_in else {}
        text = f"Request {i} asks about " + " ".join(["harvest", "traffic", "tokens", "rows"][: 1 + i % 4]) * (1 + i % 3)
        if rid in chat:
            out = server.chat([{"role": "user", "content": text}], max_tokens=4, temperature=0, rid=rid, **extra)
            return None, out
        ids = row_judge.prompt_ids(hf, text)
        out = server.generate(input_ids=ids, rid=rid, sampling_params={**GREEDY, **extra})
        return ids, out

    before = settled(server)["admission"]  # every earlier request counted: the baseline
    with cf.ThreadPoolExecutor(4) as pool:
        futures = {rid: pool.submit(send, i, rid) for i, rid in enumerate(rids)}
        while not all(f.done() for f in futures.values()):
            reader.poll()  # a reader keeping up: nothing is skipped for lack of room
            time.sleep(0.01)
        results = {rid: f.result() for rid, f in futures.items()}
    worst = 0.0
    for rid in rids:
        if rid in selected:
            rec = reader.take(rid, timeout=60)
            ids, out = results[rid]
            want = rec.input_ids.tolist() if ids is None else (ids + out["output_ids"])[:-1]
            if ids is None:  # chat: the prompt came from the chat template; the answer's 4 tokens are in it
                assert len(want) > 4
            worst = max(worst, _judge(rec, hf, want, reader.manifest))
        else:
            with pytest.raises(NotCaptured) as e:
                reader.take(rid, timeout=60)
            # the marker answered this take (consumed): a later request with this rid gets its own outcome
            assert e.value.reason == "not_sampled" and reader.not_captured(rid) is None
    assert not [r for r in reader.ready_rids() if r.startswith("mix-")]
    n_skip = len(rids) - len(selected)
    status = settled(server)
    a = status["admission"]
    assert a["skipped_not_sampled"] - before["skipped_not_sampled"] == n_skip, a
    assert a["skipped_reader_behind"] == before["skipped_reader_behind"] == 0, a
    assert a["markers_dropped"] == 0 and a["held_now"] == 0 and status["writer"]["dropped"] == 0, status
    assert _not_captured(server, status, "not_sampled") == a["skipped_not_sampled"], status
    print(f"\n{len(selected)} of {len(rids)} captured, worst row error {worst:.2e}")


def test_with_nobody_reading_requests_are_served_without_capture_and_records_stay_whole(harvest, hf):
    server, reader = harvest
    N = 24  # all opted in: each would be captured; ~10 of their records fill the 2 MiB ring
    rids = [f"behind-{i}" for i in range(N)]
    prompts = {rid: row_judge.prompt_ids(hf, f"Unread request {i} " + "with a longer prompt " * (3 + i % 3))
               for i, rid in enumerate(rids)}
    status0 = settled(server)  # every earlier request counted: the baseline
    before = status0["admission"]

    def accounted(s):  # finishes the file has seen: a record or a marker published, or dropped
        w, w0 = s["writer"], status0["writer"]
        return (w["records"] - w0["records"] + w["markers"] - w0["markers"] + w["dropped"] - w0["dropped"]
                + s["admission"]["markers_dropped"] - before["markers_dropped"])

    with cf.ThreadPoolExecutor(8) as pool:  # nobody polls the reader meanwhile
        futures = {rid: pool.submit(server.generate, input_ids=prompts[rid], rid=rid,
                                    sampling_params={**GREEDY, "custom_params": {"hs_capture": True}})
                   for rid in rids}
        outs = {rid: f.result(timeout=150) for rid, f in futures.items()}  # every one served, none held
    status = settled(server)  # every reply is in: each outcome is counted
    assert accounted(status) == N, status
    a = status["admission"]
    skipped = a["skipped_reader_behind"] - before["skipped_reader_behind"]
    assert skipped > 0 and a["admission_waits"] == before["admission_waits"] and a["held_now"] == 0, a
    assert status["output_ring_fill"] > 0.5, status
    unmarked = a["markers_dropped"] - before["markers_dropped"]
    assert "served without capture (--hs-when-behind skip)" in server.output
    assert _not_captured(server, status, "reader_behind") == a["skipped_reader_behind"], status
    # Now a reader drains: each request has its whole, exact record, or a marker, or is counted as unmarked.
    got, marked = drain_outcomes(reader, rids, N - unmarked)
    assert len(got) + len(marked) + unmarked == N, (len(got), len(marked), unmarked)
    assert len(marked) + unmarked == skipped and len(got) == N - skipped and got
    assert all(reader.not_captured(r) == "reader_behind" for r in marked)
    for rid, rec in got.items():
        row_judge.assert_exact(rec, hf, (prompts[rid] + outs[rid]["output_ids"])[:-1], LAYERS, N_LAYERS,
                               reader.manifest["hidden_size"])
    assert settled(server)["writer"]["dropped"] == 0
    # the reader caught up: an opted-in request is captured again
    out = server.generate(input_ids=prompts[rids[0]], rid="after-catch-up",
                          sampling_params={**GREEDY, "custom_params": {"hs_capture": True}})
    rec = reader.take("after-catch-up", timeout=60)
    row_judge.assert_exact(rec, hf, (prompts[rids[0]] + out["output_ids"])[:-1], LAYERS, N_LAYERS,
                           reader.manifest["hidden_size"])
