"""Admission control with batched requests: a `/generate` with a list of prompts reaches the scheduler as
one `BatchTokenizedGenerateReqInput`; each member is admitted or held like a single request, in arrival
order, and the members that go in together go in as a batch again. Real SGLang io_struct messages, a
stand-in ring (free bytes set by the test)."""
import collections
import pickle
import sys
import types

import pytest

pytest.importorskip("sglang.srt.managers.io_struct", reason="needs SGLang installed")
from sglang.srt.managers.io_struct import (  # noqa: E402
    AbortReq,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_hs.server.patches import capture_hooks  # noqa: E402
from sglang_hs.server.store import admission as admission_mod  # noqa: E402
from sglang_hs.server.store.admission import AdmissionControl  # noqa: E402
from ring_stand_in import Ring  # noqa: E402

P, H, ELEM, PROMPT, NEW = 2, 64, 2, 30, 5


class Clock:
    def __init__(self):
        self.t = 1000.0

    def monotonic(self):
        return self.t


def _req(rid, n=PROMPT):
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(5, 5 + n)), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=NEW), return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


def _batch(rids):
    return BatchTokenizedGenerateReqInput(batch=[_req(r) for r in rids])


def _members(out):
    """The generate requests in `out`, in order, batches opened."""
    reqs = []
    for m in out:
        if isinstance(m, BatchTokenizedGenerateReqInput):
            assert len(m.batch) > 0
            reqs += list(m.batch)
        elif isinstance(m, TokenizedGenerateReqInput):
            reqs.append(m)
    return reqs


def _rids(out):
    return [r.rid for r in _members(out)]


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(admission_mod, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def _control(n_fit, timeout=0.0):
    """An AdmissionControl whose ring takes exactly `n_fit` of this file's requests at once."""
    need = AdmissionControl(Ring(1 << 30), P, H, ELEM, 4096).need(_req("b-00"))
    ring = Ring(n_fit * need + need // 2)
    return AdmissionControl(ring, P, H, ELEM, 4096, timeout=timeout), ring, need


def test_batch_larger_than_the_free_ring_is_partly_held_and_released_in_order(clock):
    adm, ring, need = _control(3)
    rids = [f"b-{i:02d}" for i in range(8)]
    batch = _batch(rids)
    single = _req("after")
    out = adm.filter([batch, single])
    # The first three members go in, as a batch of the same kind; the rest, and the single behind them, wait.
    assert len(out) == 1 and type(out[0]) is BatchTokenizedGenerateReqInput
    assert [r.rid for r in out[0].batch] == rids[:3]
    assert all(a is b for a, b in zip(out[0].batch, batch.batch[:3]))  # the very request objects
    assert [h.rid for h in adm.held] == rids[3:] + ["after"] and adm.stats["held_now"] == 6
    assert sorted(adm.reserved) == rids[:3] and sum(adm.reserved.values()) <= ring.free
    admitted = _rids(out)
    # The reader frees the ring as requests finish: held members go in, in arrival order, a few at a time.
    while adm.held:
        for rid in list(adm.reserved):  # everything admitted finishes and is read
            adm.release(rid)
        before = len(admitted)
        out = adm.filter([])
        assert sum(adm.reserved.values()) <= ring.free
        admitted += _rids(out)
        assert len(admitted) - before == min(3, len(rids) + 1 - before)
    assert admitted == rids + ["after"]
    assert adm.stats["held_now"] == 0 and adm.stats["admission_waits"] > 0
    assert adm._batch_of == {}


def test_a_batch_that_fits_goes_in_as_it_came(clock):
    adm, ring, _ = _control(10)
    batch = _batch([f"b-{i:02d}" for i in range(6)])
    before, after = _req("x"), _req("y")
    out = adm.filter([before, batch, after])
    assert out[0] is before and out[1] is batch and out[2] is after
    assert len(adm.reserved) == 8 and not adm.held


def test_held_members_wait_behind_earlier_singles_and_later_requests_behind_them(clock):
    adm, ring, _ = _control(2)
    out = adm.filter([_req("s-0"), _req("s-1"), _req("s-2"), _batch(["b-0", "b-1"]), _req("s-3")])
    order = _rids(out)
    assert order == ["s-0", "s-1"]
    arriving = [[_batch(["c-0"])]]  # a second batch arrives while the first waits
    while adm.held:
        for rid in list(adm.reserved):
            adm.release(rid)
        order += _rids(adm.filter(arriving.pop() if arriving else []))
    assert order == ["s-0", "s-1", "s-2", "b-0", "b-1", "s-3", "c-0"]


def test_rewrapped_batches_keep_per_member_lists_and_cross_process_boundaries(clock):
    adm, ring, _ = _control(2)
    rids = ["b-0", "b-1", "b-2", "b-3", "b-4"]
    batch = _batch(rids)
    batch.rids = list(rids)
    batch.http_worker_ipcs = [f"ipc-{r}" for r in rids]
    out = adm.filter([batch])
    first = out[0]
    assert first is not batch and first.rids == ["b-0", "b-1"] and first.http_worker_ipcs == ["ipc-b-0", "ipc-b-1"]
    # SGLang broadcasts what the writer rank pulled to the other ranks with pickle
    copy = pickle.loads(pickle.dumps(first))
    assert type(copy) is BatchTokenizedGenerateReqInput and [r.rid for r in copy] == ["b-0", "b-1"]
    assert list(copy.batch[1].input_ids) == list(range(5, 5 + PROMPT))
    adm.release("b-0")
    adm.release("b-1")
    out = adm.filter([])
    assert out[0].rids == ["b-2", "b-3"] and out[0].http_worker_ipcs == ["ipc-b-2", "ipc-b-3"]


def test_an_abort_of_a_held_member_takes_that_member_in_with_it(clock):
    adm, ring, _ = _control(2)
    rids = [f"m-{i}" for i in range(6)]
    out = adm.filter([_batch(rids)])
    assert _rids(out) == rids[:2]
    abort = AbortReq(rid="m-4")
    out = adm.filter([abort])
    # The aborted member goes in first (as a one-member batch), then its abort, which SGLang applies to it
    # in its waiting queue; the ring is still full, so nothing else enters.
    assert len(out) == 2 and isinstance(out[0], BatchTokenizedGenerateReqInput) and out[1] is abort
    assert _rids(out) == ["m-4"] and "m-4" not in adm.reserved and "m-4" not in adm.held_since
    assert [h.rid for h in adm.held] == ["m-2", "m-3", "m-5"]
    for rid in rids[:2]:
        adm.release(rid)
    assert _rids(adm.filter([])) == ["m-2", "m-3"]


def test_an_abort_by_rid_prefix_takes_every_held_member_it_matches(clock):
    """SGLang aborts by rid prefix (Scheduler.abort_request: rid.startswith), and a batch's rid string is
    expanded to `rid_0`, `rid_1`, ...: an abort of the prefix must meet every held member."""
    adm, ring, _ = _control(1)
    out = adm.filter([_batch([f"job_{i}" for i in range(4)]), _req("other")])
    assert _rids(out) == ["job_0"]
    abort = AbortReq(rid="job_")
    out = adm.filter([abort])
    assert _rids(out) == ["job_1", "job_2", "job_3"] and out[-1] is abort
    assert [h.rid for h in adm.held] == ["other"]
    out = adm.filter([AbortReq(abort_all=True)])
    assert _rids(out) == ["other"] and not adm.held


def test_held_members_past_the_time_limit_fail_but_not_into_a_bystander(clock):
    adm, ring, _ = _control(1, timeout=30)
    rids = [f"t_{i}" for i in range(12)]  # t_1 prefixes t_10 and t_11
    out = adm.filter([_batch(rids)])
    assert _rids(out) == ["t_0"]
    clock.t += 31
    out = adm.filter([], known_rids=lambda: {"t_0"})
    reqs, aborts = _members(out), [m for m in out if isinstance(m, AbortReq)]
    # Every expired member goes in right before its own abort, except t_1: its abort would take t_10 and t_11.
    failed = [r.rid for r in reqs]
    assert failed == [r for r in rids[1:] if r != "t_1"]
    assert [a.rid for a in aborts] == failed
    for i, m in enumerate(out):
        if isinstance(m, AbortReq):
            assert _rids([out[i - 1]]) == [m.rid] and m.finished_reason["status_code"] == 503
    assert [h.rid for h in adm.held] == ["t_1"] and adm.stats["failed"] == 10
    # once t_10 and t_11 are gone, t_1 fails too
    out = adm.filter([], known_rids=lambda: {"t_0"})
    assert _rids(out) == ["t_1"] and isinstance(out[-1], AbortReq) and not adm.held


def test_embedding_batches_pass_like_single_embedding_requests(clock):
    """Embedding requests never publish a record (SGLang's embedding result path does not collect)."""
    adm, ring, _ = _control(0)
    emb = [TokenizedEmbeddingReqInput(rid=f"e-{i}", input_text="", input_ids=[1, 2], mm_inputs=None,
                                      token_type_ids=None, sampling_params=SamplingParams()) for i in range(3)]
    batch = BatchTokenizedEmbeddingReqInput(batch=emb)
    out = adm.filter([batch, emb[0]])
    assert out[0] is batch and out[1] is emb[0] and not adm.held and not adm.reserved


def test_empty_and_unknown_messages_pass(clock):
    adm, ring, _ = _control(0)
    empty = BatchTokenizedGenerateReqInput(batch=[])
    other = object()
    assert adm.filter([empty, other]) == [empty, other]
    assert adm.filter(None) is None


def test_reservations_of_members_not_yet_handled_survive_the_reconcile(clock, monkeypatch):
    """A batch that entered but waits in `_deferred_input_requests` (behind a pause) is known to the
    scheduler: its members' reservations are kept; requests waiting for a grammar are kept too."""
    adm, ring, _ = _control(4)
    deferred = _batch(["d-0", "d-1"])
    adm.filter([deferred, _req("g-0"), _req("gone")])
    assert sorted(adm.reserved) == ["d-0", "d-1", "g-0", "gone"]
    sched = types.SimpleNamespace(
        waiting_queue=[], _deferred_input_requests=[deferred, AbortReq(rid="zzz")],
        grammar_manager=types.SimpleNamespace(grammar_queue=[types.SimpleNamespace(rid="g-0")]),
        running_batch=None, last_batch=None, chunked_req=None)
    monkeypatch.setattr(capture_hooks, "_scheduler", sched)
    known = capture_hooks._known_rids()
    assert {"d-0", "d-1", "g-0"} <= known and "gone" not in known
    clock.t += 1
    adm.filter([], known_rids=capture_hooks._known_rids)
    assert sorted(adm.reserved) == ["d-0", "d-1", "g-0"]


def test_a_stand_in_io_struct_without_batches_still_works(clock, monkeypatch):
    """tests/gpu runs AdmissionControl against a stand-in io_struct that has no batch types."""
    stand_in = types.ModuleType("sglang.srt.managers.io_struct")
    stand_in.TokenizedGenerateReqInput, stand_in.AbortReq = TokenizedGenerateReqInput, AbortReq
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", stand_in)
    monkeypatch.setattr(sys.modules["sglang.srt.managers"], "io_struct", stand_in)
    adm, ring, _ = _control(1)
    out = adm.filter([_req("a"), _req("b")])
    assert _rids(out) == ["a"] and collections.Counter(h.rid for h in adm.held) == {"b": 1}
