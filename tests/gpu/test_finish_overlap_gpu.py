"""Under the overlap scheduler the gather of a finished request does not wait for the forward launched
just before its result processing (issue 32: a GPU that idled on the next step's write order).

SGLang 0.5.23's overlap loop launches step N, then makes the schedule stream wait for the whole of it
(`_apply_war_barrier`: `schedule_stream.wait_stream(forward_stream)` for a prefill), then processes
step N-1's results on that stream: the finish hook's hand-over runs there. A slot-id copy queued on that
stream starts only after forward N; the worker gathers after it, and step N+1's writes into slots freed
at N-1 (`order_device_writes`) wait for that gather: the GPU idles for the gather's length.

Here the forward is a stream held by a gate (cuStreamWaitValue64 on a pinned flag the test sets, so
nothing depends on timing): the current stream waits for it as the schedule stream does, the request
is handed over, and the worker must publish its record while the gate is still closed. Then the gate
opens, the table row is rewritten on the current stream (SGLang reusing the request's row), and the
record is read back row by row: the slot ids came across before the rewrite."""
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
GUARD_S = 60  # only a broken build gets here: the gate is then opened so the process can end


@pytest.mark.parametrize("copy", ["direct", "staging"])
def test_gather_does_not_wait_for_the_forward_launched_before_result_processing(copy):
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    gate = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    try:
        spec = CaptureSpec.resolve(LAYERS, True, N_LAYERS, H)
        w = CaptureWriter(d, spec, SLOTS, torch.bfloat16, 64 << 20, device="cuda", copy=copy, staging_rows=T)
        worker = FinishWorker(w)
        g = torch.Generator(device="cuda").manual_seed(3)
        table = (torch.randperm(SLOTS - 1, device="cuda", generator=g)[:T] + 1).to(torch.int32)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        aux, last = torch.cat([x * (k + 2) for k in range(K)], 1), x.neg()
        w.before_step()
        w.copy(aux, last, table)  # step N-1's forward
        w.after_step(T, False)
        torch.cuda.current_stream().synchronize()  # its results are processed: copy_done synchronised
        forward = torch.cuda.Stream()
        _stream_wait_value64(forward.cuda_stream, gate.data_ptr(), 1)  # step N's forward: held by the gate
        forward_done = torch.cuda.Event()
        forward_done.record(forward)
        torch.cuda.current_stream().wait_stream(forward)  # SGLang's write-after-read barrier
        worker.submit("r0", list(range(7, 7 + T)), table)  # step N-1's result processing
        worker.flush()
        t0 = time.monotonic()
        while worker._done_now() < 1 and time.monotonic() - t0 < GUARD_S:
            time.sleep(0.001)
        published = worker._done_now() >= 1
        held = not forward_done.query()
        gate[0] = 1  # open: the forward (and the barrier behind it) runs
        table.zero_()  # on the current stream, behind the barrier: SGLang reusing the request's row
        torch.cuda.synchronize()
        assert held, "the gated forward finished before the check: the gate did not hold it"
        assert published, (f"the record was not published within {GUARD_S} s while the forward launched before "
                           "the result processing ran: the hand-over's slot copy waits behind it")
        worker.drain()
        with HiddenStateReader(d) as reader:
            rec = reader.take("r0", timeout=60)
        want = torch.cat([aux.view(T, K, H), last.view(T, 1, H)], 1).cpu()
        got = torch.cat([rec.aux_hidden_states, rec.last_hidden_state[:, None]], 1)
        assert rec.input_ids.tolist() == list(range(7, 7 + T))
        assert torch.equal(got, want), "the record's rows differ from what the step wrote"
        worker.close()
        if w.staging is not None:
            w.staging.close()
    finally:
        gate[0] = 1
        torch.cuda.synchronize()
        shutil.rmtree(d, ignore_errors=True)
