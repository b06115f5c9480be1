"""The request contract (issue 29): for every request the server accepts, through /generate, the OpenAI
endpoints or SGLang's session API, the reader sees exactly one of: a record exact row for row, a
NotCaptured marker saying why, or the client got a 4xx naming the reason; no record nobody asked for,
and the server keeps serving.

One float32 server (conftest.py `contract_server`); every record is judged row by row against HF
transformers float32 on the token ids it claims (tests/e2e/row_judge.py), and where the client knows
what was forwarded, those ids are checked too. Around every test the server's status is settled first
(sglang_hs.status: every request answered so far has its outcome published) and the reader polled: no
record and no marker beyond the ones the test took may be there, before or after it."""
import concurrent.futures as cf
import json

import pytest
import requests

import row_judge
from helpers import settled
from sglang_hs import HiddenStateReader, NotCaptured

pytestmark = pytest.mark.e2e
LAYERS, N_LAYERS = [2, 4, 5], 8
GREEDY = {"temperature": 0}
TEXT = ("Speculative decoding makes generation faster without changing its result. A small draft model "
        "proposes several tokens ahead, the large target model checks all of them in one forward pass.")


@pytest.fixture(scope="module")
def served(contract_server):
    reader = HiddenStateReader(str(contract_server.dump))
    assert reader.manifest["dtype"] == "float32"
    yield contract_server, reader
    reader.close()


@pytest.fixture(autouse=True)
def nothing_unexpected(served):
    """Every record and marker a test's requests leave is one the test took: checked once the server has
    published the outcome of every request answered (settled), before the test and after it. What a
    failed test left is reported at its own teardown, then cleared, so the next test starts clean."""
    server, reader = served
    settled(server)
    reader.poll()
    assert reader.ready_rids() == [], f"records that arrived after the last test's check: {reader.ready_rids()}"
    _expected_markers.clear()
    markers = reader.markers
    yield
    settled(server)
    reader.poll()
    left, got = reader.ready_rids(), reader.markers - markers
    for rid in left:
        reader.pop_ready(rid)
    assert left == [], f"records nobody asked for: {left}"
    assert got == _expected_markers.pop("n", 0), f"{got} markers, the test took {_expected_markers}"


_expected_markers = {}


def _expect_markers(n):
    _expected_markers["n"] = _expected_markers.get("n", 0) + n


def exact(rec, hf, want_ids=None):
    """Judge `rec` on the ids it claims (and check them against `want_ids` when the client knows them)."""
    ids = rec.input_ids.tolist()
    if want_ids is not None:
        assert ids == list(want_ids), rec.rid
    return row_judge.assert_exact(rec, hf, ids, LAYERS, N_LAYERS, 256)


def _ids(hf, text):
    return row_judge.prompt_ids(hf, text)


def _post(server, path, body, ok=True):
    r = requests.post(f"{server.url}{path}", json=body, timeout=300)
    if ok:
        assert r.status_code == 200, r.text
        return r.json()
    return r


# --- item 1: beam search ------------------------------------------------------------------------------

def test_beam_search_is_served_with_a_marker_and_plain_requests_next_to_it_stay_exact(served, hf):
    """A beam request's record was wrong (zeros as token ids, the slots of whichever beam sat in row 0,
    rows short of the tokens forwarded): now it is served uncaptured with a `beam_search` marker, while
    plain requests running at the same time keep exact records."""
    server, reader = served
    ids = _ids(hf, TEXT)
    plain = [(f"beam-side-{i}", _ids(hf, f"Request {i} runs next to a beam search.")) for i in range(3)]
    with cf.ThreadPoolExecutor(4) as pool:
        beam = pool.submit(server.generate, input_ids=ids, rid="beam-1",
                           sampling_params={"beam_width": 2, "n": 2, "max_new_tokens": 5})
        outs = list(pool.map(lambda j: server.generate(input_ids=j[1], rid=j[0],
                                                       sampling_params={"max_new_tokens": 6, **GREEDY}), plain))
        beam_out = beam.result()
    assert beam_out["meta_info"]["id"] == "beam-1"
    with pytest.raises(NotCaptured) as e:
        reader.take("beam-1", timeout=60)
    assert e.value.reason == "beam_search"
    _expect_markers(1)
    for (rid, p), out in zip(plain, outs):
        exact(reader.take(rid, timeout=60), hf, (p + out["output_ids"])[:-1])


def test_a_beam_request_sglang_refuses_gets_a_4xx_and_leaves_nothing(served, hf):
    server, reader = served
    r = _post(server, "/generate", {"input_ids": _ids(hf, TEXT), "rid": "beam-refused",
                                    "sampling_params": {"beam_width": 2, "max_new_tokens": 3, "stop": ["x"]}},
              ok=False)
    assert 400 <= r.status_code < 500 and "beam" in r.text.lower(), r.text
    settled(server)  # whatever it left is published now
    reader.poll()
    assert reader.not_captured("beam-refused") is None and "beam-refused" not in reader.ready_rids()


# --- item 2: sessions ---------------------------------------------------------------------------------

def test_session_turns_record_the_whole_context_as_forwarded(served, hf):
    """Two- and three-turn sessions, and turns continuing one with `offset`, `drop_previous_output` and
    `replace`: each turn's record holds the context SGLang forwarded for it (the continued turn's prompt
    and output, the new tokens less their BOS), row for row."""
    server, reader = served
    sid = _post(server, "/open_session", {"capacity_of_str_len": 4096})
    sp = {"max_new_tokens": 4, "ignore_eos": True, **GREEDY}

    def turn(req_rid, text, bos=True, **params):  # params: session_params (rid: the turn continued)
        ids = _ids(hf, text) if bos else _ids(hf, text)[1:]
        out = server.generate(input_ids=ids, rid=req_rid, sampling_params=sp,
                              session_params={"id": sid, **params})
        assert len(out["output_ids"]) == 4, out
        return ids, out["output_ids"]

    a, out_a = turn("sess-1", "The first turn of a conversation about caching.")
    ctx = {"sess-1": a}
    b, out_b = turn("sess-2", " Then the user asks about eviction.", rid="sess-1")
    ctx["sess-2"] = ctx["sess-1"] + out_a + b[1:]  # the BOS of a continuing turn is dropped
    c, out_c = turn("sess-3", " and about pinned pages", bos=False, rid="sess-2")
    ctx["sess-3"] = ctx["sess-2"] + out_b + c
    d, out_d = turn("sess-off", " or rather about offsets", bos=False, rid="sess-2", offset=9)
    ctx["sess-off"] = (ctx["sess-2"] + out_b)[:9] + d
    e_, out_e = turn("sess-drop", " without the answer", bos=False, rid="sess-2", drop_previous_output=True)
    ctx["sess-drop"] = ctx["sess-2"] + e_
    f, out_f = turn("sess-rep", " a replacement second turn", bos=False, rid="sess-1", replace=True)
    ctx["sess-rep"] = ctx["sess-1"] + out_a + f
    outs = {"sess-1": out_a, "sess-2": out_b, "sess-3": out_c, "sess-off": out_d, "sess-drop": out_e,
            "sess-rep": out_f}
    for rid, context in ctx.items():
        exact(reader.take(rid, timeout=60), hf, (context + outs[rid])[:-1])
    assert len(ctx["sess-3"]) > 2 * len(c) + 8  # the record is the whole context, not the new turn
    assert _post(server, "/close_session", {"session_id": sid}, ok=False).status_code == 200


# --- item 4: n > 1 ------------------------------------------------------------------------------------

def test_n_choices_give_one_record_each_and_nothing_else(served, hf):
    """n > 1: one record per choice, under the id each output carries; SGLang's own prefix request
    (max_new_tokens 0, sent before the choices) leaves none (it did: a prompt-only record per prompt)."""
    server, reader = served
    ids = _ids(hf, "Parallel sampling draws several answers to one prompt.")
    outs = server.generate(input_ids=ids, rid="n-gen", sampling_params={"n": 3, "max_new_tokens": 5,
                                                                         "temperature": 1.0, "sampling_seed": 0})
    assert isinstance(outs, list) and len(outs) == 3
    for out in outs:
        exact(reader.take(out["meta_info"]["id"], timeout=60), hf, (ids + out["output_ids"])[:-1])
    # two prompts, n = 2: four choices, no prefix records
    ids2 = _ids(hf, "A second prompt in the same batch.")
    outs = server.generate(input_ids=[ids, ids2], sampling_params={"n": 2, "max_new_tokens": 3, **GREEDY})
    assert len(outs) == 4
    for out in outs:
        prompt = ids if out["meta_info"]["prompt_tokens"] == len(ids) else ids2
        exact(reader.take(out["meta_info"]["id"], timeout=60), hf, (prompt + out["output_ids"])[:-1])
    settled(server)  # every request answered so far is published: a prefix request's record would be here
    reader.poll()
    assert reader.ready_rids() == [], "a record of SGLang's parallel-sampling prefix request"


def test_openai_chat_with_n_gives_one_record_per_choice(served, hf):
    server, reader = served
    body = {"model": "default", "messages": [{"role": "user", "content": "Name two colours."}], "n": 2,
            "max_tokens": 4, "temperature": 1.0}
    resp = _post(server, "/v1/chat/completions", body)
    assert len(resp["choices"]) == 2
    settled(server)  # both choices' records are in the ring, and nothing else of this request is coming
    reader.poll()
    rids = reader.ready_rids()
    assert len(rids) == 2, rids
    assert resp["id"] in rids, (resp["id"], rids)  # the response id is the first choice's rid
    for rid in rids:
        exact(reader.take(rid, timeout=5), hf)


# --- the rest of the per-request surface --------------------------------------------------------------

def test_completions_with_echo_and_logprobs(served, hf):
    server, reader = served
    prompt = "Echo returns the prompt with the completion."
    resp = _post(server, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 4, "echo": True,
                                              "logprobs": 2, "temperature": 0, "rid": "c-echo"})
    assert resp["choices"][0]["text"].startswith(prompt)
    rec = reader.take("c-echo", timeout=60)
    want_prompt = hf.tok(prompt)["input_ids"]
    assert rec.input_ids.tolist()[: len(want_prompt)] == want_prompt and rec.prompt_len == len(want_prompt)
    exact(rec, hf)


def test_return_hidden_states_logprobs_and_structured_output_records_are_exact(served, hf):
    server, reader = served
    ids = _ids(hf, TEXT)
    shapes = {
        "shape-hidden": {"return_hidden_states": True},
        "shape-logprob": {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2},
        "shape-regex": {"sampling_params": {"regex": "(yes|no)[.]", "max_new_tokens": 6, **GREEDY}},
        "shape-json": {"sampling_params": {"json_schema": json.dumps({"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"]}), "max_new_tokens": 12, **GREEDY}},
        "shape-stop": {"sampling_params": {"max_new_tokens": 8, "stop_token_ids": [], "stop": [" the"],
                                           **GREEDY}},
        "shape-prefill-only": {"sampling_params": {"max_new_tokens": 0}},
        "shape-stream": {"stream": True},
    }
    for rid, extra in shapes.items():
        body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 5, **GREEDY}, **extra}
        r = requests.post(f"{server.url}/generate", json=body, timeout=300, stream=bool(extra.get("stream")))
        assert r.status_code == 200, (rid, r.text)
        if extra.get("stream"):
            chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                      if line and line.startswith("data: {")]
            out = chunks[-1]
        else:
            out = r.json()
        if rid == "shape-hidden":
            assert out["meta_info"].get("hidden_states"), "SGLang's own hidden states came back"
        rec = reader.take(rid, timeout=60)
        assert rec.input_ids.tolist()[: len(ids)] == ids[: rec.num_tokens], rid
        if rid == "shape-prefill-only":
            assert rec.input_ids.tolist() == ids[:-1] and rec.next_token == ids[-1]
        elif not extra.get("stream"):
            want = ids + out["output_ids"]
            assert rec.input_ids.tolist() == want[: rec.num_tokens] and rec.num_tokens >= len(want) - 1, rid
        exact(rec, hf)


@pytest.mark.parametrize("body, says", [
    ({"return_hidden_states": True, "sampling_params": {"beam_width": 2, "max_new_tokens": 2}}, "hidden"),
    ({"lora_path": "some-adapter"}, "lora"),
    ({"input_embeds": [[0.0] * 256] * 4}, "radix"),
])
def test_refused_shapes_get_a_4xx_naming_the_reason_and_leave_nothing(served, hf, body, says):
    server, reader = served
    payload = {"rid": f"refused-{says}", "sampling_params": {"max_new_tokens": 2}, **body}
    if "input_embeds" not in body:
        payload["input_ids"] = _ids(hf, TEXT)
    r = _post(server, "/generate", payload, ok=False)
    assert 400 <= r.status_code < 500 and says in r.text.lower(), (r.status_code, r.text)
    settled(server)  # whatever it left is published now
    reader.poll()
    assert reader.not_captured(payload["rid"]) is None and payload["rid"] not in reader.ready_rids()


def test_a_batch_mixing_shapes(served, hf):
    """One /generate batch mixing a plain request, a beam search, a prompt-only one, a stop string and
    a regex: each member gets its own record (the beam one its marker)."""
    server, reader = served
    texts = ["A plain member of the batch.", "A beam member of the batch.", "A prompt-only member.",
             "A member that stops at the word the and then", "A member answering yes or no:"]
    ids = [_ids(hf, t) for t in texts]
    params = [{"max_new_tokens": 4, **GREEDY}, {"beam_width": 2, "max_new_tokens": 3},
              {"max_new_tokens": 0}, {"max_new_tokens": 8, "stop": [" the"], **GREEDY},
              {"regex": "(yes|no)", "max_new_tokens": 4, **GREEDY}]
    rids = [f"mix-{i}" for i in range(len(ids))]
    outs = server.generate(input_ids=ids, rid=rids, sampling_params=params)
    assert len(outs) == len(ids)
    for rid, p, out in zip(rids, ids, outs):
        if rid == "mix-1":
            with pytest.raises(NotCaptured, match="beam_search"):
                reader.take(rid, timeout=60)
            _expect_markers(1)
            continue
        rec = reader.take(rid, timeout=60)
        want = (p + out["output_ids"]) if out["output_ids"] else p
        assert rec.input_ids.tolist() == want[: rec.num_tokens] and rec.num_tokens >= len(want) - 1, rid
        exact(rec, hf)


def test_the_server_keeps_serving_and_dropped_nothing(served, hf):
    server, reader = served
    ids = _ids(hf, "The last request of the contract module.")
    out = server.generate(input_ids=ids, rid="contract-last", sampling_params={"max_new_tokens": 4, **GREEDY})
    exact(reader.take("contract-last", timeout=60), hf, (ids + out["output_ids"])[:-1])
    status = settled(server)["writer"]  # every request of the module accounted for
    assert status["records"] > 0 and status["dropped"] == 0 and status["finish_failed"] == 0, status
    assert requests.get(f"{server.url}/health_generate", timeout=60).status_code == 200
