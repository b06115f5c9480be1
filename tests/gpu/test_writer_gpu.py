"""The server's own capture code on a GPU, without SGLang: CaptureWriter copying inside CUDA graph
replays into a registered /dev/shm store, finish-time gather through a req_to_token table, publish
into the output ring, and HiddenStateReader in another process reading every record back."""
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from reference import copy_rows_ref  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.ops.copy_rows import HostStore, copy_rows  # noqa: E402
from sglang_hs.server.store import pinned  # noqa: E402
from sglang_hs.server.store.staging import StagedCopy  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
K, H, SLOTS, PAD = 3, 512, 4096, 0


def _read_all(dump_dir, rids, out_path):
    from sglang_hs import HiddenStateReader

    r = HiddenStateReader(dump_dir)
    recs = {rid: r.take(rid, timeout=120) for rid in rids}
    torch.save({rid: (rec.input_ids, rec.aux_hidden_states, rec.last_hidden_state) for rid, rec in recs.items()},
               out_path)


@pytest.mark.parametrize("copy", ["direct", "staging", "deferred"])
def test_writer_through_graph_replays_to_a_reader_process(copy):
    """With --hs-copy staging (and deferred) a 16-row stage: the 77-row prefill is shipped in 5 chunks (each
    waiting on the GPU for the one before; staging also for a free host buffer), each replay is shipped
    after the step."""
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    spec = CaptureSpec.resolve([2, 4, 5], True, 8, H)
    w = CaptureWriter(d, spec, SLOTS, torch.bfloat16, 64 << 20, device="cuda", copy=copy, staging_rows=16)
    torch.manual_seed(0)
    wt = torch.randn(H, K * H, device="cuda", dtype=torch.bfloat16) / H**0.5

    def step(x, loc):  # a stand-in model step: aux and final state from x, then the overlay's copy
        aux = x @ wt
        last = torch.nn.functional.rms_norm(x, (H,))
        w.copy(aux, last, loc)
        return aux, last

    # Decode: one graph per batch-size bucket, static inputs as SGLang's runner keeps them.
    graphs = {}
    for bs in (1, 2, 4, 8):
        x = torch.zeros(bs, H, device="cuda", dtype=torch.bfloat16)
        loc = torch.zeros(bs, device="cuda", dtype=torch.int64)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(x, loc)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            aux, last = step(x, loc)
        graphs[bs] = (g, x, loc, aux, last)

    n_req = 6
    prompt_len = [5, 17, 1, 33, 9, 12]
    new_tokens = [4, 1, 7, 3, 5, 2]
    free = (torch.randperm(SLOTS - 1) + 1).tolist()
    req_to_token = torch.zeros(n_req, 64, dtype=torch.int64, device="cuda")
    expected = {i: [] for i in range(n_req)}
    tokens = {i: list(range(100 * i, 100 * i + prompt_len[i])) for i in range(n_req)}
    # Prefill (eager, like SGLang's outer forward), all prompts in one batch.
    locs, xs = [], []
    for i in range(n_req):
        sl = [free.pop() for _ in range(prompt_len[i])]
        req_to_token[i, : prompt_len[i]] = torch.tensor(sl)
        xi = torch.randn(prompt_len[i], H, device="cuda", dtype=torch.bfloat16)
        xs.append(xi)
        locs += sl
    w.before_step()
    aux, last = step(torch.cat(xs), torch.tensor(locs, device="cuda"))
    w.after_step(len(locs), graph_replayed=False)
    rows = torch.cat([aux.view(-1, K, H), last[:, None]], 1).cpu()
    o = 0
    for i in range(n_req):
        expected[i].append(rows[o : o + prompt_len[i]])
        o += prompt_len[i]
    # Decode steps through the graphs, padded to the bucket; requests finish at different steps.
    seq = list(prompt_len)
    finished = set()
    for t in range(max(new_tokens) - 1):  # every generated token but the last is forwarded
        live = [i for i in range(n_req) if t < new_tokens[i] - 1]
        bs = next(b for b in (1, 2, 4, 8) if b >= len(live))
        g, x, loc, aux, last = graphs[bs]
        sl = [free.pop() for _ in live]
        for i, s_ in zip(live, sl):
            req_to_token[i, seq[i]] = s_
            tokens[i].append(1000 + t)
            seq[i] += 1
        x.copy_(torch.randn(bs, H, device="cuda", dtype=torch.bfloat16))
        loc.copy_(torch.tensor(sl + [PAD] * (bs - len(live)), device="cuda"))
        w.before_step()
        g.replay()
        w.after_step(len(live), graph_replayed=True)
        step_rows = torch.cat([aux.view(bs, K, H), last[:, None]], 1).cpu()
        for j, i in enumerate(live):
            expected[i].append(step_rows[j : j + 1])
        for i in range(n_req):  # finish the ones whose last forwarded row was this step
            if i not in finished and (new_tokens[i] - 1 == t + 1 or new_tokens[i] == 1):
                finished.add(i)
                w.finish(f"gpu-{i}", tokens[i], req_to_token[i, : seq[i]])
    for i in range(n_req):
        if i not in finished:
            w.finish(f"gpu-{i}", tokens[i], req_to_token[i, : seq[i]])
    out_path = os.path.join(d, "read.pt")
    p = mp.get_context("spawn").Process(target=_read_all, args=(d, [f"gpu-{i}" for i in range(n_req)], out_path))
    p.start()
    p.join(180)
    assert p.exitcode == 0
    got = torch.load(out_path)
    for i in range(n_req):
        ids, aux_rows, last_rows = got[f"gpu-{i}"]
        want = torch.cat(expected[i])
        assert ids.tolist() == tokens[i] and want.shape[0] == prompt_len[i] + new_tokens[i] - 1
        assert torch.equal(aux_rows, want[:, :K]) and torch.equal(last_rows, want[:, K]), f"request {i}"
    assert w.stats["records"] == n_req
    if copy != "direct":
        assert w.stats["staged_rows"] >= sum(prompt_len) + sum(new_tokens) - n_req
        w.staging.close()
    if copy != "staging":
        pinned.unregister(w.region.buf)
    shutil.rmtree(d)


@pytest.mark.parametrize("copy", ["staging", "deferred"])
def test_staging_keeps_step_order_without_host_syncs(copy):
    """60 eager steps of 1-40 rows through a 16-row stage with no host synchronisation between them,
    slots reused from step to step: after a final drain every slot holds its last writer's row, as the
    plain-torch reference applied in step order says (a stage overwritten before its copy, or a scatter
    out of order, shows here)."""
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    spec = CaptureSpec.resolve([2, 4, 5], True, 8, H)
    w = CaptureWriter(d, spec, 256, torch.bfloat16, 1 << 20, device="cuda", copy=copy, staging_rows=16)
    want = torch.full((256, K + 1, H), float("nan"), dtype=torch.bfloat16)
    w.store.copy_(want)
    g = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn(2048, 2048, device="cuda")
    steps = []
    for i in range(60):
        T = int(torch.randint(1, 41, (1,)))
        loc = torch.randperm(64, device="cuda", generator=g)[:T] + 1  # 64 slots: heavy reuse across steps
        for _ in range(1 + i % 3):  # make some steps slow, so copies and computes overlap
            big = torch.tanh(big @ big / 2048)
        aux = (torch.randn(T, K * H, device="cuda", generator=g) + big[0, 0]).bfloat16()
        last = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w.before_step()
        w.copy(aux, last, loc)
        w.after_step(T, graph_replayed=False)
        steps.append((aux, last, loc))
    torch.cuda.synchronize()
    w.staging.drain()
    assert not w.staging.pending
    for aux, last, loc in steps:
        copy_rows_ref(aux.cpu(), last.cpu(), loc.cpu(), want)
    assert torch.equal(w.store.nan_to_num(7.0), want.nan_to_num(7.0))
    w.staging.close()
    if copy == "deferred":
        pinned.unregister(w.region.buf)
    shutil.rmtree(d)


def test_a_graph_larger_than_the_stage_is_refused_when_captured():
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    spec = CaptureSpec.resolve([2, 4, 5], True, 8, H)
    w = CaptureWriter(d, spec, 64, torch.bfloat16, 1 << 20, device="cuda", copy="staging", staging_rows=4)
    aux = torch.zeros(8, K * H, device="cuda", dtype=torch.bfloat16)
    last = torch.zeros(8, H, device="cuda", dtype=torch.bfloat16)
    loc = torch.zeros(8, device="cuda", dtype=torch.int64)
    with pytest.raises(RuntimeError, match="a CUDA graph of 8 rows does not fit"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            w.copy(aux, last, loc)
    shutil.rmtree(d)


def test_staging_refuses_a_slot_outside_the_store_at_the_next_drain():
    """--hs-copy staging on a GPU: a row whose slot lies outside the store reaches the host scatter, whose
    C++ op refuses the whole step before writing; the scheduler hears of it at its next drain (and every
    ship after), and nothing of the step is in the store. (--hs-copy direct: test_copy_gpu.py.)"""
    store = torch.zeros(64, K + 1, H, dtype=torch.bfloat16)
    sc = StagedCopy(store, 16, "cuda")
    try:
        aux = torch.randn(4, K * H, device="cuda", dtype=torch.bfloat16)
        last = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
        sc.before_step()
        sc.write(aux, last, torch.tensor([1, 2, 64, 3], device="cuda"))
        sc.after_step(4, graph_replayed=False)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"staging scatter thread failed: .*slot 64 of row 2 outside \[0, 64\)"):
            sc.drain()
        with pytest.raises(RuntimeError, match="staging scatter thread failed"):
            sc.write(aux, last, torch.tensor([1, 2, 3, 4], device="cuda"))
        assert not store.any(), "rows of the refused step reached the store"
    finally:
        sc.close()


def test_deferred_drops_a_slot_outside_the_store_and_every_drain_raises():
    """--hs-copy deferred: the copy stream's kernel drops a row whose slot lies outside the store (a kernel
    cannot stop a step) and counts it; the next drain (the finish that would publish the request) raises it,
    and so does every drain after. The step's other rows are in the store."""
    S = 64
    host = torch.zeros(S * (K + 1) * H * 2, dtype=torch.uint8)
    view = host.view(torch.bfloat16).view(S, K + 1, H)
    sc = StagedCopy(view, 16, "cuda", host_store=HostStore(view, pinned.register(host)))
    try:
        aux = torch.randn(4, K * H, device="cuda", dtype=torch.bfloat16)
        last = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
        sc.before_step()
        sc.write(aux, last, torch.tensor([1, 2, S, 3], device="cuda"))
        sc.after_step(4, graph_replayed=False)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=rf"dropped 1 row whose KV slot lay outside the store's \[0, {S}\) "
                                               rf"\(e.g. slot {S}\)"):
            sc.drain()
        want = torch.cat([aux.view(4, K, H), last[:, None]], 1).cpu()
        assert torch.equal(view[[1, 2, 3]], want[[0, 1, 3]]) and not view[0].any()
        with pytest.raises(RuntimeError, match="dropped 1 row"):
            sc.drain()
    finally:
        sc.close()
        pinned.unregister(host)


def test_staging_scatter_thread_syncing_during_a_global_capture_does_not_break_it():
    """Issue 15 item 1: SGLang's capture warm-up runs the overlay eagerly, which ships a chunk and wakes
    the scatter thread; its event sync then lands while the scheduler thread captures in global mode.
    Here the thread's sync is made late on purpose, and each eager staged step is followed at once by
    a raw capture_begin/capture_end (global mode, no device sync first, as the breakable backend does)
    held open across that late sync. Without the fix (the thread in CUDA's default global mode) the
    thread's sync is a prohibited call during another thread's global capture: it fails and invalidates
    the capture, which raises at capture_end (cudaErrorStreamCaptureInvalidated / "operation not
    permitted when stream is capturing"). With the scatter thread in thread-local capture mode every
    capture succeeds, the graphs replay right and every row lands in the store."""
    S, T, N = 512, 8, 40
    store = torch.full((S, K + 1, H), float("nan"), dtype=torch.bfloat16)
    want = store.clone()
    sc = StagedCopy(store, 16, "cuda")
    syncs, windows = [], []
    on_time = sc._await_copy

    def late(s):
        time.sleep(0.005)  # the main thread has begun its capture by now
        syncs.append(time.perf_counter())
        on_time(s)

    sc._await_copy = late
    x = torch.randn(256, device="cuda")
    side = torch.cuda.Stream()
    graphs = []
    g_ = torch.Generator(device="cuda").manual_seed(2)
    try:
        for i in range(N):
            aux = torch.randn(T, K * H, device="cuda", generator=g_).bfloat16()
            last = torch.randn(T, H, device="cuda", generator=g_).bfloat16()
            loc = torch.randperm(S - 1, device="cuda", generator=g_)[:T] + 1  # slots reused across steps
            copy_rows_ref(aux.cpu(), last.cpu(), loc.cpu(), want)  # (a device sync: before the step)
            sc.before_step()
            sc.write(aux, last, loc)  # eager: ships and wakes the scatter thread
            sc.after_step(T, graph_replayed=False)
            side.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                t0 = time.perf_counter()
                g.capture_begin(capture_error_mode="global")
                try:
                    y = x * (i + 1)
                    time.sleep(0.02)  # hold the capture open across the thread's late sync
                finally:
                    g.capture_end()
                windows.append((t0, time.perf_counter()))
            torch.cuda.current_stream().wait_stream(side)
            graphs.append((g, y, i + 1))
        torch.cuda.synchronize()
        sc.drain()
        assert sc._error is None and not sc.pending
        inside = sum(any(a < t < b for a, b in windows) for t in syncs)
        print(f"scatter syncs inside a capture: {inside} of {len(syncs)}")
        assert len(syncs) == N and inside >= N // 2  # the race was exercised, not dodged
        assert torch.equal(store.nan_to_num(7.0), want.nan_to_num(7.0))
        x.copy_(torch.randn(256, device="cuda"))
        for g, y, k in graphs:
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, x * k)
    finally:
        sc.close()


def test_staging_scatter_thread_sleeps_while_it_waits_for_a_copy():
    """The copy event is a blocking-sync one: the thread waiting for a copy ~0.5 s away uses almost no
    CPU (a default event's sync spins a core for the whole wait)."""
    store = torch.full((64, K + 1, H), float("nan"), dtype=torch.bfloat16)
    sc = StagedCopy(store, 16, "cuda")
    waits = []
    plain = sc._await_copy

    def timed(s):
        w0, c0 = time.perf_counter(), time.thread_time()
        plain(s)
        waits.append((time.perf_counter() - w0, time.thread_time() - c0))

    sc._await_copy = timed
    try:
        aux = torch.randn(4, K * H, device="cuda").bfloat16()
        last = torch.randn(4, H, device="cuda").bfloat16()
        loc = torch.tensor([1, 2, 3, 4], device="cuda")
        sc.write(aux, last, loc)  # compiles the copy kernel: the measured step ships at once
        torch.cuda.synchronize()
        sc.drain()
        waits.clear()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU clock cycles before the step's rows are computed
        sc.write(aux, last, loc)
        torch.cuda.synchronize()
        sc.drain()
        (wall, cpu), = waits
        print(f"scatter thread waited {wall:.3f} s using {cpu:.3f} s of CPU")
        assert wall > 0.1 and cpu < 0.2 * wall
        want = copy_rows_ref(aux.cpu(), last.cpu(), loc.cpu(), torch.full_like(store, float("nan")))
        assert torch.equal(store.nan_to_num(7.0), want.nan_to_num(7.0))
    finally:
        sc.close()


def test_torch_cudart_fallback_registration_is_equivalent(monkeypatch):
    """Without the extension's CUDA part, registration goes through torch's cudart binding and the
    host address serves as the device address; the kernel writes the same bytes."""
    monkeypatch.setattr(pinned, "_cuda_ext", lambda: None)
    S, T = 256, 40
    host = torch.empty(S * (K + 1) * H * 2, dtype=torch.uint8)
    view = host.view(torch.bfloat16).view(S, K + 1, H)
    view.fill_(float("nan"))
    store = HostStore(view, pinned.register(host))
    try:
        aux = torch.randn(T, K * H, device="cuda", dtype=torch.bfloat16)
        last = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(S - 1, device="cuda")[:T] + 1
        copy_rows(aux, last, slots, store)
        torch.cuda.synchronize()
        assert torch.equal(view[slots.cpu()], torch.cat([aux.view(T, K, H), last[:, None]], 1).cpu())
    finally:
        pinned.unregister(host)
