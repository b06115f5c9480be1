"""CUDA, --hs-copy direct: the next write of a slot waits, on the GPU, for the gather that still reads it
(FinishWorker.order_device_writes: cuStreamWaitValue64 on the worker's pinned done counter), without SGLang.

A stand-in step writes rows A into slots S; the request is handed over (its gather held back by a gate on
the worker); the next step is ordered (order_device_writes) and overwrites S with rows B. While the gate is
closed the overwrite must not have run (an event recorded after it stays pending: the stream is parked on
the counter, not the host); once the gate opens the record read back holds A, row for row, and the store
holds B. With nothing pending no wait is issued at all."""
import os
import shutil
import tempfile
import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store.finisher import FinishWorker  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS, N_LAYERS, H, SLOTS, T = [2, 4, 5], 8, 7168, 4096, 333  # DeepSeek-V3 width, an odd request length
K = len(LAYERS)


def _step(w, loc, g):
    x = torch.randn(loc.shape[0], H, device="cuda", dtype=torch.bfloat16, generator=g)
    aux = torch.cat([x * (k + 2) for k in range(K)], 1)
    last = x * 0.5
    w.before_step()
    w.copy(aux, last, loc)
    w.after_step(loc.shape[0], False)
    return torch.cat([aux.view(-1, K, H), last.view(-1, 1, H)], 1)


def _gate(worker) -> threading.Event:
    """Hold the worker's gathers back until the returned event is set."""
    gate, publish = threading.Event(), worker._publish

    def gated(job):
        assert gate.wait(timeout=300), "the test never opened the gate"
        publish(job)

    worker._publish = gated
    return gate


def _record_rows(d, rid):
    """Record `rid`'s rows, layers then the final state: [T, K + 1, H]."""
    with HiddenStateReader(d) as reader:
        rec = reader.take(rid, timeout=60)
        return torch.cat([rec.aux_hidden_states, rec.last_hidden_state[:, None]], 1)


def _overwrite_held_then_released(worker, gate, d, rid, why):
    """The overwrite just issued must not run while the gate holds `rid`'s gather back (an event recorded after
    it stays pending: the stream is parked on the worker's counter); then the gate opens, and `rid`'s record
    rows are returned once the overwrite has run too."""
    after = torch.cuda.Event()
    after.record()
    held = not after.query()
    gate.set()  # before any assertion: a closed gate would park the stream (and the next test) for good
    worker.drain()
    after.synchronize()
    assert held, why
    return _record_rows(d, rid)


def test_an_overwrite_waits_on_the_gpu_for_the_gather_of_its_slots(request):
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        w = CaptureWriter(d, CaptureSpec.resolve(LAYERS, True, N_LAYERS, H), SLOTS, torch.bfloat16, 256 << 20,
                          device="cuda", copy="direct")
        from sglang_hs.server.store.finisher import check_stream_wait

        check_stream_wait()  # the start-up check passes on this driver
        worker = FinishWorker(w)
        assert worker.order_device_writes() is False  # nothing handed over: nothing to wait for
        gate = _gate(worker)
        request.addfinalizer(gate.set)  # whatever fails, the worker and the stream are let go
        g = torch.Generator(device="cuda").manual_seed(0)
        loc = (torch.randperm(SLOTS - 1, device="cuda", generator=g)[:T] + 1).to(torch.int32)
        rows_a = _step(w, loc, g)
        worker.submit("a", list(range(T)), loc)
        assert worker.order_device_writes() is True  # the gather of "a" is pending: the stream waits
        rows_b = _step(w, loc, g)  # the same slots, overwritten by the next step
        got = _overwrite_held_then_released(worker, gate, d, "a",
                                            "the overwrite ran while the gather reading its slots was held back")
        assert torch.equal(got, rows_a.cpu()), "the record holds rows written after its request finished"
        store = w.store[loc.long().cpu()]
        assert torch.equal(store, rows_b.cpu())
        assert worker.order_device_writes() is False  # every gather done: no wait issued
        worker.close()
        w.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("staging_rows", [512, 128])
def test_a_deferred_overwrite_waits_on_the_copy_stream_not_the_forward(staging_rows, request):
    """--hs-copy deferred: the same overwrite of a slot whose gather is held back waits on the GPU, on the copy
    stream (order_device_writes with the chunk's bound, after the device copy), and once the gate opens the
    record holds A and the store B. A step shipped in one chunk leaves the compute stream running (an event
    recorded on it after the step fires while the gate is closed). In several chunks (128 rows: 3) the second
    chunk's device copy is queued behind the first chunk's wait, so the forward waits too, as with --hs-copy
    direct: only the order is checked then."""
    import time

    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        w = CaptureWriter(d, CaptureSpec.resolve(LAYERS, True, N_LAYERS, H), SLOTS, torch.bfloat16, 256 << 20,
                          device="cuda", copy="deferred", staging_rows=staging_rows)
        worker = FinishWorker(w)
        gate = _gate(worker)
        request.addfinalizer(gate.set)  # whatever fails, the worker and the copy stream are let go
        g = torch.Generator(device="cuda").manual_seed(2)
        loc = (torch.randperm(SLOTS - 1, device="cuda", generator=g)[:T] + 1).to(torch.int32)
        rows_a = _step(w, loc, g)
        worker.submit("a", list(range(T)), loc)
        waits = w.stats["device_write_waits"]
        rows_b = _step(w, loc, g)
        assert w.stats["device_write_waits"] > waits, "no wait issued for the chunks overwriting a's slots"
        forward, copy = torch.cuda.Event(), torch.cuda.Event()
        forward.record()
        copy.record(w.staging.copy_stream)
        ran = True
        if staging_rows >= T:
            deadline = time.monotonic() + 60
            while not forward.query() and time.monotonic() < deadline:
                time.sleep(0.01)
            ran = forward.query()
        parked = not copy.query()
        gate.set()  # before any assertion: a closed gate would park the stream (and the next test) for good
        worker.drain()
        copy.synchronize()
        assert ran, "the compute stream waited for a gather (it must wait only for the device copy)"
        assert parked, "the copy stream overwrote a's slots while their gather was held back"
        assert torch.equal(_record_rows(d, "a"), rows_a.cpu()), "the record holds rows written after its finish"
        w.staging.drain()
        assert torch.equal(w.store[loc.long().cpu()], rows_b.cpu())
        worker.close()
        w.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_with_the_allocator_watched_only_steps_reusing_a_read_slot_wait(request):
    """FinishWorker.watch_allocator (free_list_order.py): with SGLang's token allocator on the GPU, a step
    whose slots come from the free list's never-freed part issues no wait though a gather is pending; a step
    that takes the slots freed after that gather's hand-over waits for it, and the record holds its rows."""
    token = pytest.importorskip("sglang.srt.mem_cache.allocator.token",
                                reason="needs SGLang's allocator; scripts/gpu_check.sh's machine has only torch and "
                                       "triton (FreeListOrder against the real allocators: tests/unit/test_free_list_order.py)")
    TokenToKVPoolAllocator = token.TokenToKVPoolAllocator

    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        w = CaptureWriter(d, CaptureSpec.resolve(LAYERS, True, N_LAYERS, H), SLOTS, torch.bfloat16, 256 << 20,
                          device="cuda", copy="direct")
        worker = FinishWorker(w)
        alloc = TokenToKVPoolAllocator(2 * T, torch.bfloat16, "cuda", None, need_sort=False)
        worker.watch_allocator(alloc)
        gate = _gate(worker)
        request.addfinalizer(gate.set)  # whatever fails, the worker and the stream are let go
        g = torch.Generator(device="cuda").manual_seed(1)
        loc_a = alloc.alloc(T)
        assert worker.order_device_writes() is False  # nothing handed over yet
        rows_a = _step(w, loc_a, g)
        worker.submit("a", list(range(T)), loc_a)
        alloc.free(loc_a)  # its request finished: SGLang frees (or evicts) its slots after the hand-over
        loc_b = alloc.alloc(T)  # the rest of the never-used slots: no gather can read them
        assert worker.order_device_writes() is False, "waited for a gather that reads none of the step's slots"
        _step(w, loc_b, g)
        loc_c = alloc.alloc(T)  # now the slots of "a", freed after its hand-over
        assert torch.equal(loc_c.sort().values, loc_a.sort().values)
        assert worker.order_device_writes() is True
        _step(w, loc_c, g)
        got = _overwrite_held_then_released(worker, gate, d, "a", "the overwrite of a's slots ran while its gather "
                                            "was held back")
        assert torch.equal(got, rows_a.cpu())
        worker.close()
        w.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
