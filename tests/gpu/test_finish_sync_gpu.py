"""The synchronous finish (CaptureWriter.finish: SGLANG_HS_SYNC_FINISH=1, and the KV allocators the finish
worker is not checked with, the SWA ones DeepSeek-V4 runs on) under SGLang's overlap scheduler (issue 48,
item 5): it synchronised the current (schedule) stream and copied the slot ids with `.cpu()` there, behind
SGLang's write-after-read barrier, so every finish waited for the whole next forward. Now it copies the ids
on the side stream after the iteration's start mark (slot_ids.py). Ordered by pinned-flag gates
(cuStreamWaitValue64): the next forward is held, and the finish must complete and publish the right rows
while it is; a broken build blocks, and the test opens the gate after GUARD_S to end."""
import os
import shutil
import tempfile
import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from test_finish_overlap_gpu import GUARD_S, Gates  # noqa: E402

from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS, N_LAYERS, H, SLOTS, T = [1, 3], 6, 256, 4096, 300
K = len(LAYERS)


@pytest.mark.parametrize("copy", ["direct", "staging", "deferred"])
def test_the_synchronous_finish_does_not_wait_for_the_next_forward(copy):
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    gates = Gates()
    w = CaptureWriter(d, CaptureSpec.resolve(LAYERS, True, N_LAYERS, H), SLOTS, torch.bfloat16, 64 << 20,
                      device="cuda", copy=copy, staging_rows=2 * T)
    try:
        g = torch.Generator(device="cuda").manual_seed(5)
        slots = (torch.randperm(SLOTS - 1, device="cuda", generator=g)[:T] + 1).to(torch.int32)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        aux, last = torch.cat([x * (k + 2) for k in range(K)], 1), x.neg()
        w.before_step()
        w.copy(aux, last, slots)
        w.after_step(T, False)
        want = torch.cat([aux.view(T, K, H), last.view(T, 1, H)], 1).cpu()
        torch.cuda.current_stream().synchronize()  # the step's results are processed: copy_done synchronised
        w.finish("warm-up", list(range(T)), slots)
        # The request's req_to_token row, written by an earlier iteration: before this iteration's mark. (Cloned
        # after the barrier below, the row itself waited behind the held forward, and the slot ids copied on
        # the side stream were the clone's uninitialised memory: the gather refused a slot of -1071529666.)
        table = slots.clone()
        w.slot_ids.mark_iteration()  # the next iteration starts
        forward = torch.cuda.Stream()
        gates.hold(forward)  # its forward, held
        held = torch.cuda.Event()
        held.record(forward)
        torch.cuda.current_stream().wait_stream(forward)  # SGLang's write-after-read barrier
        done = threading.Event()
        finisher = threading.Thread(target=lambda: (w.finish("r", list(range(7, 7 + T)), table), done.set()))
        finisher.start()  # (its current stream is the device's default one, as this thread's)
        finished = done.wait(GUARD_S)
        still_held = not held.query()
        gates.open_all()
        finisher.join(60)
        assert still_held, "the gated forward finished before the check: the gate did not hold it"
        assert finished, f"the synchronous finish did not return within {GUARD_S} s with the next forward held"
        with HiddenStateReader(d) as reader:
            reader.take("warm-up", timeout=60)
            rec = reader.take("r", timeout=60)
        assert rec.input_ids.tolist() == list(range(7, 7 + T))
        assert torch.equal(torch.cat([rec.aux_hidden_states, rec.last_hidden_state[:, None]], 1), want)
    finally:
        gates.open_all()
        torch.cuda.synchronize()
        w.close()  # unregisters the store: the next case's, mapped where this one was, is "already registered" else
        shutil.rmtree(d, ignore_errors=True)
