"""The finish hand-over's slot-id copy under SGLang's overlap scheduler (issue 32: a GPU that idled on
the next step's write order), ordered by pinned-flag gates (cuStreamWaitValue64): whether correct
code passes never depends on timing.

SGLang 0.5.23's overlap loop, one iteration: ingest_requests (our hook: mark_iteration), launch step
N+1 on the forward stream, make the schedule stream wait for it (`_apply_war_barrier`), then process
step N's results on the schedule stream, where the finish hook hands a request over.
Three orderings the hand-over must keep:

1. it does not wait for forward N+1: a copy behind the barrier would start the gather only after that
   forward, while step N+2's writes into slots freed at N wait for the gather (GPU idle);
2. it comes after what the previous iteration's result processing queued on the schedule stream: the
   radix cache's checkpoint of an unfinished request rewrites its req_to_token row there, behind the
   previous barrier, and the request may finish in the next step;
3. the schedule stream's own later rewrite of the row (the request's pool row reused) waits for it.

Each case writes rows at two sets of slots with different values and checks the record row by row
against the set it must come from. Where a broken order would show only if the GPU ran something before
the test opens a gate, the test first checks, for CHECK_S, that nothing moved while the gate was closed
(correct code cannot move then, so this never fails it; a broken order is caught unless the GPU takes
longer than that to run a small copy)."""
import os
import shutil
import tempfile
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store.finisher import FinishWorker, _stream_wait_value64  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS, N_LAYERS, H, SLOTS, T = [1, 3], 6, 256, 4096, 300
K = len(LAYERS)
GUARD_S = 60  # only a broken build waits this long: every gate is then opened so the process can end
CHECK_S = 0.5


def _stays(predicate, seconds=CHECK_S) -> bool:
    """predicate() holds throughout `seconds` (polled): a gate-held state that correct code keeps."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not predicate():
            return False
        time.sleep(0.001)
    return predicate()


class Gates:
    """Pinned flags streams wait on (cuStreamWaitValue64 >= 1); all opened at the end whatever happens."""

    def __init__(self):
        self.flags = []

    def hold(self, stream) -> torch.Tensor:
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        _stream_wait_value64(stream.cuda_stream, flag.data_ptr(), 1)
        self.flags.append(flag)
        return flag

    def open_all(self):
        for f in self.flags:
            f[0] = 1


@pytest.fixture
def rig(request):
    copy = request.param
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    gates = Gates()
    spec = CaptureSpec.resolve(LAYERS, True, N_LAYERS, H)
    w = CaptureWriter(d, spec, SLOTS, torch.bfloat16, 64 << 20, device="cuda", copy=copy, staging_rows=2 * T)
    worker = FinishWorker(w)
    g = torch.Generator(device="cuda").manual_seed(3)
    perm = torch.randperm(SLOTS - 1, device="cuda", generator=g) + 1
    old, new = perm[:T].to(torch.int32), perm[T: 2 * T].to(torch.int32)  # two sets of slots
    rows = {}
    for name, slots in (("old", old), ("new", new)):  # distinct rows at each set (the steps that wrote them)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        aux, last = torch.cat([x * (k + 2) for k in range(K)], 1), x.neg()
        w.before_step()
        w.copy(aux, last, slots)
        w.after_step(T, False)
        rows[name] = torch.cat([aux.view(T, K, H), last.view(T, 1, H)], 1).cpu()
    torch.cuda.current_stream().synchronize()  # those steps' results are processed: copy_done synchronised
    worker.submit("warm-up", list(range(T)), old)  # the first CUDA hand-over (before any mark: current stream)
    worker.mark_iteration()
    worker.drain()
    try:
        yield dict(d=d, w=w, worker=worker, gates=gates, old=old, new=new, rows=rows)
    finally:
        gates.open_all()
        torch.cuda.synchronize()
        worker.close()
        w.close()
        shutil.rmtree(d, ignore_errors=True)


def _published(worker, seq) -> bool:
    worker.flush()
    t0 = time.monotonic()
    while worker._done_now() < seq and time.monotonic() - t0 < GUARD_S:
        time.sleep(0.001)
    return worker._done_now() >= seq


def _record_rows(rig, rid):
    rig["worker"].drain()
    with HiddenStateReader(rig["d"]) as reader:
        rec = reader.take(rid, timeout=60)
    assert rec.input_ids.tolist() == list(range(7, 7 + T))
    return torch.cat([rec.aux_hidden_states, rec.last_hidden_state[:, None]], 1)


COPIES = pytest.mark.parametrize("rig", ["direct", "staging", "deferred"], indirect=True)


@COPIES
def test_does_not_wait_for_the_forward_launched_before_result_processing(rig):
    worker, gates = rig["worker"], rig["gates"]
    table = rig["new"].clone()
    torch.cuda.current_stream().synchronize()
    worker.mark_iteration()  # iteration start
    forward = torch.cuda.Stream()
    gates.hold(forward)  # step N+1's forward, held
    done = torch.cuda.Event()
    done.record(forward)
    torch.cuda.current_stream().wait_stream(forward)  # SGLang's write-after-read barrier
    worker.submit("r", list(range(7, 7 + T)), table)  # step N's result processing
    published = _published(worker, worker._handed)
    held = not done.query()
    gates.open_all()
    assert held, "the gated forward finished before the check: the gate did not hold it"
    assert published, (f"the record was not published within {GUARD_S} s while the forward launched before the "
                       "result processing ran: the hand-over's slot copy waits behind it")
    assert torch.equal(_record_rows(rig, "r"), rig["rows"]["new"])


@COPIES
def test_comes_after_the_previous_iterations_rewrite_of_the_row(rig):
    worker, gates = rig["worker"], rig["gates"]
    table = rig["old"].clone()
    torch.cuda.current_stream().synchronize()
    cur = torch.cuda.current_stream()
    behind = torch.cuda.Stream()
    checkpoint_gate = gates.hold(behind)  # what the previous iteration's rewrite still queues behind
    cur.wait_stream(behind)
    table.copy_(rig["new"])  # the radix cache's checkpoint: the row now names the tree's slots
    worker.mark_iteration()  # the next iteration starts
    forward = torch.cuda.Stream()
    gates.hold(forward)  # its forward, held
    cur.wait_stream(forward)  # its barrier
    worker.submit("r", list(range(7, 7 + T)), table)  # the request finishes
    worker.flush()
    seq = worker._handed
    assert _stays(lambda: worker._done_now() < seq), \
        "the record was published while the previous iteration's rewrite of the row was still held"
    checkpoint_gate[0] = 1  # the rewrite runs now
    assert _published(worker, worker._handed), "the record was not published with the forward held"
    gates.open_all()
    assert torch.equal(_record_rows(rig, "r"), rig["rows"]["new"]), \
        "the record holds the rows of the slots the row named before the previous iteration rewrote it"


@COPIES
def test_a_later_rewrite_of_the_row_waits_for_the_copy(rig):
    worker, gates = rig["worker"], rig["gates"]
    table = rig["new"].clone()
    torch.cuda.current_stream().synchronize()
    worker.mark_iteration()
    side_gate = gates.hold(worker._side)  # the side stream's copy is held
    worker.submit("r", list(range(7, 7 + T)), table)
    worker.flush()
    table.copy_(rig["old"])  # SGLang reuses the request's pool row, on the current stream
    rewritten = torch.cuda.Event()
    rewritten.record()
    assert _stays(lambda: not rewritten.query()), "the row was rewritten while the hand-over's copy was held"
    side_gate[0] = 1
    assert _published(worker, worker._handed)
    gates.open_all()
    assert torch.equal(_record_rows(rig, "r"), rig["rows"]["new"]), \
        "the row was rewritten before the hand-over copied it"
