"""A reader in another process consuming while CUDA-graph replays keep writing, with admission control
engaging: requests arrive faster than a slow reader frees a small output ring, so admission holds them
(never the replay); every record arrives exact, nothing is dropped; with --hs-copy direct and staging
(each replay shipped after the step). The scheduler around it is a stand-in
(the GPU machine has no SGLang): AdmissionControl gets SGLang's two message types from a stand-in module."""
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import types

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store import pinned  # noqa: E402
from sglang_hs.server.store.admission import AdmissionControl  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
K, H, SLOTS, BUCKET, PAD = 3, 512, 8192, 256, 0
N_REQ = 24


class TokenizedGenerateReqInput:
    def __init__(self, rid, input_ids, max_new_tokens):
        self.rid, self.input_ids = rid, input_ids
        self.sampling_params = types.SimpleNamespace(max_new_tokens=max_new_tokens)


class AbortReq:
    def __init__(self, rid="", abort_all=False, **kw):
        self.rid, self.abort_all = rid, abort_all


def _slow_reader(dump_dir, rids, out_path):
    from sglang_hs import HiddenStateReader

    r = HiddenStateReader(dump_dir)
    got = {}
    for _ in rids:
        rec = r.next(timeout=300)
        got[rec.rid] = (rec.input_ids, rec.aux_hidden_states, rec.last_hidden_state)
        time.sleep(0.05)  # slower than the writer: the ring fills
    torch.save(got, out_path)


@pytest.mark.parametrize("copy", ["direct", "staging", "deferred"])
def test_reader_concurrent_with_replays_and_admission(monkeypatch, copy):
    io = types.ModuleType("sglang.srt.managers.io_struct")
    io.TokenizedGenerateReqInput, io.AbortReq = TokenizedGenerateReqInput, AbortReq
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io)

    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    spec = CaptureSpec.resolve([2, 4, 5], True, 8, H)
    w = CaptureWriter(d, spec, SLOTS, torch.bfloat16, 4 << 20, device="cuda", copy=copy, staging_rows=BUCKET)
    adm = AdmissionControl(w.ring, w.P, H, 2, context_len=4096)
    wt = torch.randn(H, K * H, device="cuda", dtype=torch.bfloat16) / H**0.5
    x = torch.zeros(BUCKET, H, device="cuda", dtype=torch.bfloat16)
    loc = torch.zeros(BUCKET, device="cuda", dtype=torch.int64)

    def step():
        aux = x @ wt
        last = torch.nn.functional.rms_norm(x, (H,))
        w.copy(aux, last, loc)
        return aux, last

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        aux_out, last_out = step()

    rids = [f"adm-{i}" for i in range(N_REQ)]
    p = mp.get_context("spawn").Process(target=_slow_reader, args=(d, rids, os.path.join(d, "read.pt")))
    p.start()
    lengths = [100 + 37 * i % 150 for i in range(N_REQ)]
    arrivals = [TokenizedGenerateReqInput(rid, list(range(n)), 1) for rid, n in zip(rids, lengths)]
    expected, free, t0 = {}, list(range(1, SLOTS)), time.monotonic()
    pending = list(arrivals)
    while len(expected) < N_REQ:
        admitted = adm.filter(pending[:4], lambda: set())  # four arrive per iteration until all did
        pending = pending[4:]
        for req in admitted:
            T = len(req.input_ids)
            slots = [free.pop() for _ in range(T)]
            x.copy_(torch.randn(BUCKET, H, device="cuda", dtype=torch.bfloat16))
            loc.copy_(torch.tensor(slots + [PAD] * (BUCKET - T), device="cuda"))
            w.before_step()
            g.replay()  # never waits: admission already reserved the record's room
            w.after_step(T, graph_replayed=True)  # staging: ships the replay's real rows
            expected[req.rid] = torch.cat([aux_out[:T].view(T, K, H), last_out[:T, None]], 1).cpu()
            w.finish(req.rid, req.input_ids, torch.tensor(slots, device="cuda"))
            adm.release(req.rid)
            free += slots
        assert time.monotonic() - t0 < 240, "admission never let the rest in"
        time.sleep(0.01)
    p.join(300)
    assert p.exitcode == 0
    got = torch.load(os.path.join(d, "read.pt"))
    assert sorted(got) == sorted(rids)
    for rid in rids:
        ids, aux_rows, last_rows = got[rid]
        assert torch.equal(aux_rows, expected[rid][:, :K]) and torch.equal(last_rows, expected[rid][:, K]), rid
    assert adm.stats["admission_waits"] > 0 and w.stats.get("dropped", 0) == 0
    if copy != "direct":
        assert w.stats["staged_rows"] == BUCKET + sum(lengths)  # warm-up, then real rows
        w.staging.close()
    if copy != "staging":
        pinned.unregister(w.region.buf)
    shutil.rmtree(d)
