"""The capture copy on a real GPU: the Triton kernel compiled for the device, a store in registered
/dev/shm memory written by the kernel and read by another process, the kernel inside CUDA graphs
replayed with changing slots, batch sizes and padding, and slots outside the store dropped and
reported after a replay."""
import multiprocessing as mp
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():  # keep the kernel module unimported: CPU tests import it interpreted
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from reference import copy_rows_ref  # noqa: E402
from sglang_hs.server.ops.copy_rows import HostStore, SlotErrors, copy_rows  # noqa: E402
from sglang_hs.server.store import pinned  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
PAD_SLOT = 0


def _rows(T, K, H, dtype, last, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    aux = torch.randn(T, K * H + 5, device=DEV, dtype=torch.float32, generator=g).to(dtype)[:, 5:]
    fin = torch.randn(T, H, device=DEV, generator=g).to(dtype) if last else None
    return aux, fin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,H,last", [(1, 111, True), (2, 500, False), (3, 7168, True), (4, 257, True),
                                      (3, 4096, True), (12, 4096, True)])  # V4-Flash: stream means, all 4 streams
def test_kernel_matches_reference_on_device(dtype, K, H, last):
    T, S = 37, 128
    aux, fin = _rows(T, K, H, dtype, last, seed=K * 1000 + H)
    loc = torch.cat([torch.randperm(S - 1, device=DEV)[: T - 5] + 1, torch.zeros(5, device=DEV, dtype=torch.long)])
    store = torch.full((S, K + int(last), H), float("nan"), device=DEV, dtype=dtype)
    copy_rows(aux, fin, loc, store)
    want = copy_rows_ref(aux[: T - 5], fin[: T - 5] if last else None, loc[: T - 5], torch.full_like(store, float("nan")))
    real = loc[: T - 5]
    assert torch.equal(store[real], want[real])
    mask = torch.ones(S, dtype=torch.bool, device=DEV)
    mask[real] = False
    mask[PAD_SLOT] = False
    assert store[mask].isnan().all()


def _reader(path, nbytes, slots, expected_path, q):
    import mmap

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    host = torch.frombuffer(mm, dtype=torch.uint8).view(torch.bfloat16)
    expected = torch.load(expected_path)
    store = host.view(-1, *expected.shape[1:])
    q.put(bool(torch.equal(store[slots], expected)))


def test_registered_shm_store_written_by_kernel_read_by_another_process():
    from sglang_hs.server.store.shm import SharedRegion

    K, H, S, T = 3, 7168, 4096, 512
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    nbytes = S * (K + 1) * H * 2
    region = SharedRegion.create(d, "store", nbytes)
    host = region.buf.view(torch.bfloat16).view(S, K + 1, H)
    dev_ptr = pinned.register(region.buf)
    try:
        store = HostStore(host, dev_ptr)
        aux, fin = _rows(T, K, H, torch.bfloat16, True, seed=1)
        slots = torch.randperm(S - 1, device=DEV)[:T] + 1
        copy_rows(aux, fin, slots, store)
        torch.cuda.synchronize()
        expected = torch.cat([aux.reshape(T, K, H), fin[:, None]], 1).cpu()
        assert torch.equal(host[slots.cpu()], expected)
        torch.save(expected, os.path.join(d, "expected.pt"))
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_reader, args=(region.path, nbytes, slots.cpu(), os.path.join(d, "expected.pt"), q))
        p.start()
        assert q.get(timeout=120) is True
        p.join(30)
    finally:
        pinned.unregister(region.buf)
        region.unlink()


@pytest.mark.parametrize("target", ["device", "registered-host"])
def test_copy_inside_cuda_graph_replays(target):
    """A stand-in model step (matmul -> aux, norm -> last) and the copy, captured once per batch-size
    bucket; replays with new inputs, new slots and padding write every real row to its slot."""
    K, H, S = 3, 512, 2048
    buckets = [1, 4, 8, 16]
    torch.manual_seed(0)
    w = torch.randn(H, K * H, device=DEV, dtype=torch.bfloat16) / H**0.5
    if target == "device":
        store_t = torch.full((S, K + 1, H), float("nan"), device=DEV, dtype=torch.bfloat16)
        store, region = store_t, None
        host_view = store_t
    else:
        from sglang_hs.server.store.shm import SharedRegion

        d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        region = SharedRegion.create(d, "store", S * (K + 1) * H * 2)
        host_view = region.buf.view(torch.bfloat16).view(S, K + 1, H)
        host_view.fill_(float("nan"))
        store = HostStore(host_view, pinned.register(region.buf))
    graphs = {}
    try:
        for bs in buckets:
            x = torch.zeros(bs, H, device=DEV, dtype=torch.bfloat16)
            loc = torch.zeros(bs, device=DEV, dtype=torch.int64)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up outside capture (Triton compiles here)
                aux = x @ w
                copy_rows(aux, torch.nn.functional.rms_norm(x, (H,)), loc, store)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                aux = x @ w
                last = torch.nn.functional.rms_norm(x, (H,))
                copy_rows(aux, last, loc, store)
            graphs[bs] = (g, x, loc, aux, last)
        expected = {}
        free = torch.randperm(S - 1) + 1
        cursor = 0
        for step in range(60):
            n = [1, 3, 4, 7, 8, 13, 16][step % 7]
            bs = next(b for b in buckets if b >= n)
            g, x, loc, aux, last = graphs[bs]
            new_slots = free[cursor : cursor + n]
            cursor = (cursor + n) % (S - 64)
            x.copy_(torch.randn(bs, H, device=DEV, dtype=torch.bfloat16))
            loc.copy_(torch.cat([new_slots, torch.full((bs - n,), PAD_SLOT)]).to(DEV))
            g.replay()
            torch.cuda.synchronize()
            rows = torch.cat([aux.reshape(bs, K, H), last[:, None]], 1)[:n].cpu()
            got = host_view[new_slots.to(host_view.device)].cpu()
            assert torch.equal(got, rows), f"step {step}: replayed rows did not land at their slots"
            for i, sl in enumerate(new_slots.tolist()):
                expected[sl] = rows[i]
        # Every slot holds the last row aimed at it: no replay wrote anywhere else.
        for sl, row in expected.items():
            assert torch.equal(host_view[sl].cpu(), row)
    finally:
        if region is not None:
            pinned.unregister(region.buf)
            region.unlink()


@pytest.mark.parametrize("target", ["device", "registered-host"])
def test_slots_outside_the_store_are_dropped_and_reported_after_graph_replays(target):
    """The store is the middle of a bigger buffer (device memory, or registered /dev/shm written through
    a HostStore as in `--hs-copy direct`). A captured copy replayed with slots past the end, negative
    and far away writes nothing outside the store and nothing for those rows, writes the in-range rows
    of the same replay exactly, and the counter read after the replay (outside the graph) says how many
    rows were dropped; replays accumulate."""
    K, H, S, G, bs = 3, 512, 256, 4, 16
    torch.manual_seed(0)
    w = torch.randn(H, K * H, device=DEV, dtype=torch.bfloat16) / H**0.5
    region = None
    if target == "device":
        big = torch.full((G + S + G, K + 1, H), float("nan"), device=DEV, dtype=torch.bfloat16)
        store, errors = big[G : G + S], SlotErrors(DEV)
        check = errors.check
    else:
        from sglang_hs.server.store.shm import SharedRegion

        d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        region = SharedRegion.create(d, "store", (G + S + G) * (K + 1) * H * 2)
        big = region.buf.view(torch.bfloat16).view(G + S + G, K + 1, H)
        big.fill_(float("nan"))
        hs = HostStore(big[G : G + S], pinned.register(region.buf) + G * (K + 1) * H * 2)
        store, errors, check = hs, hs.errors, hs.check
    view = big[G : G + S]
    try:
        x = torch.zeros(bs, H, device=DEV, dtype=torch.bfloat16)
        loc = torch.full((bs,), PAD_SLOT, device=DEV, dtype=torch.int64)
        own = errors if target == "device" else None  # a HostStore counts into its own counter
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture (Triton compiles here)
            copy_rows(x @ w, torch.nn.functional.rms_norm(x, (H,)), loc, store, errors=own)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            aux = x @ w
            last = torch.nn.functional.rms_norm(x, (H,))
            copy_rows(aux, last, loc, store, errors=own)

        def replay(slots):
            x.copy_(torch.randn(bs, H, device=DEV, dtype=torch.bfloat16))
            loc.copy_(torch.tensor(slots, dtype=torch.int64))
            g.replay()
            torch.cuda.synchronize()
            return torch.cat([aux.reshape(bs, K, H), last[:, None]], 1).cpu()

        good = torch.randperm(S - 1)[:bs].add(1).tolist()
        rows = replay(good)
        check()  # nothing dropped: passes
        assert torch.equal(view[torch.tensor(good, device=view.device)].cpu(), rows)

        bad = [S, S + G - 1, -1, -G, 2**40, -(2**40), S + 10**6]
        good = torch.randperm(S - 1)[: bs - len(bad)].add(1).tolist()
        slots = good[:4] + bad + good[4:]
        for n_replays in (1, 2):
            before = view.cpu().clone()
            rows = replay(slots)
            n, seen, num_slots = errors.read()
            assert (n, num_slots) == (n_replays * len(bad), S) and seen in bad
            with pytest.raises(RuntimeError, match=rf"dropped {n} rows whose KV slot lay outside the store's \[0, {S}\)"):
                check()
            assert big[:G].isnan().all() and big[G + S :].isnan().all(), "a replay wrote outside the store"
            after = view.cpu()
            kept = [i for i, sl in enumerate(slots) if 0 <= sl < S]
            assert torch.equal(after[[slots[i] for i in kept]], rows[kept]), "in-range rows of the replay"
            untouched = torch.ones(S, dtype=torch.bool)
            untouched[[slots[i] for i in kept]] = False
            assert torch.equal(after[untouched].nan_to_num(7.0), before[untouched].nan_to_num(7.0))
    finally:
        if region is not None:
            pinned.unregister(region.buf)
            region.unlink()


@pytest.mark.parametrize("streams", ["mean", "full"])
def test_deepseek_v4_shaped_step_inside_cuda_graph_replays(streams):
    """A stand-in DeepSeek-V4 step at V4-Flash's width (H 4096, hc_mult 4): per captured layer the residual
    streams [bs, 4, H] (mixed from the input), captured as SGLang's V4 capture does (the streams' mean, or
    with --hs-hc-streams full every stream: x.flatten(1) into a 4H-wide slot of one packed buffer), the final
    state a collapse of the streams and a norm; the copy captured in the graph with them. Replays with new
    inputs, slots and padding write every real row, stream rows in order, to its slot."""
    K, HC, H, S = 3, 4, 4096, 1024
    rows_per_layer = HC if streams == "full" else 1
    P = K * rows_per_layer + 1
    buckets = [1, 4, 8]
    torch.manual_seed(0)
    mix = torch.randn(K, HC, H, device=DEV, dtype=torch.bfloat16)
    head = torch.randn(HC, device=DEV, dtype=torch.bfloat16).softmax(0)
    store = torch.full((S, P, H), float("nan"), device=DEV, dtype=torch.bfloat16)

    def step(x):
        packed = torch.empty(x.shape[0], K * rows_per_layer * H, device=DEV, dtype=torch.bfloat16)
        for k in range(K):
            xs = x[:, None, :] * mix[k]  # [bs, HC, H]
            out = packed[:, k * rows_per_layer * H:(k + 1) * rows_per_layer * H]
            out.copy_(xs.mean(dim=1) if streams == "mean" else xs.reshape(x.shape[0], HC * H))
        last = torch.nn.functional.rms_norm((xs * head[None, :, None]).sum(1), (H,))
        return packed, last

    graphs = {}
    for bs in buckets:
        x = torch.zeros(bs, H, device=DEV, dtype=torch.bfloat16)
        loc = torch.zeros(bs, device=DEV, dtype=torch.int64)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            aux, last = step(x)
            copy_rows(aux, last, loc, store)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            aux, last = step(x)
            copy_rows(aux, last, loc, store)
        graphs[bs] = (g, x, loc, aux, last)
    free = torch.randperm(S - 1) + 1
    for i in range(12):
        n = [1, 3, 4, 7, 8][i % 5]
        bs = next(b for b in buckets if b >= n)
        g, x, loc, aux, last = graphs[bs]
        slots = free[i * 8:i * 8 + n]
        x.copy_(torch.randn(bs, H, device=DEV, dtype=torch.bfloat16))
        loc.copy_(torch.cat([slots, torch.full((bs - n,), PAD_SLOT)]).to(DEV))
        g.replay()
        torch.cuda.synchronize()
        want_aux, want_last = step(x)  # eager: the same numbers the graph computed
        want = torch.cat([want_aux.reshape(bs, K * rows_per_layer, H), want_last[:, None]], 1)[:n]
        assert torch.equal(store[slots.to(DEV)], want), f"replay {i}: rows did not land at their slots"
        if streams == "full":  # stream s of the k-th layer at row k*HC + s
            xs = x[:n, None, :] * mix[2]
            assert torch.equal(store[slots.to(DEV)][:, 2 * HC + 3], xs[:, 3])
