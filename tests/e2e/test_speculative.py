"""Capture on a server that decodes speculatively (issue 44), on the CPU engine: SGLang's NGRAM drafter,
EAGLE with DeepSeek's MTP layer as the draft and EAGLE3 with a tiny EAGLE-3 draft (conftest.py
`speculative_server`, one server per algorithm). The EAGLE (MTP) server runs `--tp 2 --dp 2
--enable-dp-attention` (conftest SPEC_TP, SPEC_DP), DeepSeek-V3/R1's production pairing at scale (MTP under DP
attention), so each of its tests below runs on two ranks, each its own attention group: both ranks build the
overlay and run verify passes (their status files count TARGET_VERIFY forwards), each group's verify batch padded
to the other's (SGLang's MLP sync), both groups write, and their rows are judged like the others. (Verify passes
with attention heads split over two ranks, `--tp 2` alone, run on test_model_family's "v32-tp2", V3.2's MTP.)
Before the CPU engine's verify and extend paths knew DP padding (patches spec_verify_torch_native and
torch_native_extend), this server's scheduler died at the first verify of a padded group ("a custom mask of 16
entries for 2 requests of 4 drafts") and then at the first padded draft extend ("a request of 1 keys extends 4
tokens"). Measured at `--tp 2` alone: worst row 1.07e-6 of HF float32 (1.03e-6 on one rank; NGRAM and EAGLE3, on
one rank, 1.05e-6 and 1.03e-6); two ranks cost the module ~100 s (the EAGLE part 242 s -> 339 s, measured back to
back on a loaded machine). Planted:
a verify that leaves a rejected draft's row at its slot (the next verify's first token not written there)
fails the concurrent test at the first position whose draft was rejected.

Each decode step of such a server is a verify pass: one forward of the target over the draft tokens of each
request (NGRAM: a tree of 12; MTP: the last token and a chain of 3 drafts; EAGLE3: the last token and the best
4 drafts of a top-2 tree, 3 steps deep: conftest SPEC_DRAFT), written at KV slots of the request's draft
window, rows included; then the accepted drafts' KV is moved to the front of the window and the rest
dropped. A record must hold exactly the rows of the tokens the request ends with, each the row a plain
forward of that sequence gives: every row is judged against HF transformers float32 (tests/e2e/row_judge.py)
on the token ids the server sent.

How drafts get accepted with a tiny random model. NGRAM needs no draft model, only text that repeats: the
tiny model's greedy continuations fall into short loops, which the n-gram corpus then proposes; SGLang's
own per-request counters (meta_info spec_*) show drafts accepted and rejected in each judged request, and
the overlay's status that rows followed KV moves (`moved_rows`: accepted drafts off the tree's front).
The MTP draft (v3-mtp's layer, tiny_model._add_mtp_layer) reads the target's final hidden state, which the
overlay hands over while capturing, and is built to propose the target's last token again, but its attention
over its own earlier positions is live (MTP_ATTENTION: sharp queries, an output projection as large as the
residual stream), and overrules many of those guesses, so what it proposes hangs on its KV at every earlier
position and on its positions: on the CPU engine's draft extend after each verify (which must leave every kept
position's KV that of the accepted sequence), its multi-step draft decode (patches/eagle_cpu_draft.py: steps at
positions f and f + 1 attending the prefix and their own earlier steps) and the hidden states it is handed.
Each record's accepted drafts per verify pass must equal, pass by pass, what a plain HF-modules reference of the
layer proposes from HF float32's target states (tests/e2e/mtp_reference.py, its rules read from SGLang 0.5.23's
eagle_worker_v2.py and eagle_worker_common.py), in the concurrent test and in the harvest test's kept requests.
Measured in the concurrent test: 150 verify passes judged, 30 drafts accepted (up to 3 in one pass) and 420
rejected; against the repeat rule the attention raised one request's accepts (3, the rule 1) and lowered another's
(15, the rule 22..24); worst row 1.11e-6 at --tp 2 (EAGLE3's tree 1.07e-6, 24 rows moved off the tree's front).
Planted in a scratch copy of patches/eagle_cpu_draft.py (the concurrent test alone, on the EAGLE server):
- the draft extend after a verify leaving its window's first KV slot unwritten (the draft's decode-step KV stays
  there; a TorchNativeAttnBackend whose DRAFT_EXTEND_V2 writes skip each request's first slot) -> fails at spec-0,
  passes at positions 102 and 106 (1 draft accepted each, the reference 2 and 3);
- the draft's decode steps one position too far (forward_batch.positions + 1 in the multi-step backend's
  init_forward_metadata) -> fails at spec-0, passes at 100 and 105 (2 and 3 accepted, the reference 1 and 2);
- the draft's decode steps not seeing the prefix's last position (draft_step_spans' visible[:prefix - 1]) -> NOT
  caught: the four requests accept exactly as before (14, 3, 15, 1). A decode step's draft is verified only where
  the drafts before it were accepted (22 passes here verify a second draft, 7 a third), and hiding position f - 1
  changed none of them; tests/unit/test_eagle_cpu_draft.py catches it (5 of its 6 cases fail).
With a zero attention output (the draft before this one) none of these three changes a proposal.

The EAGLE-3 draft (tiny_eagle3) also proposes the token it is given again (its attention one-hot on its own
position's value, so its proposals hardly hang on its KV), but reads the target's aux states too, which overrule some of
its guesses: accepted at most where the output repeats, and
exactly as often as on the same server without capture (the overlay captures the draft's layers beside ours
and hands it its own).

The servers harvest as a production one would (--hs-capture opt-in): the tests' requests opt in, one that
does not leaves a marker; and the extraction CLI's --regenerate runs against each server. The NGRAM server
never holds a request for its reader either (--hs-when-behind skip, a 24 MiB ring: conftest SPEC_WHEN_BEHIND):
with nobody reading, the requests that find no room are served without capture and marked.
"""
import concurrent.futures as cf
import functools
import hashlib
import json

import pytest
import requests

import types

from safetensors.torch import load_file

import mtp_reference
import row_judge
from conftest import (HARVEST_SAMPLE_KEY, SPEC_ACCEPT_BELOW, SPEC_ACCEPT_LOWEST, SPEC_ACCEPT_WINDOW, SPEC_DRAFT,
                      SPEC_SAMPLE)
from helpers import drain_outcomes, metrics_of, settled, status_when
from spec_counts import check_steps as _check_steps, repeat_draft_accepts as _repeat_draft_accepts
from sglang_hs import HiddenStateReader, NotCaptured
from sglang_hs.server.store.admission import sample_point

pytestmark = [pytest.mark.e2e, pytest.mark.many_servers]
LAYERS, N_LAYERS, H = [2, 4, 5], 8, 256
GREEDY = {"temperature": 0, "custom_params": {"hs_capture": True}}  # the servers capture opted-in requests only
TEXTS = ("one two three four five six seven eight. " * 5,
         "The cat sat on the mat and the dog sat on the log. " * 4,
         "Speculative decoding proposes tokens; the target checks them in one pass. " * 3,
         "a b c d e f g a b c d e f g a b c d e f g a b c d")


@pytest.fixture(scope="module")
def served(speculative_server):
    reader = HiddenStateReader(str(speculative_server.dump))
    assert reader.manifest["dtype"] == "float32" and reader.manifest["rows_per_token"] == 5
    _check_served(reader.manifest["served"], speculative_server.algorithm)
    if speculative_server.tp > 1:  # every rank built the overlay (each reports its status); rank 0 of each
        files = settled(speculative_server)["files"]  # DP-attention group alone writes
        dp = speculative_server.dp
        assert len(files) == speculative_server.tp and sum("writer" in f for f in files) == dp, files
        assert [w["id"] for w in reader.manifest["writers"]] == list(range(dp))
    source = reader.manifest["layer_source"]  # NGRAM, EAGLE (MTP): no drafter ids anywhere, the default
    assert reader.manifest["layer_ids"] == LAYERS and source["from"] == (
        "--hs-layers" if speculative_server.algorithm == "EAGLE3" else "default"), source
    yield speculative_server, reader
    reader.close()


def _check_served(served, algorithm):
    """The manifest names the target, the draft (its config's hash) and how it drafted, and the chat template."""
    from sglang_hs.tools import tiny_eagle3, tiny_model

    def sha(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    target = tiny_model.ensure("v3-mtp" if algorithm == "EAGLE" else "v3")
    assert served["target"] == {"path": target, "revision": None, "config_sha256": sha(f"{target}/config.json")}
    assert served["speculative"]["algorithm"] == algorithm, served
    if algorithm == "NGRAM":
        assert served["draft"] is None
    else:  # EAGLE: the MTP layer of the target's own checkpoint; EAGLE3: the draft generated at test time
        draft = target if algorithm == "EAGLE" else tiny_eagle3.ensure()
        assert served["draft"]["path"] == draft and served["draft"]["config_sha256"] == sha(f"{draft}/config.json")
        steps, topk, tokens = SPEC_DRAFT[algorithm]
        assert (served["speculative"]["num_steps"], served["speculative"]["eagle_topk"],
                served["speculative"]["num_draft_tokens"]) == (steps, topk, tokens), served
    with open(f"{target}/tokenizer_config.json") as f:
        template = json.load(f).get("chat_template")
    assert template and served["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()


def _exact(rec, hf, want):
    return row_judge.assert_exact(rec, hf, want, LAYERS, N_LAYERS, H)


def _drafts(meta):
    """(verify passes, drafts accepted, drafts proposed) of one request, from SGLang's own counters."""
    return meta["spec_verify_ct"], meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"]


def _acceptance(meta):
    """SGLang's per-request speculative figures (meta_info): verify passes, accept length (completion tokens per
    verify pass), drafts accepted and proposed, and the histogram of verify passes by drafts accepted."""
    return (*_drafts(meta), meta["spec_accept_length"], meta["completion_tokens"],
            meta.get("spec_correct_drafts_histogram"))


@functools.lru_cache(maxsize=1)
def _mtp_draft(path, model):
    return mtp_reference.MTPDraft(path, model)


def _judge_mtp_draft(hf, ids, out, rec):
    """The EAGLE server's MTP draft (v3-mtp's layer, whose attention is live) accepted, at every verify pass of this
    request whose drafts fall inside its output, exactly the drafts a plain HF reference of the layer proposes from
    HF float32's target states over the accepted sequence (tests/e2e/mtp_reference.py: its attention over its own
    earlier positions, SGLang's rules for what each position reads). Returns (passes judged, drafts accepted,
    drafts rejected) in those passes."""
    import torch

    from sglang_hs.tools import tiny_model

    draft = _mtp_draft(tiny_model.ensure("v3-mtp"), hf.model)
    full = ids + out["output_ids"]
    steps = SPEC_DRAFT["EAGLE"][0]
    threads = torch.get_num_threads()
    # thousands of tiny ops: on one thread, not waiting for cores the server's ranks hold (measured 5-24 s a request
    # with torch's default threads beside the EAGLE server, 0.15 s on an idle machine)
    torch.set_num_threads(1)
    try:
        passes = draft.judge(full, hf(full[:-1])[N_LAYERS], len(ids), rec.meta["speculative"]["accepted_drafts"],
                             steps)
    finally:
        torch.set_num_threads(threads)
    wrong = [(f, got, want) for f, got, want in passes if got != want]
    assert passes and not wrong, (f"{rec.rid}: verify passes (first position, drafts accepted, the reference's) "
                                  f"{wrong[:8]} of {len(passes)} judged")
    accepted = sum(got for _, got, _ in passes)
    return len(passes), accepted, steps * len(passes) - accepted


def test_concurrent_speculative_requests_are_exact_row_for_row(served, hf):
    """Four requests at once (prompts of 25-60 tokens, chunked at 16), 48 greedy tokens each: every row of
    every record exact, drafts accepted and rejected in each, and rows moved after KV."""
    server, reader = served
    before = settled(server)
    jobs = [(f"spec-{i}", row_judge.prompt_ids(hf, text)) for i, text in enumerate(TEXTS)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: server.generate(input_ids=j[1], rid=j[0], sampling_params={
            "max_new_tokens": 48, **GREEDY}), jobs))
    total = worst = deepest = 0
    for (rid, ids), out in zip(jobs, outs):
        verifies, accepted, proposed = _drafts(out["meta_info"])
        print(f"{server.algorithm} tp{server.tp} {rid}: {verifies} verify passes, {accepted} of {proposed} drafts "
              "accepted")
        assert verifies > 0 and accepted < proposed, (rid, out["meta_info"])  # drafts rejected in every record
        if server.algorithm == "NGRAM":
            assert accepted > 0, (rid, out["meta_info"])  # and accepted in every record
        else:
            least, most = _repeat_draft_accepts(out["output_ids"], SPEC_DRAFT[server.algorithm][0])
            print(f"  the repeat rule: {least}..{most}")
        if server.algorithm == "EAGLE":  # the MTP draft's accepts are judged pass by pass below (_judge_mtp_draft)
            assert 0 < accepted, (rid, out["output_ids"], out["meta_info"])
        elif server.algorithm == "EAGLE3" and SPEC_DRAFT["EAGLE3"][1] == 1:  # a chain of EAGLE-3 drafts repeats
            assert accepted <= most, (rid, out["output_ids"], out["meta_info"])  # it too, unless aux states overrule
        total += accepted
        rec = reader.take(rid, timeout=60)
        assert rec.prompt_len == len(ids)
        _check_steps(rec, out["meta_info"])  # the record's steps are SGLang's for the request
        if server.algorithm == "EAGLE":
            judged = _judge_mtp_draft(hf, ids, out, rec)
            print(f"  the MTP draft's reference: {judged} (verify passes judged, drafts accepted, rejected)")
        deepest = max(deepest, *rec.meta["speculative"]["accepted_drafts"])
        worst = max(worst, _exact(rec, hf, (ids + out["output_ids"])[:-1]))
    print(f"{server.algorithm} tp{server.tp}: worst row {worst:.3g} of HF float32, {total} drafts accepted, "
          f"at most {deepest} in one verify")
    assert total > 0
    if server.algorithm != "NGRAM":  # drafts of the multi-step draft's later steps accepted too
        assert deepest > 1 and deepest <= SPEC_DRAFT[server.algorithm][0], deepest
    after = settled(server)
    print(f"moved rows: {after['writer']['moved_rows'] - before['writer']['moved_rows']}")
    if server.algorithm == "NGRAM" or SPEC_DRAFT[server.algorithm][1] > 1:  # accepted drafts off the tree's front:
        assert after["writer"]["moved_rows"] > before["writer"]["moved_rows"], (before["writer"], after["writer"])
    else:  # a chain's accepted drafts are at the window's front already
        assert after["writer"]["moved_rows"] == before["writer"]["moved_rows"], (before["writer"], after["writer"])
    # every rank ran verify passes for these requests (each process's status file, by its pid)
    verify = [{pid: f["forwards"].get("TARGET_VERIFY", 0) for pid, f in zip(st["pids"], st["files"])}
              for st in (before, after)]
    assert len(verify[1]) == server.tp and all(n > verify[0].get(pid, 0) for pid, n in verify[1].items()), verify


# Prompts for the EAGLE-3 comparison: the tiny target's greedy output repeats tokens after some of them more
# than after others, and each repeat is a draft the aux states may overrule
ACCEPT_TEXTS = (*TEXTS, "x x x x x x x x", "Hello world. " * 6, "1 2 3 4 5 6 7 8 9 10", "the the the the the",
                "Lorem ipsum dolor sit amet, consectetur adipiscing elit.")


@pytest.mark.parametrize("speculative_server", ["EAGLE3"], indirect=True)
def test_eagle3_draft_fares_the_same_with_capture_on(served, hf):
    """The target captures the EAGLE-3 draft's layers (SGLang's ids 2, 5, 7) beside ours (2, 4, 5), once each,
    and hands the draft its own: the same prompts, greedy, one at a time, give the same tokens and, request by
    request, the same verify passes, accept length, drafts accepted and histogram of drafts accepted per verify
    pass (SGLang's meta_info) as on the same server without capture (`.plain`); each record's accepted drafts per
    verify step are SGLang's figures for its request, and every row of every record is exact. The draft's
    proposals hang on those aux states (tiny_eagle3: they overrule about a third of its guesses), so a draft
    handed our layers instead is accepted differently in several of these requests (4 of 10 when planted)."""
    server, reader = served
    assert ("EAGLE-3 draft reads the target's layers [2, 5, 7] (SGLang's ids); capturing [2, 4, 5, 7] once: "
            "ours [2, 4, 5]") in server.output
    prompts = [row_judge.prompt_ids(hf, text) for text in ACCEPT_TEXTS]

    def serve_all(target, tag, params):
        return [target.generate(input_ids=ids, rid=f"e3-{tag}-{i}", sampling_params={"max_new_tokens": 96, **params})
                for i, ids in enumerate(prompts)]

    with cf.ThreadPoolExecutor(2) as pool:  # each server one request at a time, both at once
        on = pool.submit(serve_all, server, "on", GREEDY)
        off = pool.submit(serve_all, server.plain, "off", {"temperature": 0})
        on, off = on.result(), off.result()
    for i, (ids, a, b) in enumerate(zip(prompts, on, off)):
        assert a["output_ids"] == b["output_ids"], i
        # per request, SGLang's own figures: verify passes, accept length, drafts accepted and proposed, and how
        # many verify passes accepted each number of drafts
        assert _acceptance(a["meta_info"]) == _acceptance(b["meta_info"]), (i, a["meta_info"], b["meta_info"])
        rec = reader.take(f"e3-on-{i}", timeout=60)
        _check_steps(rec, a["meta_info"])
        _exact(rec, hf, (ids + a["output_ids"])[:-1])
    accepted = [_drafts(a["meta_info"])[1] for a in on]
    repeats = [_repeat_draft_accepts(a["output_ids"], SPEC_DRAFT["EAGLE3"][0])[1] for a in on]
    assert sum(accepted) > 0 and sum(accepted) < sum(repeats), (accepted, repeats)


def test_radix_hit_stop_string_stream_and_logprobs(served, hf):
    """A prompt served from the radix cache then decoded speculatively; a stop string that ends the output
    inside a verify's accepted run; a streamed request; prompt and output logprobs."""
    server, reader = served
    ids = row_judge.prompt_ids(hf, TEXTS[0])
    route = {"routed_dp_rank": 0} if server.dp > 1 else {}  # one DP-attention group's radix cache
    first = server.generate(input_ids=ids, rid="spec-warm", sampling_params={"max_new_tokens": 24, **GREEDY}, **route)
    _exact(reader.take("spec-warm", timeout=60), hf, (ids + first["output_ids"])[:-1])
    again = server.generate(input_ids=ids, rid="spec-hit", sampling_params={"max_new_tokens": 40, **GREEDY}, **route)
    # the prompt's rows from the radix cache (all but the last token or two: SGLang's EAGLE computes one
    # more for its draft's extend pass)
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 2, again["meta_info"]
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
    # harvest: a request that does not opt in (nor falls in the sample) is served without capture and leaves
    # a marker saying so
    assert sample_point("spec-not-opted", bytes.fromhex(HARVEST_SAMPLE_KEY)) >= SPEC_SAMPLE
    out = server.generate(input_ids=ids[:20], rid="spec-not-opted", sampling_params={"max_new_tokens": 8,
                                                                                       "temperature": 0})
    assert len(out["output_ids"]) == 8
    with pytest.raises(NotCaptured, match="not_sampled"):
        reader.take("spec-not-opted", timeout=60)
    settled(server)
    reader.poll()
    assert reader.ready_rids() == []


def test_session_turns_and_an_aborted_request(served, hf):
    """The request contract's sessions and abort on a speculative server: two turns of a session, the second
    continuing the first, each recorded as the whole context SGLang forwarded for it, exact; a streamed
    request aborted (/abort_request) while it decodes leaves nothing, not even a marker (an aborted request
    is no sample, docs/reading.md), and the request after it is exact."""
    server, reader = served
    before = settled(server)["admission"].get("skipped_reader_behind", 0)
    r = requests.post(f"{server.url}/open_session", json={"capacity_of_str_len": 4096}, timeout=60)
    assert r.status_code == 200, r.text
    sid = r.json()
    sp = {"max_new_tokens": 16, "ignore_eos": True, **GREEDY}
    first = row_judge.prompt_ids(hf, TEXTS[1])
    # under DP attention a session's turns go to one group (each group keeps its own sessions' requests)
    route = {"routed_dp_rank": 0} if server.dp > 1 else {}
    a = server.generate(input_ids=first, rid="spec-sess-1", sampling_params=sp, session_params={"id": sid}, **route)
    second = row_judge.prompt_ids(hf, " And then the bird sat on the log too.")
    b = server.generate(input_ids=second, rid="spec-sess-2", sampling_params=sp,
                        session_params={"id": sid, "rid": "spec-sess-1"}, **route)
    _exact(reader.take("spec-sess-1", timeout=60), hf, (first + a["output_ids"])[:-1])
    context = first + a["output_ids"] + second[1:]  # the BOS of a continuing turn is dropped
    rec = reader.take("spec-sess-2", timeout=60)
    assert rec.input_ids.tolist() == (context + b["output_ids"])[:-1]
    _exact(rec, hf, (context + b["output_ids"])[:-1])
    requests.post(f"{server.url}/close_session", json={"session_id": sid}, timeout=60)

    ids = row_judge.prompt_ids(hf, TEXTS[2])
    stream = requests.post(f"{server.url}/generate", stream=True, timeout=300, json={
        "input_ids": ids, "rid": "spec-aborted", "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, **GREEDY}})
    chunks, aborted = 0, False
    for line in stream.iter_lines(decode_unicode=True):
        if not (line and line.startswith("data: {")):
            continue
        chunks += 1
        if chunks == 4:  # decoding (verify steps) under way: abort it
            r = requests.post(f"{server.url}/abort_request", json={"rid": "spec-aborted"}, timeout=60)
            assert r.status_code == 200, r.text
        if json.loads(line[6:])["meta_info"].get("finish_reason") is not None:
            aborted = json.loads(line[6:])["meta_info"]["finish_reason"]["type"] == "abort"
    assert chunks >= 4 and aborted, (chunks, aborted)
    out = server.generate(input_ids=ids[:25], rid="spec-after-abort", sampling_params={"max_new_tokens": 16,
                                                                                        **GREEDY})
    _exact(reader.take("spec-after-abort", timeout=60), hf, (ids[:25] + out["output_ids"])[:-1])
    status = settled(server)  # every request answered is published: one poll is an absence check
    reader.poll()
    assert reader.ready_rids() == [], "a record or marker of the aborted request"
    # on a server that skips when behind (NGRAM), none of these was served uncaptured for want of ring room: the
    # aborted request ran captured, so leaving nothing is the abort's doing
    assert status["admission"].get("skipped_reader_behind", 0) == before, status["admission"]


def test_harvest_keeps_the_requests_the_draft_did_poorly_on(served, hf):
    """--hs-capture-accept-below (EAGLE, EAGLE3): of the sampled requests (not opted in), exactly those whose accept
    length, SGLang's own spec_accept_length in the reply, is below the threshold have records, each row exact; the
    others leave a draft_accepted marker, and the status and /metrics count them. Both outcomes occur.
    --hs-capture-accept-lowest (NGRAM, the lowest half of the last 8 finished requests): 8 opted-in requests fill
    the window first, so every later decision follows from the replies' accept lengths in finish order (the
    requests are sent one at a time): kept when fewer than half of the window, itself included, are below it."""
    server, reader = served
    key = bytes.fromhex(HARVEST_SAMPLE_KEY)
    window = []
    if server.algorithm == "NGRAM":
        for i, text in enumerate(ACCEPT_TEXTS[:SPEC_ACCEPT_WINDOW]):
            ids = row_judge.prompt_ids(hf, text)
            out = server.generate(input_ids=ids, rid=f"spec-fill-{i}", sampling_params={"max_new_tokens": 64, **GREEDY})
            window.append(out["meta_info"]["spec_accept_length"])
            _exact(reader.take(f"spec-fill-{i}", timeout=60), hf, (ids + out["output_ids"])[:-1])
        assert len(window) == SPEC_ACCEPT_WINDOW, "ACCEPT_TEXTS: one per window place"
    rids = [rid for rid in (f"spec-pick-{i}" for i in range(40)) if sample_point(rid, key) < SPEC_SAMPLE]
    jobs = list(zip(rids, (row_judge.prompt_ids(hf, text) for text in ACCEPT_TEXTS)))
    before = settled(server)["admission"]["skipped_draft_accepted"]
    outs = [server.generate(input_ids=ids, rid=rid, sampling_params={"max_new_tokens": 64, "temperature": 0})
            for rid, ids in jobs]
    kept = dropped = 0
    judged = []
    for (rid, ids), out in zip(jobs, outs):
        length = out["meta_info"].get("spec_accept_length")
        assert length is not None and length >= 1, out["meta_info"]
        if server.algorithm == "NGRAM":
            window = (window + [length])[-SPEC_ACCEPT_WINDOW:]
            keep = sum(x < length for x in window) < SPEC_ACCEPT_LOWEST * len(window)
        else:
            keep = length < SPEC_ACCEPT_BELOW
        if keep:
            kept += 1
            rec = reader.take(rid, timeout=60)
            _exact(rec, hf, (ids + out["output_ids"])[:-1])
            if server.algorithm == "EAGLE":  # the MTP draft's accepts, pass by pass, against its reference
                judged.append(_judge_mtp_draft(hf, ids, out, rec))
        else:
            dropped += 1
            with pytest.raises(NotCaptured, match="draft_accepted"):
                reader.take(rid, timeout=60)
    assert kept and dropped, [o["meta_info"]["spec_accept_length"] for o in outs]
    if judged:
        print(f"{server.algorithm}: the MTP draft's reference judged {[j[0] for j in judged]} verify passes of the "
              f"kept requests, {sum(j[1] for j in judged)} drafts accepted, {sum(j[2] for j in judged)} rejected")
    after = settled(server)
    assert after["admission"]["skipped_draft_accepted"] - before == dropped, after["admission"]
    exported = metrics_of(server, after, by=("reason",))  # /metrics once it shows this snapshot's figures
    assert exported[("sglang_hs:requests_not_captured_total", "draft_accepted")] == \
        after["admission"]["skipped_draft_accepted"]
    reader.poll()
    assert reader.ready_rids() == []


def test_n_choices_and_an_over_long_rid(served, hf):
    """The request contract's n > 1 and its rid limit on a speculative server: one exact record per choice
    and none for SGLang's parallel-sampling prefix request; a rid longer than a record can name gets a 400
    naming the limit, and the next request is exact."""
    server, reader = served
    ids = row_judge.prompt_ids(hf, TEXTS[3])
    outs = server.generate(input_ids=ids, rid="spec-n", sampling_params={"n": 2, "max_new_tokens": 24, **GREEDY})
    assert isinstance(outs, list) and len(outs) == 2
    for out in outs:
        _exact(reader.take(out["meta_info"]["id"], timeout=60), hf, (ids + out["output_ids"])[:-1])
    r = requests.post(f"{server.url}/generate", timeout=300, json={
        "input_ids": ids, "rid": "L" * 70_000, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    assert r.status_code == 400 and "at most 65535 bytes" in r.text, (r.status_code, r.text[:300])
    out = server.generate(input_ids=ids[:25], rid="spec-after-long-rid", sampling_params={"max_new_tokens": 16,
                                                                                           **GREEDY})
    _exact(reader.take("spec-after-long-rid", timeout=60), hf, (ids[:25] + out["output_ids"])[:-1])
    settled(server)  # every request answered is published: one poll is an absence check
    reader.poll()
    assert reader.ready_rids() == [], "a record of the prefix request or of the refused rid"


@pytest.mark.parametrize("speculative_server", ["NGRAM"], indirect=True)
def test_with_nobody_reading_requests_are_served_without_capture_and_records_stay_whole(served, hf):
    """--hs-when-behind skip on the NGRAM server (conftest SPEC_WHEN_BEHIND, a 24 MiB ring): 24 opted-in requests,
    4 at a time (4 prompts in turn), while the reader does not poll; their records (~240 rows of a shared prefix,
    from the radix cache, then 24 speculative tokens each) cannot all fit the ring, so some must be skipped. Every
    request is served and none is ever held (no admission wait in any status snapshot); those that found no room
    count as skipped (reader_behind: status and /metrics) and leave a marker or count as unmarked; the ring is more
    than half full. Then the reader drains: each request has exactly one outcome, its record (every row exact
    against HF float32, its verify steps' accepted drafts SGLang's) or its marker or an unmarked count, the captured
    ones numbering the records the server published, nothing left over; and the next opted-in request is captured
    again."""
    from sglang_hs.server.store.ring import record_bytes

    server, reader = served
    N, NEW = 24, 24
    sp = {"max_new_tokens": NEW, "ignore_eos": True, **GREEDY}
    prefix = TEXTS[0] * 3
    warm = row_judge.prompt_ids(hf, prefix)  # puts the shared prefix in the radix cache
    server.generate(input_ids=warm, rid="behind-warm", sampling_params=sp)
    assert reader.take("behind-warm", timeout=60).prompt_len == len(warm)
    rids = [f"behind-{i}" for i in range(N)]
    # 4 prompts in turn (requests sent together differ), so the judge's HF forwards are mostly of sequences it ran
    prompts = {rid: row_judge.prompt_ids(hf, f"{prefix}Request {i % 4}.") for i, rid in enumerate(rids)}
    states = {}

    def hf_once(ids):
        return states[tuple(ids)] if tuple(ids) in states else states.setdefault(tuple(ids), hf(ids))

    smallest = min(record_bytes(len(ids) + NEW - 1, 5, H, 4, len(rid)) for rid, ids in prompts.items())
    assert N * smallest > 2 * reader.largest_record_bytes() + 1, "the records must not all fit the ring"
    reader.poll()
    assert reader.ready_rids() == []
    status0 = settled(server, until=lambda s: s["output_ring_fill"] == 0)  # everything earlier drained: baseline
    a0 = status0["admission"]

    def delta(s, part, key):
        return s[part][key] - status0[part][key]

    pool = cf.ThreadPoolExecutor(4)  # nobody polls the reader meanwhile
    try:
        futures = {rid: pool.submit(server.generate, input_ids=prompts[rid], rid=rid, sampling_params=sp)
                   for rid in rids}
        # none is ever held for the reader: every snapshot until the last reply says so (the first that does not
        # ends the wait)
        seen = status_when(server, lambda s: s["admission"]["held_now"] or s["admission"]["admission_waits"]
                           != a0["admission_waits"] or all(f.done() for f in futures.values()), timeout=300)
        assert seen["admission"]["held_now"] == 0 and seen["admission"]["admission_waits"] == a0["admission_waits"], \
            seen["admission"]
        outs = {rid: f.result(timeout=60) for rid, f in futures.items()}  # every one served
    finally:  # a failure above does not wait for requests held for good (they end with the server)
        pool.shutdown(wait=False, cancel_futures=True)
    assert all(len(o["output_ids"]) == NEW for o in outs.values())
    status = settled(server)  # every reply is in: each outcome is counted, its record or marker in the ring
    a = status["admission"]
    skipped = delta(status, "admission", "skipped_reader_behind")
    unmarked = delta(status, "admission", "markers_dropped")
    print(f"NGRAM, nobody reading: {N - skipped} of {N} captured, {skipped} skipped ({unmarked} unmarked), ring "
          f"{status['output_ring_fill']:.2f} full")
    assert 0 < skipped < N and a["admission_waits"] == a0["admission_waits"] and a["held_now"] == 0, a
    assert status["output_ring_fill"] > 0.5, status
    # each request counted once: a record, a marker, or a skip that found no room for its marker
    assert (delta(status, "writer", "records"), delta(status, "writer", "markers") + unmarked,
            delta(status, "writer", "dropped")) == (N - skipped, skipped, 0), status
    assert "served without capture (--hs-when-behind skip)" in server.output
    exported = metrics_of(server, status, by=("reason",))  # /metrics once it shows this snapshot's figures
    assert exported[("sglang_hs:requests_not_captured_total", "reader_behind")] == a["skipped_reader_behind"]

    # Now the reader drains: each request's one outcome, whichever it was
    got, marked = drain_outcomes(reader, rids, N - unmarked)
    assert (len(got), len(marked) + unmarked) == (N - skipped, skipped), (sorted(got), sorted(marked), unmarked)
    for rid in marked:
        with pytest.raises(NotCaptured, match="reader_behind"):
            reader.take(rid, timeout=60)
    worst = 0.0
    for rid, rec in got.items():
        _check_steps(rec, outs[rid]["meta_info"])
        worst = max(worst, _exact(rec, hf_once, (prompts[rid] + outs[rid]["output_ids"])[:-1]))
    print(f"NGRAM, nobody reading: worst row {worst:.3g} of HF float32 ({len(states)} sequences)")
    # nothing more comes: no second outcome of any request, the ring empty, no record dropped
    after = settled(server, until=lambda s: s["output_ring_fill"] == 0)
    reader.poll()
    assert reader.ready_rids() == [] and not [r for r in rids if reader.not_captured(r)]
    assert (delta(after, "writer", "records"), delta(after, "writer", "markers"), delta(after, "writer", "dropped")) \
        == (N - skipped, len(marked), 0), after["writer"]
    # the reader caught up: an opted-in request is captured again
    ids = prompts[rids[0]]
    out = server.generate(input_ids=ids, rid="behind-caught-up", sampling_params=sp)
    _exact(reader.take("behind-caught-up", timeout=60), hf_once, (ids + out["output_ids"])[:-1])


def test_regenerate_extraction_from_a_speculative_server(served, hf, tmp_path):
    """`python -m sglang_hs.extract --regenerate` against the speculative server (last in the module: the
    extraction opens the dump's reader, so the module's closes first): the replies the target writes
    while drafting, every row of every file judged against HF float32, and checked by the CLI against the
    server's own logprobs (--verify)."""
    import subprocess
    import sys

    server, reader = served
    reader.close()
    convs = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]}
             for text in TEXTS[:3]]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "sglang_hs.extract", "--no-progress", "--data", str(data),
                           "--output", str(out), "--format", "safetensors", "--regenerate", "--max-new-tokens", "32",
                           "--verify", "1.0", "--server", server.url, "--hs-dump-dir", str(server.dump)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.load(open(out / "manifest.json"))
    assert m["samples_written"] == 3 and m["verified"] == 3 and not m["failed"], m
    assert m["served"] == reader.manifest["served"]  # the training files say which draft served them
    for i in range(3):
        t = load_file(str(out / f"hs_{i}.safetensors"))
        ids = t["token_ids"].tolist()
        assert sum(t["loss_mask"].tolist()) > 0  # generated rows
        rec = types.SimpleNamespace(rid=f"file {i}", input_ids=t["token_ids"], aux_hidden_states=t["hidden_states"][:, :3],
                                    last_hidden_state=None, last_pre_norm=t["hidden_states"][:, 3])
        _exact(rec, hf, ids)
