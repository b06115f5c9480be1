"""The finish hand-over performs no device synchronisation (issue 16, item 4), without SGLang.

A stand-in model step writes rows into the store through the writer (--hs-copy direct: mapped host
memory; staging: the device stage, shipped after the step), then a long matmul loop keeps the current
stream busy, and the scheduler's side of finishing (FinishWorker.submit with the request's slot ids as
a DEVICE tensor, a view of a req_to_token table, as SGLang's result processing hands it) runs under
torch.cuda.set_sync_debug_mode("error"): any blocking copy, `.cpu()`, `.item()` or stream/device
synchronize on any thread during the hand-over raises. The stream must still be busy when the
hand-overs return (nothing waited for it). As in SGLang, the step that wrote a request's rows is
synchronised by the host before the request is found finished (process_batch_result: copy_done).
Then every record is read back and compared row by row with the rows the step computed, so the asynchronous path is also exact: the slot ids came across
after the table was written, and the rows had landed before the worker gathered them."""
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store.finisher import FinishWorker  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS, N_LAYERS, H, SLOTS, POOL, MAXLEN = [2, 4, 5], 8, 512, 8192, 8, 600
K = len(LAYERS)


@pytest.mark.parametrize("copy", ["direct", "staging", "deferred"])
def test_finish_hands_over_without_a_device_sync(copy):
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        _run(d, copy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        shutil.rmtree(d, ignore_errors=True)


def _run(d, copy):
    spec = CaptureSpec.resolve(LAYERS, True, N_LAYERS, H)
    w = CaptureWriter(d, spec, SLOTS, torch.bfloat16, 256 << 20, device="cuda", copy=copy, staging_rows=MAXLEN)
    worker = FinishWorker(w)
    g = torch.Generator(device="cuda").manual_seed(0)
    # req_to_token as SGLang keeps it: int32 on the device, scattered slots, never slot 0 (padding)
    table = (torch.randperm(SLOTS - 1, device="cuda", generator=g)[: POOL * MAXLEN] + 1).view(POOL, MAXLEN)
    table = table.to(torch.int32)
    wt = torch.randn(H, K * H, device="cuda", dtype=torch.bfloat16, generator=g) / H**0.5
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = [1, 37, 256, 599, 128, 3, 511, 64]
    want = {}
    for i, T in enumerate(lengths):
        loc = table[i, :T]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        aux, last = x @ wt, torch.nn.functional.rms_norm(x, (H,))
        w.before_step()
        w.copy(aux, last, loc)  # the overlay's copy inside the forward
        w.after_step(T, False)
        want[f"r{i}"] = (torch.cat([aux.view(T, K, H), last.view(T, 1, H)], 1), T)
        # SGLang's result processing synchronises the batch's copy_done (recorded after its forward)
        # before it finds a request finished: the step's rows and the table are final at the hand-over
        step_done = torch.cuda.Event()
        step_done.record()
        step_done.synchronize()
        y = busy
        for _ in range(200):  # the next step's forward, already queued on the stream (overlap scheduler)
            y = (y @ busy).clamp_(-1, 1)
        ids = list(range(1000 + i, 1000 + i + T))
        torch.cuda.set_sync_debug_mode("error")
        try:
            worker.submit(f"r{i}", ids, loc)  # what the finish hook hands over: a device view of the table
            busy_after = not torch.cuda.current_stream().query()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert busy_after, "the stream was idle when the hand-over returned: something waited for it"
        table[i, :T] = 0  # SGLang reuses the request's table row once it is released: the copy came first
    worker.drain()
    assert w.stats["records"] == len(lengths) and w.stats["dropped"] == 0
    with HiddenStateReader(d) as reader:
        for rid, (rows, T) in want.items():
            rec = reader.take(rid, timeout=60)
            assert rec.input_ids.tolist() == list(range(1000 + int(rid[1:]), 1000 + int(rid[1:]) + T))
            got = torch.cat([rec.aux_hidden_states, rec.last_hidden_state[:, None]], 1)
            assert torch.equal(got, rows.cpu()), f"{rid}: rows differ from what the step computed"
    worker.close()
    w.close()
