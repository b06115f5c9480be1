"""The prompt length admission reserves for a session turn (sglang_hs/server/store/session_turns.py) against
SGLang 0.5.23's own `Session.create_req`: for every turn of two- and three-turn sessions (append, offset,
replace, drop_previous_output, a BOS to strip, streaming sessions, refused turns) the length it predicts
before the turn is built is len(origin_input_ids) of the request create_req then builds, which is what
the record holds. And AdmissionControl.need() reserves for that length, not for the new tokens alone
(it did before: the worker then waited in publish while every KV free was held)."""
import types

from sglang_hs.server.store.admission import AdmissionControl
from sglang_hs.server.store.ring import record_bytes
from sglang_hs.server.store.session_turns import turn_prompt_len

BOS = 0


class _Req:
    """What Session.create_req makes through req_factory and reads back from a finished turn."""

    def __init__(self, rid, origin_input_ids, origin_input_ids_unpadded, sampling_params, **_):
        self.rid, self.sampling_params = rid, sampling_params
        self.origin_input_ids, self.origin_input_ids_unpadded = origin_input_ids, origin_input_ids_unpadded
        self.output_ids, self.finished_reason, self.to_finish = [], None, None
        self.multimodal_inputs, self.full_untruncated_fill_ids, self.tokenizer, self.session = None, [], None, None

    def finished(self):
        return self.finished_reason is not None

    def set_finish_with_abort(self, message):
        self.finished_reason = ("abort", message)

    def inherit_mm_token_counts(self, other):
        pass


class _Sessions:
    def __init__(self):
        self.sessions = {}

    def get(self, sid):
        return self.sessions.get(sid)


def _tokenized(req_rid, ids, sid, max_new=4, **params):
    """A turn as the scheduler receives it; `params`: session_params (rid = the turn it continues)."""
    from sglang.srt.managers.io_struct import SessionParams

    return types.SimpleNamespace(rid=req_rid, input_ids=list(ids), session_params=SessionParams(id=sid, **params),
                                 sampling_params=types.SimpleNamespace(max_new_tokens=max_new), session_id=None,
                                 lora_id=None, custom_logit_processor=None, stream=False, return_logprob=False,
                                 top_logprobs_num=0, token_ids_logprob=None, return_sampling_mask=False,
                                 sampling_logprobs_mode=None, require_reasoning=False, return_hidden_states=False,
                                 return_routed_experts=False, routed_experts_start_len=0, bootstrap_host=None,
                                 bootstrap_port=None, bootstrap_room=None, routed_dp_rank=None,
                                 disagg_prefill_dp_rank=None, priority=None, routing_key=None, extra_key=None,
                                 cache_salt=None, http_worker_ipc=None, time_stats=None, mm_inputs=None)


TOK = types.SimpleNamespace(bos_token_id=BOS)


def _turn(sessions, sid, req, generated=None):
    """Predict, then let SGLang build the turn; finish it with `generated` output ids. Returns the Req."""
    predicted = turn_prompt_len(req, sessions, TOK)
    session = sessions.get(sid)
    built = session.create_req(req, TOK, vocab_size=100, req_factory=_Req)
    if built.finished():  # refused by create_req: no record, nothing to predict
        return built, predicted, None
    assert predicted == len(built.origin_input_ids), (req.session_params, predicted, list(built.origin_input_ids))
    if generated is not None:
        built.output_ids = list(generated)
        built.finished_reason = "length"
        if session.streaming:
            session.finish_req(built)
    return built, predicted, len(built.origin_input_ids)


def _open(sessions, sid, streaming=False):
    from sglang.srt.session.session_controller import Session

    sessions.sessions[sid] = Session(1000, sid, streaming=streaming)


def test_two_and_three_turn_sessions_with_offset_replace_and_drop(tmp_path):
    s = _Sessions()
    _open(s, "a")
    t1, _, n1 = _turn(s, "a", _tokenized("a1", [BOS, 5, 6, 7], "a"), generated=[8, 9, 10, 11])
    assert n1 == 4
    # append to a1: its prompt, its output (up to max_new_tokens), the new turn without its BOS
    t2, _, n2 = _turn(s, "a", _tokenized("a2", [BOS, 12, 13], "a", rid="a1"), generated=[14, 15])
    assert n2 == 4 + 4 + 2
    t3, _, n3 = _turn(s, "a", _tokenized("a3", [16], "a", rid="a2"), generated=[17])
    assert n3 == n2 + 2 + 1
    # output longer than max_new_tokens (an overlap overshoot): only max_new_tokens of it is history
    _, _, n = _turn(s, "a", _tokenized("a4", [18, 19], "a", rid="a3", max_new=1), generated=[20, 21, 22])
    _, _, n = _turn(s, "a", _tokenized("a5", [23], "a", rid="a4"))
    assert n == (n3 + 1 + 2) + 1 + 1
    # offset: the context cut to [:offset] (also past its end, and negative), then the new tokens
    for i, offset in enumerate((3, 100, -2)):
        _turn(s, "a", _tokenized(f"a-off{i}", [30, 31], "a", rid="a2", offset=offset))
    # drop_previous_output: the continued turn's prompt only
    _, _, n = _turn(s, "a", _tokenized("a-drop", [40], "a", rid="a2", drop_previous_output=True))
    assert n == n2 + 1
    _, _, n = _turn(s, "a", _tokenized("a-drop-off", [41], "a", rid="a2", drop_previous_output=True, offset=6))
    assert n == 7
    # replace with a rid: continues that turn (aborting it if still running), clears its children
    _, _, n = _turn(s, "a", _tokenized("a-rep", [50, 51], "a", rid="a1", replace=True), generated=[52])
    assert n == 4 + 4 + 2
    # a plain turn without rid has no history
    _, _, n = _turn(s, "a", _tokenized("a-norid", [BOS, 61, 62], "a"))
    assert n == 3
    # replace without rid clears the session: the new tokens alone, BOS kept (on an empty session: with
    # any turn in it, SGLang 0.5.23's own clearing loop raises "dictionary changed size during iteration")
    _open(s, "c")
    _, _, n = _turn(s, "c", _tokenized("c-fresh", [BOS, 60], "c", replace=True))
    assert n == 2


def test_streaming_session_turns_and_refused_turns():
    s = _Sessions()
    _open(s, "st", streaming=True)
    _, _, n1 = _turn(s, "st", _tokenized("s1", [BOS, 1, 2, 3], "st"), generated=[4, 5])
    _, _, n2 = _turn(s, "st", _tokenized("s2", [BOS, 6], "st"), generated=[7, 8, 9])
    assert n2 == n1 + 2 + 1
    _, _, n3 = _turn(s, "st", _tokenized("s3", [10, 11], "st"), generated=[12])
    assert n3 == n2 + 3 + 2
    # refused by create_req: predicted None (admission sizes them by their own tokens; no record comes)
    _, predicted, _ = _turn(s, "st", _tokenized("s-off", [13], "st", offset=2))
    assert predicted is None
    _open(s, "b")
    _turn(s, "b", _tokenized("b1", [1, 2], "b"))  # not finished
    for req in (_tokenized("b2", [3], "b", rid="b1"), _tokenized("b3", [3], "b", rid="nope")):
        built, predicted, _ = _turn(s, "b", req)
        assert built.finished() and predicted is None
    assert turn_prompt_len(_tokenized("x", [1], "closed-or-unknown"), s, TOK) is None


class _Ring:
    capacity = 1 << 30

    def free_bytes(self):
        return self.capacity


def test_need_reserves_for_the_whole_session_context():
    s = _Sessions()
    _open(s, "n")
    _turn(s, "n", _tokenized("n1", [BOS] + list(range(1, 200)), "n", max_new=50), generated=list(range(50)))
    turn = _tokenized("n2", [BOS, 7, 8], "n", rid="n1", max_new=5)
    P, H, elem = 2, 16, 4
    adm = AdmissionControl(_Ring(), P, H, elem, context_len=4096,
                           recorded_prompt_len=lambda req: turn_prompt_len(req, s, TOK))
    rows = 200 + 50 + 2 + 5 - 1  # the whole context the record holds, then max_new_tokens - 1 rows
    assert adm.need(turn) == 2 * record_bytes(rows, P, H, elem, len("n2"))
    plain = AdmissionControl(_Ring(), P, H, elem, context_len=4096, recorded_prompt_len=lambda req: None)
    assert plain.need(turn) == 2 * record_bytes(3 + 5 - 1, P, H, elem, len("n2"))  # not a session turn's size


def test_radix_native_session_requests_are_plain():
    s = _Sessions()
    _open(s, "r")
    req = _tokenized("r1", [1, 2], "r")
    req.session_id = "r"
    assert turn_prompt_len(req, s, TOK, radix_native=True) is None
