"""The staging strategy's bookkeeping (sglang_hs/server/store/staging.py) on the CPU, against the plain-torch
reference: eager steps shipped in chunks, graph replays shipped after the step, rows reaching the store
in step order through the scatter thread, `drain()` waiting for computed steps and only for them, a
third step waiting for a free host buffer, a failed scatter reported, and a graph too large refused.

On the CPU the copies are synchronous; steps whose rows are still being computed or copied are made
with events that have not fired yet (`Pending`), which is all the CUDA path adds to the logic. Threads
that must be blocked are checked to be still waiting after a moment (they cannot have finished: what
they wait for has not happened), and to finish once it has."""
import threading

import pytest
import torch

from reference import copy_rows_ref
from sglang_hs.server.store import staging
from sglang_hs.server.store.staging import StagedCopy

S, K, H = 40, 3, 24
P = K + 1


class Pending:
    """An event that has not fired yet: waiting for it blocks until the test fires it."""

    def __init__(self):
        self._e = threading.Event()

    def fire(self):
        self._e.set()

    def query(self):
        return self._e.is_set()

    def synchronize(self):
        assert self._e.wait(60), "a held event was never fired"


@pytest.fixture
def made():
    """StagedCopy instances of a test, closed (their scatter thread stopped) at its end."""
    out = []

    def make(store, rows):
        out.append(StagedCopy(store, rows, "cpu"))
        return out[-1]

    yield make
    for sc in out:
        sc.close()


def _in_thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _blocked(t):
    t.join(0.5)
    return t.is_alive()


def _store():
    return torch.full((S, P, H), float("nan"), dtype=torch.bfloat16)


def _rows(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K * H, generator=g).bfloat16(), torch.randn(T, H, generator=g).bfloat16()


def _write_held(sc, aux, last, loc):
    """A step whose rows are still being computed and copied when write() returns; returns its events."""
    ready, copied = Pending(), Pending()
    sc._cpu_copy_events = lambda: (ready, copied)
    try:
        sc.write(aux, last, loc)
    finally:
        del sc._cpu_copy_events
    return ready, copied


def _fire(*events):
    for e in events:
        e.fire()


@pytest.mark.parametrize("T, rows", [(1, 4), (4, 4), (5, 4), (13, 4), (13, 1), (7, 64)])
def test_eager_steps_are_shipped_in_chunks_and_land_exactly(T, rows, made):
    store, want = _store(), _store()
    sc = made(store, rows)
    aux, last = _rows(T, T)
    loc = torch.randperm(S - 1)[:T] + 1
    sc.before_step()
    sc.write(aux, last, loc)
    sc.after_step(T, graph_replayed=False)  # shipped by the forward itself: nothing more to do
    sc.drain()
    copy_rows_ref(aux, last, loc, want)
    assert torch.equal(store[loc], want[loc])
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[loc] = False
    assert store[untouched].isnan().all()
    assert sc.stats["staged_rows"] == T and not sc.pending and len(sc.free) == staging.HOST_BUFFERS
    assert sc.stats["scatter_s"] > 0


def test_without_final_state(made):
    store = torch.full((S, K, H), float("nan"), dtype=torch.float16)
    sc = made(store, 3)
    aux = torch.randn(8, K * H).half()
    loc = torch.arange(8, dtype=torch.int32) * 3 + 1  # int32 slots, as SGLang's out_cache_loc may be
    sc.write(aux, None, loc)
    sc.drain()
    want = copy_rows_ref(aux, None, loc, torch.full_like(store, float("nan")))
    assert torch.equal(store.nan_to_num(7.0), want.nan_to_num(7.0))


def test_a_graph_replay_is_shipped_after_the_step_and_only_its_real_rows(made):
    store = _store()
    sc = made(store, 8)
    sc._capturing = lambda: True  # the graph's kernels write the stage; no Python of the forward runs
    aux, last = _rows(8, 1)
    loc = torch.tensor([5, 6, 7, 0, 0, 0, 0, 0])  # 3 real rows, padding aimed at slot 0
    sc.before_step()
    sc.write(aux, last, loc)
    assert not sc.pending  # nothing shipped from inside a graph
    sc.after_step(3, graph_replayed=True)
    sc.drain()
    want = copy_rows_ref(aux[:3], last[:3], loc[:3], _store())
    assert torch.equal(store[5:8], want[5:8]) and store[0].isnan().all()


def test_a_step_that_wrote_nothing_ships_nothing(made):
    """E.g. SGLang's split prefill, which does not run the overlay's forward: stale stage rows must not
    be shipped as if a graph had written them."""
    sc = made(_store(), 8)
    sc.before_step()
    sc.after_step(5, graph_replayed=False)
    assert not sc.pending and sc.stats["staged_rows"] == 0


def test_a_graph_larger_than_the_stage_is_refused_at_capture(made):
    sc = made(_store(), 4)
    sc._capturing = lambda: True
    aux, last = _rows(5, 2)
    with pytest.raises(RuntimeError, match="a CUDA graph of 5 rows does not fit the 4-row staging buffer; raise "
                                           "--hs-staging-rows or lower --cuda-graph-max-bs"):
        sc.write(aux, last, torch.arange(5))


def test_a_reused_slot_ends_with_the_later_steps_row(made):
    """Two steps write the same slot (freed and reused in between): the later one is shipped while the
    earlier one's copy has not landed; the scatter keeps step order, so the store ends with the later row."""
    store = _store()
    sc = made(store, 4)
    a, la = _rows(2, 3)
    b, lb = _rows(2, 4)
    events = _write_held(sc, a, la, torch.tensor([9, 10]))
    sc.write(b, lb, torch.tensor([10, 11]))
    assert len(sc.pending) == 2 and store[9:12].isnan().all()  # the later step waits behind the earlier
    _fire(*events)
    sc.drain()
    want = copy_rows_ref(b, lb, torch.tensor([10, 11]), copy_rows_ref(a, la, torch.tensor([9, 10]), _store()))
    assert torch.equal(store[9:12], want[9:12])


def test_drain_waits_for_computed_steps_only():
    store = _store()
    sc = StagedCopy(store, 4, "cpu")
    a, la = _rows(2, 5)
    b, lb = _rows(2, 6)
    ready, copied = _write_held(sc, a, la, torch.tensor([1, 2]))
    sc.write(b, lb, torch.tensor([3, 4]))
    t = _in_thread(sc.drain)  # the oldest step's rows are not computed: later than anything being finished
    t.join(30)
    assert not t.is_alive() and len(sc.pending) == 2 and store[1:5].isnan().all()
    ready.fire()  # computed, but its host copy has not landed: drain waits for it
    waited = []
    t = _in_thread(lambda: waited.append(sc.drain()))
    assert _blocked(t)
    copied.fire()
    t.join(30)
    assert not t.is_alive() and not sc.pending and not store[1:5].isnan().any()
    assert waited[0] > 0 and sc.stats["stage_wait_s"] == 0  # drain's wait is its caller's (store_wait_s)
    sc.close()


def test_a_third_step_waits_for_the_oldest_host_buffer(made):
    """Two host buffers: a third step waits until the scatter thread has freed the oldest one."""
    assert staging.HOST_BUFFERS == 2
    store = _store()
    sc = made(store, 4)
    steps = [(_rows(1, 10 + i), torch.tensor([20 + i])) for i in range(3)]
    first = _write_held(sc, *steps[0][0], steps[0][1])
    second = _write_held(sc, *steps[1][0], steps[1][1])
    assert not sc.free
    t = _in_thread(lambda: sc.write(*steps[2][0], steps[2][1]))
    assert _blocked(t)
    _fire(*first)  # the oldest lands and is scattered: its buffer takes the third step
    t.join(30)
    assert not t.is_alive() and len(sc.pending) == 2
    sc.drain()  # the second is not computed yet: nothing to wait for
    assert not store[20].isnan().any() and store[21:23].isnan().all()
    _fire(*second)
    sc.drain()
    for (x, lx), loc in steps:
        assert torch.equal(store[loc], copy_rows_ref(x, lx, loc, _store())[loc])


def test_a_failed_scatter_is_raised_to_the_scheduler():
    sc = StagedCopy(_store(), 4, "cpu")
    a, la = _rows(2, 7)
    sc.write(a, la, torch.tensor([3, S + 5]))  # a slot outside the store: the C++ scatter refuses it
    with pytest.raises(RuntimeError, match=r"staging scatter thread failed: .*slot 45 of row 1 outside \[0, 40\)"):
        sc.drain()
    with pytest.raises(RuntimeError, match="staging scatter thread failed"):
        sc.write(a, la, torch.tensor([3, 4]))  # and at every later ship


# --- the scatter thread during CUDA-graph capture (issue 15 item 1) ------------------------------------
def test_the_scatter_thread_is_made_capture_safe_before_it_waits_for_anything(monkeypatch):
    """SGLang captures graphs in CUDA's global mode on the scheduler thread while this thread may be in
    an event sync; the thread must switch to thread-local capture mode on itself, first thing, before
    the constructor returns (no capture can have begun yet) and before its first wait for a copy."""
    calls = []
    monkeypatch.setattr(staging, "_prepare_scatter_thread",
                        lambda device: calls.append(("prepare", threading.current_thread().name, device)))

    class Logged(Pending):
        def synchronize(self):
            calls.append(("sync", threading.current_thread().name))
            super().synchronize()

    sc = StagedCopy(_store(), 4, "cpu")
    try:
        assert calls == [("prepare", "sglang-hs-scatter", torch.device("cpu"))]  # before __init__ returned
        ready, copied = Logged(), Logged()
        sc._cpu_copy_events = lambda: (ready, copied)
        sc.write(*_rows(2, 8), torch.tensor([1, 2]))
        _fire(ready, copied)
        sc.drain()
        assert calls[1:] == [("sync", "sglang-hs-scatter")]
    finally:
        sc.close()


def test_a_scatter_thread_that_cannot_be_made_capture_safe_stops_start_up(monkeypatch):
    def fail(device):
        raise RuntimeError("cudaThreadExchangeStreamCaptureMode failed with CUDA error 999")

    monkeypatch.setattr(staging, "_prepare_scatter_thread", fail)
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match=r"^sglang-hs: the staging scatter thread could not be made safe during "
                                           r"CUDA-graph capture: cudaThreadExchangeStreamCaptureMode failed with "
                                           r"CUDA error 999; use --hs-copy direct$"):
        StagedCopy(_store(), 4, "cpu")
    for t in set(threading.enumerate()) - threads:  # the thread has ended, it does not wait for work
        t.join(10)
        assert not t.is_alive(), t.name


class _FakeCudart:
    """cudaThreadExchangeStreamCaptureMode of a thread whose mode is global (0)."""

    def __init__(self, err=0):
        self.err, self.seen = err, []

    def cudaThreadExchangeStreamCaptureMode(self, mode_ptr):
        self.seen.append(mode_ptr.contents.value)
        if self.err == 0:
            mode_ptr.contents.value = 0  # the previous mode
        return self.err


def test_on_cuda_the_thread_takes_the_writers_device_then_thread_local_capture_mode(monkeypatch):
    order, lib = [], _FakeCudart()
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: order.append(("set_device", d)))
    monkeypatch.setattr(staging, "_cudart", lambda: order.append(("cudart",)) or lib)
    staging._prepare_scatter_thread(torch.device("cuda", 3))
    assert order == [("set_device", torch.device("cuda", 3)), ("cudart",)]
    assert lib.seen == [1]  # cudaStreamCaptureModeThreadLocal
    order.clear()
    staging._prepare_scatter_thread(torch.device("cpu"))  # no CUDA call at all off CUDA
    staging._prepare_scatter_thread(torch.device("meta"))
    assert order == [] and lib.seen == [1]


def test_on_cuda_a_failed_mode_switch_or_no_cuda_runtime_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(staging, "_cudart", lambda: _FakeCudart(err=35))
    with pytest.raises(RuntimeError, match="^cudaThreadExchangeStreamCaptureMode failed with CUDA error 35$"):
        staging._prepare_scatter_thread(torch.device("cuda", 0))
    monkeypatch.setattr(staging, "_cudart", lambda: None)
    with pytest.raises(RuntimeError, match=r"no CUDA runtime library \(libcudart\) is loaded in this process"):
        staging._prepare_scatter_thread(torch.device("cuda", 0))


@pytest.mark.skipif(not torch.version.cuda, reason="a CPU build of torch loads no CUDA runtime")
def test_the_cuda_runtime_found_is_the_one_torch_loaded():
    lib = staging._cudart()
    with open("/proc/self/maps") as f:
        loaded = {line.split()[-1] for line in f if "/libcudart.so" in line}
    assert lib is not None and lib.cudaThreadExchangeStreamCaptureMode.restype is not None
    assert not loaded or lib._name in loaded


def test_a_large_step_is_scattered_on_the_threads_asked_for(monkeypatch):
    """scatter_threads reaches the C++ scatter: a step of DeepSeek-V3 rows (57 KB each, 17 MB, room for two
    8 MiB threads) is scattered by a call allowing that many threads, and lands exactly."""
    from sglang_hs._ext import ext

    C = ext()
    real, threads = C.copy_rows_cpu, []

    def spy(aux, last, loc, store, num_threads=1):
        threads.append(num_threads)
        return real(aux, last, loc, store, num_threads)

    monkeypatch.setattr(C, "copy_rows_cpu", spy)
    T, S_big, H_big = 300, 701, 7168
    store = torch.full((S_big, P, H_big), float("nan"), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    aux, last = torch.randn(T, K * H_big, generator=g).bfloat16(), torch.randn(T, H_big, generator=g).bfloat16()
    loc = torch.randperm(S_big - 1, generator=g)[:T] + 1
    sc = StagedCopy(store, T, "cpu", scatter_threads=3)
    try:
        sc.before_step()
        sc.write(aux, last, loc)
        sc.after_step(T, graph_replayed=False)
        sc.drain()
    finally:
        sc.close()
    assert threads == [1, 3]  # the forward's copy into the stage, then the scatter from the host buffer
    want = copy_rows_ref(aux, last, loc, torch.full_like(store, float("nan")))
    assert torch.equal(store.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("value, threads", [(None, "default"), ("5", 5), ("0", None)])
def test_the_writer_gives_the_scatter_its_threads(tmp_path, monkeypatch, value, threads):
    """SGLANG_HS_SCATTER_THREADS (--hs-scatter-threads) reaches the writer's StagedCopy; 0 is refused."""
    from sglang_hs import envs
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    if value is None:
        monkeypatch.delenv("SGLANG_HS_SCATTER_THREADS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_HS_SCATTER_THREADS", value)
    spec = CaptureSpec.resolve([1, 2, 3], True, 4, H)

    def make():
        return CaptureWriter(str(tmp_path), spec, num_slots=S, dtype=torch.bfloat16, ring_bytes=1 << 20,
                             copy="staging", staging_rows=4)

    if threads is None:
        with pytest.raises(ValueError, match=r"SGLANG_HS_SCATTER_THREADS \(--hs-scatter-threads\) must be > 0, got 0"):
            make()
        return
    w = make()
    try:
        assert w.staging.scatter_threads == (envs.DEFAULT_SCATTER_THREADS if threads == "default" else threads)
    finally:
        w.staging.close()


def test_without_the_extension_the_stage_is_refused_at_start_up(monkeypatch):
    """The scatter op is looked up by the constructor: a missing or broken extension stops start-up with
    its own error, instead of a scatter thread that dies and leaves every drain waiting."""
    import sglang_hs._ext as ext_module

    def broken():
        raise ext_module.ExtensionNotBuilt("sglang_hs._C is not built")

    monkeypatch.setattr(ext_module, "ext", broken)
    with pytest.raises(ext_module.ExtensionNotBuilt, match="not built"):
        StagedCopy(_store(), 4, "cpu")


def test_a_scatter_thread_gone_silently_is_an_error_not_a_hang(made):
    sc = made(_store(), 4)
    with sc._cv:
        sc._closed = True  # the thread ends as if it had died: nothing reported
        sc._cv.notify_all()
    sc._thread.join(10)
    sc._closed = False
    a, la = _rows(2, 7)
    done = []

    def drain():
        try:
            sc.write(a, la, torch.tensor([3, 4]))
            sc.drain()
        except RuntimeError as e:
            done.append(str(e))

    t = _in_thread(drain)
    t.join(30)
    assert not t.is_alive() and done and "scatter thread has stopped" in done[0]


def test_a_stale_extension_is_refused_at_start_up(tmp_path, monkeypatch):
    """A build of sglang_hs._C from before the scatter threads (copy_rows_cpu without num_threads) would
    fail at the first staged step: the writer refuses it first, saying to rebuild."""
    import types

    import sglang_hs._ext as ext_module
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    real = ext_module.ext()

    def old_copy_rows_cpu(aux, last, loc, store):
        """copy_rows_cpu(aux: torch.Tensor, last: torch.Tensor | None, loc: torch.Tensor, store: torch.Tensor)"""

    stale = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    stale.copy_rows_cpu = old_copy_rows_cpu
    monkeypatch.setattr(ext_module, "ext", lambda: stale)
    with pytest.raises(RuntimeError, match=r"predates this sglang-hs .*copy_rows_cpu has no num_threads.*rebuild"):
        CaptureWriter(str(tmp_path), CaptureSpec.resolve([1, 2, 3], True, 4, H), num_slots=S, dtype=torch.bfloat16,
                      ring_bytes=1 << 20, copy="staging", staging_rows=4)


def test_writer_close_stops_the_copy_and_unregisters_the_store(tmp_path, monkeypatch):
    """CaptureWriter.close(): the staging thread is stopped once its rows are in the store, and a store that was
    registered for the GPU is unregistered (a GPU run saw the next store, mapped at the freed address, refused as
    "already registered" otherwise); a second close does nothing more. Registration is a stand-in here."""
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store import pinned
    from sglang_hs.server.store.writer import CaptureWriter

    w = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1, 2, 3], True, 4, H), num_slots=S, dtype=torch.bfloat16,
                      ring_bytes=1 << 20, copy="staging", staging_rows=4)
    rows = torch.randn(2, 3 * H).bfloat16(), torch.randn(2, H).bfloat16()
    w.copy(*rows, torch.tensor([5, 6]))
    unregistered = []
    monkeypatch.setattr(pinned, "unregister", lambda buf: unregistered.append(buf.data_ptr()))
    w._registered = object()  # as if the store had been registered (CUDA)
    w.close()
    assert not w.staging._thread.is_alive() and unregistered == [w.region.buf.data_ptr()]
    assert torch.equal(w.store[[5, 6]], copy_rows_ref(*rows, torch.tensor([5, 6]), torch.zeros_like(w.store))[[5, 6]])
    w.close()
    assert unregistered == [w.region.buf.data_ptr()]
