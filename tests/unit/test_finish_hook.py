"""The finish hook itself (`capture_hooks._after_collect`, what SGLang's result processing calls when a
request finishes): which tokens a record holds, which KV slots its rows are gathered from, and which
requests are not emitted. Real SGLang `Req` objects (their own `output_ids_through_stop`, finish
reasons and `kv.req_pool_idx`), a fake `req_to_token` table, the real writer, ring and reader. Every
store slot holds rows that differ per slot, per layer and per hidden index, so a record is checked
row by row, exactly, against the store rows of the slots it must come from."""
from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.reader import HiddenStateReader

H, LAYERS, N_LAYERS, NUM_SLOTS, POOL, MAX_LEN = 16, [1, 2], 4, 128, 6, 40
SPEC = CaptureSpec.resolve(LAYERS, True, N_LAYERS, H)
P = len(LAYERS) + 1


class Admission:
    """Stands in for AdmissionControl: records which reservations the hook releases."""

    def __init__(self):
        self.released = []
        self.stats = {"skipped_draft_accepted": 0}

    def release(self, rid, req=None):
        self.released.append(rid)

    release_reservation = release  # the finish worker's: the same here (no decisions to keep)

    def finish(self, rid, req=None):
        from sglang_hs.server.store.admission import Ticket

        return Ticket(str(rid), 1)  # every request captured (--hs-capture all)

    def drop(self, ticket):
        if ticket is not None:
            self.released.append(ticket.rid)


@pytest.fixture(params=["worker", "sync"])
def hook(request, tmp_path, monkeypatch):
    """Both finish paths: the finish worker (the default: the scheduler hands over, a thread publishes,
    a write into a slot it reads waits for it meanwhile) and SGLANG_HS_SYNC_FINISH=1."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sglang_hs.server.patches import capture_hooks
    from sglang_hs.server.store.writer import CaptureWriter

    monkeypatch.setenv("SGLANG_HS_SYNC_FINISH", "1" if request.param == "sync" else "0")
    monkeypatch.setattr(capture_hooks, "_finisher", None)

    writer = CaptureWriter(str(tmp_path), SPEC, num_slots=NUM_SLOTS, dtype=torch.float32, ring_bytes=1 << 20)
    # slot s, row p, index h: s + p / 4 + h / 1024, exact in float32 and different everywhere
    s, p, h = torch.meshgrid(torch.arange(NUM_SLOTS), torch.arange(P), torch.arange(H), indexing="ij")
    writer.store.copy_(s + p / 4 + h / 1024)
    admission = Admission()
    monkeypatch.setattr(capture_hooks, "_writer", writer)
    monkeypatch.setattr(capture_hooks, "_admission", admission)
    collected = []
    monkeypatch.setitem(capture_hooks.ORIGINALS, "_maybe_collect_routed_experts", lambda self, req: collected.append(req.rid))
    # request pool row r holds slots 100 - 3r, 99 - 3r, ...: no two rows alike, none in position order
    table = torch.stack([torch.arange(100 - 3 * r, 100 - 3 * r - MAX_LEN, -1) for r in range(POOL)]).clamp(min=1)
    table = table.to(torch.int32)  # as SGLang's ReqToTokenPool holds it
    allocator = TokenToKVPoolAllocator(NUM_SLOTS - 1, torch.float32, "cpu", None, need_sort=False)
    processor = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=table),
                                token_to_kv_pool_allocator=allocator)
    reader = HiddenStateReader(str(tmp_path))
    yield SimpleNamespace(finish=lambda req: capture_hooks._after_collect(processor, req), table=table,
                          writer=writer, admission=admission, collected=collected, reader=reader,
                          settle=lambda: capture_hooks._finisher and capture_hooks._finisher.drain())
    if capture_hooks._finisher:
        capture_hooks._finisher.close()
    reader.close()


def _req(rid, prompt, output, pool_idx, finished_reason=None, finished_len=None):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max(1, len(output))))
    req.output_ids.extend(output)
    req.finished_reason = finished_reason or FINISH_LENGTH(len(output))
    req.finished_len = finished_len
    req.kv.req_pool_idx = pool_idx
    return req


def _spec_req(rid, n, verifies, opted, pool_idx):
    """A finished request of prompt [1, 2, 3] that generated n tokens in `verifies` verify steps (accept length
    n / verifies), opted in to capture or not."""
    req = _req(rid, [1, 2, 3], list(range(40, 40 + n)), pool_idx=pool_idx)
    req.spec_verify_ct = verifies
    if opted:
        req.sampling_params.custom_params = {"hs_capture": True}
    return req


def _assert_record(hook, rid, tokens, slots, prompt_len, sent):
    """`prompt_len`: where the record must say the prompt ends; `sent`: the generated tokens it must say
    the server sent (the last one has no row)."""
    hook.settle()  # the worker's results are taken on the scheduler's side: reservations released there
    rec = hook.reader.take(rid, timeout=5)
    assert rec.input_ids.tolist() == tokens
    assert (rec.prompt_len, rec.next_token, rec.output_ids) == (prompt_len, sent[-1], sent), rid
    want = hook.writer.store[torch.as_tensor(slots, dtype=torch.long)]
    assert torch.equal(rec.aux_hidden_states, want[:, :-1]), (rid, "aux rows are not the slots' rows")
    assert torch.equal(rec.last_hidden_state, want[:, -1]), (rid, "final-state rows are not the slots' rows")
    assert rid in hook.admission.released and rid in hook.collected


def test_prompt_only_request_holds_every_prompt_row(hook):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    hook.finish(_req("prompt-only", prompt, [42], pool_idx=2))  # one generated token: it has no row
    _assert_record(hook, "prompt-only", prompt, hook.table[2, :len(prompt)].tolist(), len(prompt), [42])


def test_generated_tokens_but_the_last_have_rows(hook):
    prompt, output = [3, 4, 5], [20, 21, 22, 23]
    hook.finish(_req("gen", prompt, output, pool_idx=4))
    T = len(prompt) + len(output) - 1
    _assert_record(hook, "gen", (prompt + output)[:T], hook.table[4, :T].tolist(), 3, output)


def test_a_stop_string_trims_the_rows_past_it(hook):
    """Under the overlap scheduler a request that matched a stop string has forwarded tokens past its
    final length: `finished_len` trims output_ids, and the record ends at the stop token's row."""
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR

    prompt, output = [3, 4, 5, 6], [30, 31, 32, 33, 34]
    hook.finish(_req("stop", prompt, output, pool_idx=1, finished_reason=FINISH_MATCHED_STR("x"), finished_len=2))
    T = len(prompt) + 2 - 1
    _assert_record(hook, "stop", (prompt + output)[:T], hook.table[1, :T].tolist(), 4, [30, 31])


def test_aborted_health_check_and_warmup_requests_are_not_emitted_but_released(hook):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from sglang_hs.server.patches.warmup_rid import PREFIX as WARMUP

    hook.finish(_req("aborted", [1, 2, 3], [4, 5], pool_idx=0, finished_reason=FINISH_ABORT("client gone")))
    hook.finish(_req("HEALTH_CHECK_123", [1, 2], [3], pool_idx=1))
    hook.finish(_req(WARMUP + "0", [1, 2], [3], pool_idx=3))
    hook.finish(_req("after", [9, 8, 7], [6], pool_idx=5))
    hook.settle()
    assert hook.admission.released == ["aborted", "HEALTH_CHECK_123", WARMUP + "0", "after"]
    rec = hook.reader.next(timeout=5)  # the next record in the ring is the one that was emitted
    assert rec.rid == "after"
    assert hook.writer.stats["records"] == 1 and hook.writer.stats["dropped"] == 0


def test_repeated_slots_give_the_same_row_at_each_position(hook):
    """A request whose table row names one slot twice (as when two positions share a page of a pool
    that hands out a slot again): each position gets that slot's row."""
    hook.table[3, :6] = torch.tensor([50, 51, 50, 52, 52, 7], dtype=torch.int32)
    prompt = [1, 2, 3, 4, 5, 6]
    hook.finish(_req("repeat", prompt, [0], pool_idx=3))
    _assert_record(hook, "repeat", prompt, [50, 51, 50, 52, 52, 7], 6, [0])


def test_records_of_successive_requests_come_from_their_own_pool_rows(hook):
    for i, idx in enumerate((5, 0, 3)):
        prompt = list(range(10 + i, 10 + i + 4 + 3 * i))
        hook.finish(_req(f"seq-{i}", prompt, [1, 2], pool_idx=idx))
    for i, idx in enumerate((5, 0, 3)):
        prompt = list(range(10 + i, 10 + i + 4 + 3 * i))
        T = len(prompt) + 1
        _assert_record(hook, f"seq-{i}", (prompt + [1, 2])[:T], hook.table[idx, :T].tolist(), len(prompt), [1, 2])


def test_a_request_with_no_token_at_all_is_not_emitted_but_released(hook):
    """An empty prompt that generated nothing has no row and no last token: no record (there is nothing
    to say), its admission reservation released, and the next request's record follows as usual."""
    hook.finish(_req("empty", [], [], pool_idx=0))
    hook.finish(_req("after-empty", [9, 8], [6], pool_idx=2))
    hook.settle()
    assert hook.admission.released == ["empty", "after-empty"]
    assert hook.reader.next(timeout=5).rid == "after-empty"
    assert hook.writer.stats["dropped"] == 0


def test_accept_below_keeps_the_requests_the_draft_did_poorly_on(hook, monkeypatch):
    """--hs-capture-accept-below 1.5: a request whose accept length (output tokens per verify step, SGLang's
    spec_accept_length) is 1.5 or more leaves a draft_accepted marker; one below, one opted in and one that
    never reached a verify step keep their records."""
    from sglang_hs import NotCaptured
    from sglang_hs.server.patches import capture_hooks

    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN

    from sglang_hs.server.store.draft_selection import DraftSelection

    monkeypatch.setattr(capture_hooks, "_selection", DraftSelection(below=1.5))
    cases = {"poor": (6, 5, False), "good": (6, 4, False), "good-opted": (6, 2, True), "no-verify": (1, 0, False)}
    # a verify step's accepted run that reached past the stop: 8 tokens appended, 5 through the stop (SGLang's
    # completion_tokens), 4 verifies: 1.25, kept (8 / 4 would drop it)
    past = _req("past-stop", [1, 2, 3], list(range(40, 48)), pool_idx=4, finished_reason=FINISH_MATCHED_TOKEN(44),
                finished_len=5)
    past.spec_verify_ct = 4
    assert capture_hooks.accept_length(past) == 1.25
    for i, (rid, (n, verifies, opted)) in enumerate(cases.items()):
        req = _spec_req(rid, n, verifies, opted, pool_idx=i)
        hook.finish(req)
    hook.settle()
    hook.finish(past)
    hook.settle()
    assert capture_hooks.accept_length(req) is None and hook.admission.stats["skipped_draft_accepted"] == 1
    with pytest.raises(NotCaptured, match="draft_accepted"):
        hook.reader.take("good", timeout=5)
    for i, (rid, (n, _, _)) in enumerate(cases.items()):
        if rid != "good":
            output = list(range(40, 40 + n))
            _assert_record(hook, rid, ([1, 2, 3] + output)[:2 + n], hook.table[i, :2 + n].tolist(), 3, output)
    _assert_record(hook, "past-stop", [1, 2, 3, 40, 41, 42, 43], hook.table[4, :7].tolist(), 3, [40, 41, 42, 43, 44])


def test_accept_lowest_keeps_the_lowest_fraction_of_recent_traffic(hook, monkeypatch):
    """--hs-capture-accept-lowest 0.5 over a window of 4: each finished request enters the window, a request not
    captured (its admission decision: not sampled) too, and a captured one keeps its record when fewer than half
    of the window, itself included, are below its accept length; opted-in ones always do."""
    from sglang_hs import NotCaptured
    from sglang_hs.server.patches import capture_hooks
    from sglang_hs.server.store.admission import Ticket
    from sglang_hs.server.store.draft_selection import DraftSelection

    monkeypatch.setattr(capture_hooks, "_selection", DraftSelection(lowest=0.5, window=4))
    not_sampled = {"w-not-sampled"}
    plain_finish = hook.admission.finish
    hook.admission.finish = lambda rid, req=None: Ticket(str(rid), 1, decision=("not_sampled", True)) \
        if rid in not_sampled else plain_finish(rid, req)
    # (rid, output tokens, verify steps, opted in): accept lengths 2, 1, 3, 1.5, 2, 1.5, 3 in finish order
    cases = [("w-a", 4, 2, False), ("w-not-sampled", 2, 2, False), ("w-opted", 6, 2, True), ("w-b", 3, 2, False),
             ("w-c", 4, 2, False), ("w-d", 3, 2, False), ("w-e", 6, 2, False)]
    # window after each: [2] kept (0 below); [2, 1]; [2, 1, 3] opted in, kept; [2, 1, 3, 1.5]: 1 of 4 below 1.5,
    # kept; [1, 3, 1.5, 2]: 2 of 4 below 2, dropped; [3, 1.5, 2, 1.5]: 0 below, kept; [1.5, 2, 1.5, 3]: 3 below, dropped
    dropped = {"w-c", "w-e"}
    for i, (rid, n, verifies, opted) in enumerate(cases):
        hook.finish(_spec_req(rid, n, verifies, opted, pool_idx=i))
        hook.settle()
    assert hook.admission.stats["skipped_draft_accepted"] == len(dropped)
    for i, (rid, n, _, _) in enumerate(cases):
        if rid in dropped or rid in not_sampled:
            with pytest.raises(NotCaptured, match="draft_accepted" if rid in dropped else "not_sampled"):
                hook.reader.take(rid, timeout=5)
        else:
            output = list(range(40, 40 + n))
            _assert_record(hook, rid, ([1, 2, 3] + output)[:2 + n], hook.table[i, :2 + n].tolist(), 3, output)


@pytest.mark.parametrize("prompt,output", [
    (array("q", [5, 129279, 7]), array("q", [9, 2])),  # SGLang 0.5.23's own types
    ([5, 129279, 7], [9, 2]),  # lists
    (array("q", [5, 129279, 7]), array("i", [9, 2])),  # an array of another kind: extend() alone refuses it
    (array("q", [5, 129279, 7]), []),  # nothing generated
])
def test_token_record_is_the_prompt_then_the_output_as_int64(prompt, output):
    from sglang_hs.server.patches.capture_hooks import _token_record

    tokens = _token_record(prompt, output)
    assert tokens.typecode == "q" and tokens.tolist() == list(prompt) + list(output)
    assert list(prompt) == [5, 129279, 7]  # the request's own arrays are not changed


def test_a_speculative_requests_record_carries_each_verify_steps_accepted_drafts(hook, monkeypatch):
    """SGLang calls Req.update_spec_correct_drafts_histogram once per verify step with the drafts that step
    accepted; through the wrap its histogram stays SGLang's and the record's metadata lists the steps in
    order. A request that never verified (a plain server's) has no metadata."""
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hs.server.patches import capture_hooks
    from sglang_hs.server.store.admission import meta_bound

    monkeypatch.setitem(capture_hooks.ORIGINALS, "update_spec_correct_drafts_histogram",
                        Req.update_spec_correct_drafts_histogram)
    monkeypatch.setattr(Req, "update_spec_correct_drafts_histogram", capture_hooks._step_accepted)
    steps = [1, 0, 3, 0, 0, 2]
    req = _req("spec", [1, 2, 3], list(range(40, 52)), pool_idx=0)
    for n in steps:
        req.spec_verify_ct += 1
        req.spec_num_correct_drafts += n
        req.update_spec_correct_drafts_histogram(n)
    assert req.spec_correct_drafts_histogram == [3, 1, 1, 1]  # SGLang's own, unchanged
    hook.finish(req)
    hook.finish(_req("plain", [1, 2, 3], [40, 41], pool_idx=1))
    _assert_record(hook, "plain", [1, 2, 3, 40], hook.table[1, :4].tolist(), 3, [40, 41])
    hook.settle()
    rec = hook.reader.take("spec", timeout=5)
    assert rec.meta == {"speculative": {"verify_steps": 6, "accepted_drafts": steps}}
    assert len(rec.meta["speculative"]["accepted_drafts"]) == req.spec_verify_ct
    assert sum(rec.meta["speculative"]["accepted_drafts"]) == req.spec_num_correct_drafts
    assert len(capture_hooks.record_meta(req)) <= meta_bound(len(req.output_ids))  # admission reserved enough


def test_confidence_below_keeps_the_requests_the_draft_was_unsure_of(hook, monkeypatch):
    """--hs-capture-confidence-below 0.5 with a DSpark confidence head: DsparkStepObservers.observe_verify_step
    (wrapped) hands each verify pass's [bs, gamma] confidence with the batch's requests; each request keeps its
    passes' means, as many as its verify steps (a pass run past its finish is not its). A request whose mean is
    0.5 or more leaves a draft_accepted marker; one below, and one opted in, keep their records, whose metadata
    carries each pass's mean (4 decimals) beside the accepted drafts."""
    import torch
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hs import NotCaptured
    from sglang_hs.server.patches import capture_hooks
    from sglang_hs.server.store.admission import meta_bound
    from sglang_hs.server.store.draft_selection import DraftSelection

    monkeypatch.setattr(capture_hooks, "_selection", DraftSelection(confidence_below=0.5))
    monkeypatch.setitem(capture_hooks.ORIGINALS, "update_spec_correct_drafts_histogram",
                        Req.update_spec_correct_drafts_histogram)
    monkeypatch.setattr(Req, "update_spec_correct_drafts_histogram", capture_hooks._step_accepted)
    monkeypatch.setitem(capture_hooks.ORIGINALS, "observe_verify_step", lambda self, **kw: None)
    reqs = [_spec_req(rid, 6, 0, opted, pool_idx=i)
            for i, (rid, opted) in enumerate((("unsure", False), ("sure", False), ("sure-opted", True)))]
    passes = [torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.8, 0.7], [0.9, 0.9, 0.9]]),  # means 0.2, 0.8, 0.9
              torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.3, 0.1], [0.6, 0.6, 0.6]]),  # 0.6, 0.2, 0.6
              torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])]  # past the finish: not theirs
    for k, confidence in enumerate(passes):
        capture_hooks._observe_verify_step(None, reqs=reqs, bs=3, confidence=confidence)
        if k < 2:
            for req in reqs:
                req.spec_verify_ct += 1
                req.update_spec_correct_drafts_histogram(k)
    assert [capture_hooks.confidence_steps(r) for r in reqs] == \
        [pytest.approx([0.2, 0.6]), pytest.approx([0.8, 0.2]), pytest.approx([0.9, 0.6])]
    for req in reqs:  # means 0.4, 0.5, 0.75
        hook.finish(req)
    hook.settle()
    assert hook.admission.stats["skipped_draft_accepted"] == 1
    with pytest.raises(NotCaptured, match="draft_accepted"):
        hook.reader.take("sure", timeout=5)
    for rid, means in (("unsure", [0.2, 0.6]), ("sure-opted", [0.9, 0.6])):
        rec = hook.reader.take(rid, timeout=5)
        assert rec.meta == {"speculative": {"verify_steps": 2, "accepted_drafts": [0, 1], "confidence": means}}
    req = _spec_req("long", 4000, 0, False, pool_idx=3)  # the most steps (one token each) at the widest means
    for _ in range(4000):
        capture_hooks._observe_verify_step(None, reqs=[req], bs=1, confidence=torch.full((1, 3), 0.123456))
        req.update_spec_correct_drafts_histogram(65535)
    assert len(capture_hooks.record_meta(req)) <= meta_bound(4000)  # admission reserved enough
    capture_hooks._observe_verify_step(None, reqs=reqs, bs=3, confidence=None)  # no head: nothing kept


def test_confidence_steps_under_the_overlap_scheduler(monkeypatch):
    """The overlap scheduler's order: the forward of pass k + 1 (observe_verify_step) runs before SGLang processes
    pass k's result (update_spec_correct_drafts_histogram), and the draft sampler rewrites its confidence buffer in
    place at every pass. Each request's steps still get their own pass's means, in order, read only once the pass's
    result is processed (on a GPU, after the step's copies to the host are complete), and none of a later pass."""
    import torch
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hs.server.patches import capture_hooks

    monkeypatch.setattr(capture_hooks, "_writer", object())  # capture on: the hook keeps the means
    monkeypatch.setitem(capture_hooks.ORIGINALS, "update_spec_correct_drafts_histogram",
                        Req.update_spec_correct_drafts_histogram)
    monkeypatch.setattr(Req, "update_spec_correct_drafts_histogram", capture_hooks._step_accepted)
    monkeypatch.setitem(capture_hooks.ORIGINALS, "observe_verify_step", lambda self, **kw: None)
    reqs = [_spec_req(rid, 6, 0, False, pool_idx=i) for i, rid in enumerate(("a", "b"))]
    buffer = torch.empty(4, 3)  # the sampler's confidence_out: one buffer, rows past bs are DP padding
    means = [[0.1, 0.7], [0.3, 0.5], [0.9, 0.2], [0.6, 0.4]]  # pass k's mean of request a, b

    def forward(k):
        buffer.fill_(-1.0)
        for row, mean in enumerate(means[k]):
            buffer[row] = torch.tensor([mean - 0.05, mean, mean + 0.05])
        capture_hooks._observe_verify_step(None, reqs=reqs, bs=2, confidence=buffer[:2])

    def result(k):
        for req in reqs:
            req.spec_verify_ct += 1
            req.update_spec_correct_drafts_histogram(k)

    forward(0)
    for k in range(3):  # pass 3 is run past both requests' finish
        forward(k + 1)
        result(k)
        assert [list(r.hs_draft_confidence) for r in reqs] == \
            [pytest.approx([means[j][i] for j in range(k + 1)]) for i in range(2)]  # read up to pass k only
    assert [capture_hooks.confidence_steps(r) for r in reqs] == \
        [pytest.approx([0.1, 0.3, 0.9]), pytest.approx([0.7, 0.5, 0.2])]


def test_confidence_steps_of_a_request_retracted_mid_flight(monkeypatch):
    """The overlap scheduler retracts a request while choosing the next batch, after the pass just run observed it
    and before that pass's result is processed, which then skips it (no verify step counted). Its later steps get
    their own passes' means, not the skipped pass's (reset_for_retract, wrapped, drops that pending one)."""
    import torch
    from sglang.srt.managers.schedule_batch import Req

    from sglang_hs.server.patches import capture_hooks

    monkeypatch.setattr(capture_hooks, "_writer", object())
    monkeypatch.setitem(capture_hooks.ORIGINALS, "update_spec_correct_drafts_histogram",
                        Req.update_spec_correct_drafts_histogram)
    monkeypatch.setattr(Req, "update_spec_correct_drafts_histogram", capture_hooks._step_accepted)
    monkeypatch.setitem(capture_hooks.ORIGINALS, "observe_verify_step", lambda self, **kw: None)
    monkeypatch.setitem(capture_hooks.ORIGINALS, "reset_for_retract", lambda self: None)  # SGLang's own reset
    req = _spec_req("retracted", 6, 0, False, pool_idx=0)

    def forward(mean):
        capture_hooks._observe_verify_step(None, reqs=[req], bs=1, confidence=torch.full((1, 3), mean))

    def result(accepted):
        req.spec_verify_ct += 1
        req.update_spec_correct_drafts_histogram(accepted)

    forward(0.1)
    forward(0.2)  # pass 1 runs
    result(1)  # pass 0's result
    capture_hooks._retracted(req)  # retracted while the next batch is chosen; pass 1's result will skip it
    forward(0.3)  # back in a batch later (re-prefilled): pass 2
    result(0)  # pass 2's result
    assert capture_hooks.confidence_steps(req) == pytest.approx([0.1, 0.3])


def test_confidence_selection_with_a_draft_that_has_no_head_says_so_once(monkeypatch, caplog):
    """--hs-capture-confidence-below while the DSpark draft hands no confidence (a draft config without the head):
    every request keeps its record, and the log says why, once."""
    import logging

    from sglang_hs.server.patches import capture_hooks
    from sglang_hs.server.store.draft_selection import DraftSelection

    monkeypatch.setattr(capture_hooks, "_writer", object())
    monkeypatch.setattr(capture_hooks, "_selection", DraftSelection(confidence_below=0.5))
    monkeypatch.setattr(capture_hooks, "_said_no_head", False, raising=False)
    monkeypatch.setitem(capture_hooks.ORIGINALS, "observe_verify_step", lambda self, **kw: None)
    req = _spec_req("no-head", 6, 0, False, pool_idx=0)
    with caplog.at_level(logging.WARNING, logger=capture_hooks.logger.name):
        for _ in range(3):
            capture_hooks._observe_verify_step(None, reqs=[req], bs=1, confidence=None)
    said = [r for r in caplog.records if "computes no confidence" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert capture_hooks.confidence_steps(req) == []
