"""Speculative verify on a GPU, without SGLang (issue 44): a verify step's rows copied inside a CUDA-graph
replay (fixed shape: every request's draft window, as SGLang's target-verify graph runs it), then SGLang's
move of the accepted drafts' KV to the front of each window (CaptureWriter.move, what the pool's
move_kv_cache calls: with --hs-copy direct on the GPU through the mapped store, in stream order, no host
synchronisation), then the records gathered through req_to_token: each holds the accepted tokens' rows,
never a rejected draft's, for every copy strategy."""
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

from sglang_hs import HiddenStateReader  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

pytestmark = pytest.mark.gpu
K, H, SLOTS, DRAFTS = 3, 512, 4096, 6
# per request: the window's accepted nodes (root first; a tree: not all at the front)
ACCEPTED = [[0, 2, 5], [0], [0, 1, 2, 3], [0, 4]]


@pytest.mark.parametrize("copy", ["direct", "staging", "deferred"])
def test_verify_rows_follow_the_kv_move_of_accepted_drafts(copy):
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    spec = CaptureSpec.resolve([2, 4, 5], True, 8, H)
    w = CaptureWriter(d, spec, SLOTS, torch.bfloat16, 64 << 20, device="cuda", copy=copy, staging_rows=64)
    try:
        torch.manual_seed(0)
        wt = torch.randn(H, K * H, device="cuda", dtype=torch.bfloat16) / H**0.5
        bs, rows = len(ACCEPTED), len(ACCEPTED) * DRAFTS

        def step(x, loc):
            aux = x @ wt
            last = torch.nn.functional.rms_norm(x, (H,))
            w.copy(aux, last, loc)
            return aux, last

        x = torch.zeros(rows, H, device="cuda", dtype=torch.bfloat16)
        loc = torch.zeros(rows, device="cuda", dtype=torch.int64)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(x, loc)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            aux, last = step(x, loc)

        free = (torch.randperm(SLOTS - 1) + 1).tolist()
        prompt = [7, 3, 12, 5]
        req_to_token = torch.zeros(bs, 64, dtype=torch.int64, device="cuda")
        tokens, expected = [], []
        xs, locs = [], []
        for i, n in enumerate(prompt):  # prefill, eager
            sl = [free.pop() for _ in range(n)]
            req_to_token[i, :n] = torch.tensor(sl)
            xs.append(torch.randn(n, H, device="cuda", dtype=torch.bfloat16))
            locs += sl
            tokens.append(list(range(100 * i, 100 * i + n)))
        w.before_step()
        pa, pl = step(torch.cat(xs), torch.tensor(locs, device="cuda"))
        w.after_step(len(locs), graph_replayed=False)
        prows = torch.cat([pa.view(-1, K, H), pl[:, None]], 1).cpu()
        o = 0
        for n in prompt:
            expected.append([prows[o:o + n]])
            o += n
        # the verify step: each request's window of DRAFTS slots after its prompt, one graph replay
        window = []
        for i, n in enumerate(prompt):
            sl = [free.pop() for _ in range(DRAFTS)]
            req_to_token[i, n:n + DRAFTS] = torch.tensor(sl)
            window += sl
        x.copy_(torch.randn(rows, H, device="cuda", dtype=torch.bfloat16))
        loc.copy_(torch.tensor(window, device="cuda"))
        w.before_step()
        g.replay()
        w.after_step(rows, graph_replayed=True)
        vrows = torch.cat([aux.view(rows, K, H), last[:, None]], 1).cpu()
        # SGLang's move: accepted node j of request i from window slot j to the window's front
        tgt, src = [], []
        for i, acc in enumerate(ACCEPTED):
            base = i * DRAFTS
            tgt += [window[base + k] for k in range(len(acc))]
            src += [window[base + j] for j in acc]
            expected[i].append(vrows[[base + j for j in acc]])
            tokens[i] += [1000 + j for j in acc]
        w.move(torch.tensor(tgt, device="cuda"), torch.tensor(src, device="cuda"))
        for i, n in enumerate(prompt):
            w.finish(f"v-{i}", tokens[i], req_to_token[i, :n + len(ACCEPTED[i])])
        with HiddenStateReader(d) as reader:
            for i in range(bs):
                rec = reader.take(f"v-{i}", timeout=120)
                want = torch.cat(expected[i])
                assert rec.input_ids.tolist() == tokens[i]
                assert torch.equal(rec.aux_hidden_states, want[:, :K]) and torch.equal(rec.last_hidden_state,
                                                                                       want[:, K]), f"request {i}"
        changed = sum(sum(1 for k, j in enumerate(acc) if k != j) for acc in ACCEPTED)
        assert w.stats["moved_rows"] == (len(tgt) if copy == "direct" else changed)  # direct: every pair, on the GPU
    finally:
        w.close()  # stops the copy, unregisters the store
        shutil.rmtree(d, ignore_errors=True)
