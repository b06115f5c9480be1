"""dsv4_cpu_dspark (DeepSeek-V4's DSpark draft on the CPU engine) and dsv4_cpu_spec's DSpark verify prefixes, piece by
piece: the verify window's prefix (seq_lens_cpu less the window, checked against its positions), the injection's
commit gate (after a verify only each request's first commit_lens rows reach the draft's KV, at their slots, as
main_norm(main_proj(h)) through each stage's wkv, kv_norm and RoPE), the draft attention's reach (every block row sees
its whole block and the context window, nothing before the window and no other request), record_stream on CPU, and
a sampled request's accept (chain_speculative_sampling_cpu against upstream's Triton kernel run by Triton's
interpreter on the same inputs and coins). The end-to-end judge (every row of greedy and sampled requests against HF
float32, drafts accepted and rejected) is tests/e2e/test_v4_cpu.py::test_dspark_verify_passes_keep_only_committed_rows.
Planted in the sampler (scratch copies; each fails test_sampled_verify_accepts_as_upstreams_kernel at its
torch.equal, on predicts): the bonus drawn from the target's row after a rejection (no max(p - q, 0)); a draft
accepted while coin < p (q ignored).
"""
import os
import subprocess
import sys
import types

import pytest
import torch


@pytest.fixture(scope="module")
def mods(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang_hs.server.patches import dsv4_cpu_dspark, dsv4_cpu_spec
    return types.SimpleNamespace(dspark=dsv4_cpu_dspark, spec=dsv4_cpu_spec)


class DFlashVerifyInput(types.SimpleNamespace):  # the name dsv4_cpu_spec tells a DSpark verify by
    pass


class _Mode:
    def is_target_verify(self):
        return True

    def is_idle(self):
        return False


def _verify_batch(prefixes, reqs, n, shift=0):
    positions = torch.cat([torch.arange(p, p + n) for p in prefixes]) + shift
    return types.SimpleNamespace(forward_mode=_Mode(), seq_lens_cpu=torch.tensor(prefixes) + n,
                                 req_pool_indices=torch.tensor(reqs), positions=positions,
                                 spec_info=DFlashVerifyInput(draft_token_num=n, custom_mask=None))


def test_a_dspark_verify_window_starts_at_its_prefix(mods):
    """DSparkWorkerV2 hands a torch_native verify seq_lens_cpu with the window added: each request's span is (prefix,
    gamma + 1) all the same, the prefix where its window's positions start."""
    assert mods.spec.verify_spans(_verify_batch([29, 130], [3, 1], 4)) == [(3, 29, 4), (1, 130, 4)]
    with pytest.raises(NotImplementedError, match="DSpark verify window at positions"):
        mods.spec.verify_spans(_verify_batch([29, 130], [3, 1], 4, shift=1))


def _linear(rows, cols, g):
    return types.SimpleNamespace(weight=torch.randn(rows, cols, generator=g) * cols ** -0.5)


def _norm(dim, g):
    return types.SimpleNamespace(weight=0.5 + torch.rand(dim, generator=g), variance_epsilon=1e-6)


def _freqs(positions, half):
    angles = torch.outer(torch.arange(positions).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
    return torch.polar(torch.ones_like(angles), angles)


class _Pool:
    def __init__(self, layers, slots, dim):
        self.buf = [torch.full((slots, 1, dim), float("nan")) for _ in range(layers)]

    def set_kv_buffer(self, layer, loc, k, v):
        assert torch.equal(k, v)  # value = key (MQA)
        self.buf[layer.layer_id][loc.long()] = k

    def get_key_buffer(self, layer_id):
        return self.buf[layer_id]


def _draft(stages, H, D, g):
    attns = [types.SimpleNamespace(wkv=_linear(D, H, g), kv_norm=_norm(D, g), eps=1e-6, freqs_cis=_freqs(64, 4),
                                   attn=types.SimpleNamespace(layer_id=s)) for s in range(stages)]
    proj = _linear(H, 2 * H, g)
    return types.SimpleNamespace(stages=[types.SimpleNamespace(self_attn=a) for a in attns],
                                 project_target_hidden=lambda h: h @ proj.weight.T)


def _reference_key(attn, main_x, position):
    """SGLang's injected key of one context row, written out: DeepseekV4ForCausalLMDSpark.store_commit_kv's
    set_swa_key_buffer_radix_fused_norm_rope(kv=wkv(main_x), kv_weight=kv_norm.weight, eps, freqs_cis, positions):
    RMSNorm over the row, then RoPE on its last 2 * freqs_cis.shape[-1] channels, each (even, odd) pair a complex
    number times freqs_cis[position] (view_as_real(freqs_cis) interleaved, as the fused kernel reads it)."""
    kv = attn.wkv.weight.float() @ main_x.float()
    kv = kv / torch.sqrt(kv.pow(2).mean() + attn.eps) * attn.kv_norm.weight.float()
    rope_dim = 2 * attn.freqs_cis.shape[-1]
    pairs = torch.view_as_complex(kv[-rope_dim:].reshape(-1, 2).contiguous())
    return torch.cat([kv[:-rope_dim], torch.view_as_real(pairs * attn.freqs_cis[position]).flatten()])


def _reference_commit(draft, hidden, positions, loc_2d, commit_lens):
    """{slot: key} that SGLang's commit gate writes: row (b, col) of the verify window only where col < commit_lens[b]
    (DSparkKvInjector.committed_swa_loc: -1, nothing stored, elsewhere), at slot loc_2d[b, col]."""
    width = loc_2d.shape[1]
    written = {}
    for b, committed in enumerate(commit_lens.tolist()):
        for col in range(committed):
            row = b * width + col
            main_x = draft.project_target_hidden(hidden[row:row + 1])[0]
            written[int(loc_2d[b, col])] = [_reference_key(stage.self_attn, main_x, int(positions[row]))
                                            for stage in draft.stages]
    return written


def test_the_commit_injects_only_committed_rows(mods):
    """After a verify pass of windows of 4 (anchor and 3 drafts) with 0 and 2 drafts accepted, the draft's KV gets the
    first 1 and 3 rows of each window, at their slots, in every stage's layer; the rejected drafts' slots keep what
    they held. Each key is the stage's kv_norm(wkv(main_proj(h))) with RoPE at the row's position."""
    g = torch.Generator().manual_seed(0)
    H, D, stages = 12, 10, 3
    draft, pool = _draft(stages, H, D, g), _Pool(stages, 40, D)
    hidden = torch.randn(8, 2 * H, generator=g)
    loc_2d = torch.tensor([[5, 6, 7, 8], [20, 21, 22, 23]])
    positions = torch.tensor([9, 10, 11, 12, 30, 31, 32, 33])
    mods.dspark.write_target_hidden_kv(draft, pool=pool, positions=positions, target_hidden=hidden,
                                       cache_loc=loc_2d.reshape(-1), cache_loc_2d=loc_2d,
                                       commit_lens=torch.tensor([1, 3]))
    want = _reference_commit(draft, hidden, positions, loc_2d, torch.tensor([1, 3]))
    assert sorted(want) == [5, 20, 21, 22]
    for s in range(stages):
        buf = pool.buf[s][:, 0]
        got = torch.stack([buf[slot] for slot in want])
        ref = torch.stack([keys[s] for keys in want.values()])
        print(f"stage {s}: max |diff| {(got - ref).abs().max():.3g}, mean {(got - ref).abs().mean():.3g}")
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        assert torch.isnan(buf[[6, 7, 8, 23]]).all()  # the rejected drafts' slots: untouched
    # a prefill's injection (no commit gate): every row
    pool2 = _Pool(stages, 40, D)
    mods.dspark.write_target_hidden_kv(draft, pool=pool2, positions=positions, target_hidden=hidden,
                                       cache_loc=loc_2d.reshape(-1))
    assert not torch.isnan(pool2.buf[0][loc_2d.reshape(-1)]).any()


def test_record_stream_is_a_no_op_on_cpu(mods):
    wrapped = mods.dspark._record_stream_on_cpu(lambda t, s: pytest.fail("the original ran for a CPU tensor"))
    assert wrapped(torch.zeros(2), object()) is None


def _attention(g, H=16, heads=2, D=12, groups=2, rank=4):
    return types.SimpleNamespace(
        n_local_heads=heads, head_dim=D, wq_a=_linear(8, H, g), q_norm=_norm(8, g), wq_b=_linear(heads * D, 8, g),
        q_head_norm=True, eps=1e-6, freqs_cis=_freqs(64, 2), wkv=_linear(D, H, g), kv_norm=_norm(D, g),
        attn=types.SimpleNamespace(layer_id=0), attn_sink=torch.randn(heads, generator=g), attn_tp_rank=0,
        softmax_scale=D ** -0.5, n_local_groups=groups, o_lora_rank=rank,
        wo_a=_linear(groups * rank, heads * D // groups, g), wo_b=lambda o: (o, None))


def test_the_draft_block_sees_itself_and_the_context_window(mods, monkeypatch):
    """Each block row (two requests, blocks of 3 after prefixes of 9 and 4, window 4 here) attends over its whole block
    (a later row's input moves the first row's output) and the keys of positions prefix - 4 .. prefix - 1 read through
    req_to_token (one there moves it, one before the window does not), never another request's."""
    from sglang.srt.model_executor import forward_context

    g = torch.Generator().manual_seed(1)
    attn, H = _attention(g), 16
    pool = _Pool(1, 64, attn.head_dim)
    pool.buf[0][:] = torch.randn(64, 1, attn.head_dim, generator=g)
    req_to_token = torch.arange(2 * 32).view(2, 32)  # request r's position p at slot 32 r + p
    monkeypatch.setattr(forward_context, "get_token_to_kv_pool", lambda: pool)
    monkeypatch.setattr(forward_context, "get_req_to_token_pool", lambda: types.SimpleNamespace(
        req_to_token=req_to_token))
    monkeypatch.setattr(mods.dspark, "_swa_window", lambda: 4)
    prefixes = [9, 4]
    positions = torch.tensor([9, 10, 11, 4, 5, 6])
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False),
                                  req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(prefixes),
                                  out_cache_loc=torch.tensor([9, 10, 11, 36, 37, 38]))
    x = torch.randn(6, H, generator=g)

    def run(x, touch=None):
        saved = pool.buf[0].clone()
        if touch is not None:
            pool.buf[0][touch] += 1.0
        try:
            return mods.dspark.dspark_attention_forward(attn, positions, x, batch)
        finally:
            pool.buf[0][:] = saved

    base = run(x)
    assert torch.isfinite(base).all() and base.shape == (6, attn.n_local_groups * attn.o_lora_rank)
    later = x.clone()
    later[2] += 1.0  # request 0's last block row
    moved = run(later)
    assert not torch.allclose(moved[0], base[0]) and torch.equal(moved[3:], base[3:])
    assert not torch.allclose(run(x, touch=5)[:3], base[:3])  # position 5 = 9 - 4: in request 0's window
    assert torch.equal(run(x, touch=4), base)  # position 4: before it (and no other request's)
    assert torch.equal(run(x, touch=32 + 4)[:3], base[:3])  # request 1's slot: not request 0's


# Upstream's chain rejection sampling kernel (reject_sampling.speculative_sampling_classic_kernel) run by Triton's
# interpreter on CPU tensors (TRITON_INTERPRET=1, a process of its own: Triton reads it at import): the inputs from
# a file, its predicts, accept_index and accept_token_num to another
_INTERPRETED_KERNEL = """
import sys
import torch
from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton
args = torch.load(sys.argv[1])
chain_speculative_sampling_triton(*args, 1.0, 1.0, True)
torch.save(args[:3], sys.argv[2])
"""


def _sampling_inputs(requests=48, gamma=3, vocab=32):
    """Chains whose drafts are drawn from their draft rows, against target rows from the draft's own (every draft
    passes) through a perturbed one to an unrelated one, so the accepted counts span 0 .. gamma; one request's first
    draft has draft probability 0 (rejected whatever its coin). Outputs pre-filled with -1, as the kernel leaves
    unaccepted slots."""
    g = torch.Generator().manual_seed(11)
    draft = torch.softmax(torch.randn(requests, gamma, vocab, generator=g) * 3, -1)
    drafts = torch.multinomial(draft.view(-1, vocab), 1, generator=g).view(requests, gamma)
    closeness = torch.linspace(0, 1, requests).view(-1, 1, 1)
    unrelated = torch.softmax(torch.randn(requests, gamma + 1, vocab, generator=g) * 3, -1)
    own = torch.cat([draft, unrelated[:, -1:]], dim=1)
    target = closeness * own + (1 - closeness) * unrelated
    draft[0, 0, drafts[0, 0]] = 0.0
    candidates = torch.cat([torch.randint(0, vocab, (requests, 1), generator=g), drafts], dim=1)
    index = torch.arange(requests * (gamma + 1)).view(requests, gamma + 1)
    outputs = (torch.full((requests * (gamma + 1),), -1, dtype=torch.int32),
               torch.full((requests, gamma + 1), -1, dtype=torch.int32), torch.zeros(requests, dtype=torch.int32))
    coins = (torch.rand(requests, gamma, generator=g), torch.rand(requests, generator=g))
    return (*outputs, candidates, index, index.clone(), index.clone(), *coins, target, draft)


def test_sampled_verify_accepts_as_upstreams_kernel(mods, tmp_path):
    """chain_speculative_sampling_cpu (a sampled request's verify: SGLang's AcceptSampling calls the Triton kernel
    even on CPU tensors, "0 active drivers" on the CPU engine) gives upstream's kernel's predicts (accepted drafts
    and the bonus from the target row or the residual max(p - q, 0)), accept_index and accept_token_num on the same
    inputs and coins, every accepted count 0 .. gamma among them; block verification is refused."""
    args = _sampling_inputs()
    torch.save(args, tmp_path / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-c", _INTERPRETED_KERNEL, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = torch.load(tmp_path / "out.pt")
    mods.dspark.chain_speculative_sampling_cpu(*args, 1.0, 1.0, True)
    assert sorted(set(want[2].tolist())) == [0, 1, 2, 3] and want[2][0] == 0
    for name, got, expected in zip(("predicts", "accept_index", "accept_token_num"), args[:3], want):
        assert torch.equal(got, expected), (name, got, expected)
    with pytest.raises(NotImplementedError, match="block verification"):
        mods.dspark.chain_speculative_sampling_cpu(*_sampling_inputs(), 1.0, 1.0, True, block_verification=True)


def test_the_sampler_keeps_upstreams_kernel_for_gpu_tensors(mods, monkeypatch):
    """The patched name takes the CPU sampler for CPU tensors only (upstream's dispatch rule, inputs_on_cuda): what
    that rule routes to CUDA still runs upstream's kernel."""
    ran = []
    dispatch = mods.dspark._on_cpu_tensors(lambda *a: ran.append("cpu"), lambda *a: ran.append("upstream"))
    dispatch(torch.zeros(2))
    monkeypatch.setattr(mods.dspark, "inputs_on_cuda", lambda *a, **k: True)
    dispatch(torch.zeros(2))
    assert ran == ["cpu", "upstream"]
