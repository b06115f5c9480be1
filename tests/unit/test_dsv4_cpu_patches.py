"""The DeepSeek-V4 CPU-engine patches' pieces against HF transformers' DeepseekV4 float32 (issue 45, slice 1).

- dsv4_torch_native: the interleaved RoPE on SGLang's own freqs_cis table of a sliding layer (and its conjugate)
  equals HF's apply_rotary_pos_emb on HF's "main" rope; the windowed attention with sinks equals HF's eager
  attention under HF's sliding-window mask; hc_pre / hc_post / hc_head equal HF's DeepseekV4HyperConnection, the
  decoder layer's stream mix and DeepseekV4HyperHead; the plain MHA pool is chosen for V4 and a compressed layer is
  refused at its forward.
- dsv4_cpu_moe: the clamped SwiGLU equals HF's DeepseekV4MLP / DeepseekV4Experts activation with a limit that bites,
  for the shared expert's silu_and_mul_clamp and, inside moe_forward_native, the routed experts'.
- dsv4_cpu_server_args: V4's CPU overrides (torch_native, token pages, no hybrid SWA pools) and the KV dtype pass
  left to "auto" on CPU.
The end-to-end judge is tests/e2e/test_v4_cpu.py.
"""
import os
import types

import pytest
import torch

H, HC, HEADS, D, ROPE = 40, 4, 3, 32, 8


@pytest.fixture(scope="module")
def mods(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.srt.models import deepseek_v4

        from sglang_hs.server.patches import dsv4_cpu_moe, dsv4_cpu_server_args, dsv4_torch_native
    return types.SimpleNamespace(v4=deepseek_v4, tn=dsv4_torch_native, moe=dsv4_cpu_moe, args=dsv4_cpu_server_args)


@pytest.fixture(scope="module")
def hf_cfg():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=64, hidden_size=H, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=HEADS, num_key_value_heads=1, head_dim=D, qk_rope_head_dim=ROPE,
                            q_lora_rank=16, o_groups=1, o_lora_rank=8, hc_mult=HC, sliding_window=5,
                            compress_ratios=[0, 0], num_nextn_predict_layers=0, max_position_embeddings=256,
                            swiglu_limit=0.3)


def test_rope_on_sglangs_table_is_hfs_main_rope(mods, hf_cfg):
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    # what MqaAttentionBase builds for a sliding layer (compress ratio 0: no YaRN)
    freqs = precompute_freqs_cis(dim=ROPE, seqlen=256, original_seq_len=0, base=hf_cfg.rope_theta, factor=1.0,
                                 beta_fast=32, beta_slow=1)
    pos = torch.tensor([0, 1, 7, 8, 100, 255])
    x = torch.randn(len(pos), HEADS, D, generator=torch.Generator().manual_seed(0))
    cos, sin = m.DeepseekV4RotaryEmbedding(hf_cfg)(x, pos[None], layer_type="main")
    ref = m.apply_rotary_pos_emb(x[None].transpose(1, 2), cos, sin).transpose(1, 2)[0]
    got = mods.tn._rope(x, freqs, pos)
    print("rope max", (got - ref).abs().max().item())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    inv = m.apply_rotary_pos_emb(x[None].transpose(1, 2), cos, -sin).transpose(1, 2)[0]
    torch.testing.assert_close(mods.tn._rope(x, freqs, pos, inverse=True), inv, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[1:], x[1:])  # the rotation does something past position 0


@pytest.mark.parametrize("prefix, n", [(0, 17), (9, 1), (3, 6)])
def test_window_and_sink_attention_is_hfs_eager_attention(mods, hf_cfg, prefix, n):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    g = torch.Generator().manual_seed(prefix * 31 + n)
    L, W = prefix + n, hf_cfg.sliding_window
    q = torch.randn(n, HEADS, D, generator=g)
    keys = torch.randn(L, D, generator=g)
    sinks = torch.randn(HEADS, generator=g)
    mask = mods.tn.window_mask(prefix, n, L, W, "cpu")
    got = mods.tn.sink_attention(q, keys, mask, sinks, D ** -0.5)
    # HF: additive sliding-window causal mask, kv broadcast to every head, sinks as s_aux
    qpos, kpos = torch.arange(prefix, L)[:, None], torch.arange(L)[None]
    additive = torch.where((kpos <= qpos) & (kpos > qpos - W), 0.0, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=HEADS, sinks=sinks, training=False)
    ref, _ = m.eager_attention_forward(module, q.transpose(0, 1)[None], keys[None, None], keys[None, None], additive,
                                       scaling=D ** -0.5)
    torch.testing.assert_close(got, ref[0], rtol=1e-5, atol=1e-6)
    assert mask.sum(-1).max() == min(W, L)  # never more than the window
    dropped = mods.tn.sink_attention(q, keys, mask, torch.full_like(sinks, -1e9), D ** -0.5)
    assert (got - dropped).abs().max() > 1e-3  # the sinks weigh


def _hc_layer(mods, hf_cfg):
    return types.SimpleNamespace(hc_mult=HC, rms_norm_eps=hf_cfg.rms_norm_eps, hc_eps=hf_cfg.hc_eps,
                                 hc_sinkhorn_iters=hf_cfg.hc_sinkhorn_iters)


def test_hyper_connections_are_hfs(mods, hf_cfg):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    g = torch.Generator().manual_seed(1)
    hc = m.DeepseekV4HyperConnection(hf_cfg)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.1)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g) * 0.5)
        hc.scale.copy_(0.5 + torch.rand(3, generator=g))
    streams = torch.randn(9, HC, H, generator=g)
    post, comb, collapsed = hc(streams[None])
    layer = _hc_layer(mods, hf_cfg)
    y, p, c, normed = mods.tn.hc_pre(layer, streams, hc.fn, hc.scale, hc.base)
    assert normed is False
    torch.testing.assert_close(y, collapsed[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p, post[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c, comb[0], rtol=1e-6, atol=1e-6)
    out = torch.randn(9, H, generator=g)
    ref = post[0].unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), streams)
    torch.testing.assert_close(mods.tn.hc_post(layer, out, streams, p, c), ref, rtol=1e-6, atol=1e-6)
    head = m.DeepseekV4HyperHead(hf_cfg)
    with torch.no_grad():
        head.hc_fn.copy_(torch.randn(head.hc_fn.shape, generator=g) * 0.1)
        head.hc_base.copy_(torch.randn(HC, generator=g))
        head.hc_scale.fill_(0.7)
    model = types.SimpleNamespace(norm_eps=hf_cfg.rms_norm_eps, hc_eps=hf_cfg.hc_eps)
    torch.testing.assert_close(mods.tn.hc_head(model, streams, head.hc_fn, head.hc_scale, head.hc_base),
                               head(streams[None])[0], rtol=1e-6, atol=1e-6)


def test_clamped_swiglu_is_hfs_with_a_limit_that_bites(mods, hf_cfg):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    g = torch.Generator().manual_seed(2)
    mlp = m.DeepseekV4MLP(hf_cfg)
    x = torch.randn(11, H, generator=g)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1).detach()
    limit = hf_cfg.swiglu_limit
    assert (gate_up.abs() > limit).float().mean() > 0.2  # the clamp changes the result
    ref = (mlp.act_fn(mlp.gate_proj(x).clamp(max=limit)) * mlp.up_proj(x).clamp(-limit, limit)).detach()
    out = torch.empty_like(ref)
    patched = mods.moe._silu_and_mul_clamp(lambda *a: pytest.fail("CPU tensors never reach upstream's kernel"))
    patched(gate_up, out, limit)
    torch.testing.assert_close(out, ref)
    experts = m.DeepseekV4Experts(hf_cfg)
    torch.testing.assert_close(mods.moe.clamped_swiglu(gate_up, limit), experts._apply_gate(gate_up))


def test_routed_experts_take_the_limit(mods, cpu_engine_imports):
    with cpu_engine_imports():
        from sglang.srt.layers.moe import fused_moe_native
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
        from sglang.srt.layers.moe.topk import StandardTopKOutput
    g = torch.Generator().manual_seed(3)
    E, K, I, T, limit = 4, 2, 8, 7, 0.2
    layer = types.SimpleNamespace(num_experts=E, w13_weight=torch.randn(E, 2 * I, H, generator=g),
                                  w2_weight=torch.randn(E, H, I, generator=g) / I ** 0.5)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            ref[t] += w[t, k] * (mods.moe.clamped_swiglu(layer.w13_weight[e] @ x[t], limit) @ layer.w2_weight[e].T)
    original = fused_moe_native.moe_forward_native
    patched = mods.moe._with_limit(original)
    topk = StandardTopKOutput(w, ids, None)
    got = patched(layer, x, topk, MoeRunnerConfig(activation="silu", swiglu_limit=limit))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    plain = patched(layer, x, topk, MoeRunnerConfig(activation="silu"))
    torch.testing.assert_close(plain, original(layer, x, topk, MoeRunnerConfig(activation="silu")))
    assert (plain - got).abs().max() > 1e-3 and fused_moe_native.SiluAndMul is not None
    for other in ({"activation": "gelu"}, {"activation": "silu", "gemm1_alpha": 1.702}):  # never silently unclamped
        with pytest.raises(NotImplementedError, match=r"swiglu_limit 0.2 with activation .*would drop the limit"):
            patched(layer, x, topk, MoeRunnerConfig(swiglu_limit=limit, **other))


def test_hca_entries_are_hfs_compressor(mods, hf_cfg):
    """The ratio-128 compressor from per-token (kv | gate) sources on SGLang's compress-rope table (YaRN factor 1,
    compress_rope_theta) equals HF's DeepseekV4HCACompressor run stateless (complete blocks only)."""
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = DeepseekV4Config(**{**hf_cfg.to_dict(), "compress_ratios": [0, 128], "architectures": None,
                              "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256,
                                               "beta_fast": 32, "beta_slow": 1}})
    g = torch.Generator().manual_seed(4)
    comp = m.DeepseekV4HCACompressor(cfg)
    with torch.no_grad():
        for p in (comp.kv_proj.weight, comp.gate_proj.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
        comp.kv_norm.weight.copy_(0.5 + torch.rand(D, generator=g))
    T = 2 * 128 + 37  # two closed blocks and an open one
    x = torch.randn(1, T, H, generator=g)
    ref = comp(x, None, torch.arange(T)[None], None, 1)[0][0, 0]  # [2, D]
    freqs = precompute_freqs_cis(dim=ROPE, seqlen=256, original_seq_len=256, base=cfg.compress_rope_theta, factor=1.0,
                                 beta_fast=32, beta_slow=1)
    sources = torch.cat([comp.kv_proj(x[0]), comp.gate_proj(x[0])], dim=-1).detach()
    norm = types.SimpleNamespace(weight=comp.kv_norm.weight, variance_epsilon=comp.kv_norm.variance_epsilon)
    got = mods.tn.hca_entries(sources, 128, comp.position_bias, norm, freqs)
    assert got.shape == ref.shape == (2, D)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)
    assert mods.tn.hca_entries(sources[:127], 128, comp.position_bias, norm, freqs).shape == (0, D)


def test_csa_entries_are_hfs_compressor_and_the_ape_layout_is_undone(mods, hf_cfg):
    """The ratio-4 compressor (overlapping blocks) from per-token sources equals HF's DeepseekV4CSACompressor's keys
    (and so its indexer's, the same code on index_head_dim), and SGLang's load-time permutation of an overlapping
    compressor's ape (Compressor._apply_ape_hotfix) is undone by _hf_ape."""
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = DeepseekV4Config(**{**hf_cfg.to_dict(), "compress_ratios": [0, 4], "architectures": None,
                              "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256,
                                               "beta_fast": 32, "beta_slow": 1}})
    g = torch.Generator().manual_seed(5)
    comp = m.DeepseekV4CSACompressor(cfg)
    with torch.no_grad():
        for p in (comp.kv_proj.weight, comp.gate_proj.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
    T = 4 * 9 + 3
    x = torch.randn(1, T, H, generator=g)
    hf_keys = []
    comp.indexer.forward = lambda *a, **k: torch.zeros(1, T, 1, dtype=torch.long)  # keys only
    ref = comp(x, None, torch.arange(T)[None], None, 1)[0][0, 0]
    freqs = precompute_freqs_cis(dim=ROPE, seqlen=256, original_seq_len=256, base=cfg.compress_rope_theta, factor=1.0,
                                 beta_fast=32, beta_slow=1)
    sources = torch.cat([comp.kv_proj(x[0]), comp.gate_proj(x[0])], dim=-1).detach()
    norm = types.SimpleNamespace(weight=comp.kv_norm.weight, variance_epsilon=comp.kv_norm.variance_epsilon)
    got = mods.tn.csa_entries(sources, 4, comp.position_bias, norm, freqs)
    assert got.shape == ref.shape == (9, D) and not hf_keys
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)
    ape = comp.position_bias.detach()
    permuted = torch.cat([ape[:, :D], ape[:, D:]], dim=0).view(4, -1)  # what SGLang's loader stores
    sg = types.SimpleNamespace(ape=permuted, overlap=True, ape_converted=True, ratio=4)
    assert torch.equal(mods.tn._hf_ape(sg), ape) and not torch.equal(permuted, ape)


def test_the_indexer_keeps_hfs_blocks(mods, hf_cfg):
    """CSA's block choice: the indexer's compressed keys (csa_entries on its own sources), its queries roped on
    SGLang's compress table and indexer_keep give, per query, exactly the blocks HF's DeepseekV4Indexer returns (its
    -1 sentinels: none), with index_topk 3 below the closed blocks of the later queries (so some are dropped)."""
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = DeepseekV4Config(**{**hf_cfg.to_dict(), "compress_ratios": [0, 4], "architectures": None,
                              "index_n_heads": 16, "index_head_dim": 32, "index_topk": 3,
                              "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256,
                                               "beta_fast": 32, "beta_slow": 1}})
    g = torch.Generator().manual_seed(11)
    idx = m.DeepseekV4Indexer(cfg)
    with torch.no_grad():
        for p in idx.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    T, ratio, heads, d = 4 * 9 + 3, 4, 16, 32
    x, q_residual = torch.randn(1, T, H, generator=g), torch.randn(1, T, cfg.q_lora_rank, generator=g)
    with torch.no_grad():
        hf_top = idx(x, q_residual, torch.arange(T)[None], None, 0)[0]
        freqs = precompute_freqs_cis(dim=ROPE, seqlen=256, original_seq_len=256, base=cfg.compress_rope_theta,
                                     factor=1.0, beta_fast=32, beta_slow=1)
        sources = torch.cat([idx.kv_proj(x[0]), idx.gate_proj(x[0])], dim=-1)
        norm = types.SimpleNamespace(weight=idx.kv_norm.weight, variance_epsilon=idx.kv_norm.variance_epsilon)
        keys = mods.tn.csa_entries(sources, ratio, idx.position_bias, norm, freqs)
        q = mods.tn._rope(idx.q_b_proj(q_residual[0]).view(T, heads, d), freqs, torch.arange(T))
        w = idx.scorer.weights_proj(x[0]) * heads ** -0.5
        closed = torch.arange(keys.shape[0]).unsqueeze(0) < (torch.arange(T).unsqueeze(1) + 1) // ratio
        got = mods.tn.indexer_keep(q, keys, w, d ** -0.5, closed, cfg.index_topk)
    want = torch.zeros_like(got)
    for t in range(T):
        for j in hf_top[t].tolist():
            if j >= 0:
                want[t, j] = True
    assert torch.equal(got, want), (got.int() - want.int()).nonzero()[:5]
    assert (closed.sum(1) > cfg.index_topk).any() and (got.sum(1) <= cfg.index_topk).all()


def test_other_ratios_are_refused_at_their_forward(mods):
    layer = types.SimpleNamespace(compressor=object(), indexer=None, compress_ratio=2, layer_id=3)
    with pytest.raises(NotImplementedError, match="layer 3 has compress ratio 2; only"):
        mods.tn.mqa_forward(layer, torch.zeros(2, H), torch.zeros(2), None)


def test_server_args_overrides_on_cpu(mods, monkeypatch):
    environ = {}
    monkeypatch.setattr(mods.args.os, "environ", environ)
    assert mods.args._cpu_dsv4_overrides(None, None) == {"attention_backend": "torch_native", "page_size": 1,
                                                          "disable_hybrid_swa_memory": True}
    assert environ == mods.args.CPU_ENV  # set where a V4 config resolves: no other model's server gets them
    upstream = mods.args._kv_cache_dtype_on_cpu(lambda view: {"kv_cache_dtype": "fp8_e4m3"})
    assert upstream(types.SimpleNamespace(device="cpu")) == {}
    assert upstream(types.SimpleNamespace(device="cuda")) == {"kv_cache_dtype": "fp8_e4m3"}
    env = {"SGLANG_OPT_USE_FUSED_HASH_TOPK": "1"}  # a value the user set is kept
    added = mods.args.set_cpu_env(env)
    assert env == dict(mods.args.CPU_ENV, SGLANG_OPT_USE_FUSED_HASH_TOPK="1") and "SGLANG_OPT_USE_FUSED_HASH_TOPK" not in added
    assert env["SGLANG_OPT_USE_TILELANG_MHC_PRE"] == "0" and env["SGLANG_OPT_FUSE_MHC_POST_PRE"] == "0"
    assert mods.tn.sliding_window(types.SimpleNamespace(sliding_window=8, window_size=128)) == 8
    assert mods.tn.sliding_window(types.SimpleNamespace(sliding_window=None, window_size=128)) == 128


def _model_config(model_type, heads, kv_heads, o_groups=2):
    def cfg():
        return types.SimpleNamespace(model_type=model_type, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     o_groups=o_groups)

    hf = cfg()
    return types.SimpleNamespace(hf_config=hf, hf_text_config=hf, num_attention_heads=heads,
                                 num_key_value_heads=kv_heads)


def _padding(model_config, load_config, tp_size):
    """What SGLang's adjust_config_with_unaligned_cpu_tp does to a 1-KV-head config at tp_size: KV heads padded to
    tp_size, the query heads with them."""
    for o in (model_config, model_config.hf_config):
        o.num_attention_heads = tp_size * o.num_attention_heads // o.num_key_value_heads
        o.num_key_value_heads = tp_size
    return model_config


def test_dsv4_cpu_tp_keeps_v4_head_counts_and_nothing_else(cpu_engine_imports):
    """dsv4_cpu_tp: a V4 config leaves the CPU engine's TP adjustment with its own head counts (one MQA KV head:
    MqaAttentionBase asserts it and splits only the query heads); any other model's padding is SGLang's; a V4 split
    into partial heads or groups is refused."""
    with cpu_engine_imports():
        from sglang_hs.server.patches import dsv4_cpu_tp

    adjust = dsv4_cpu_tp._keeping_v4_heads(_padding, attn_tp_size=lambda: 2)
    v4 = adjust(_model_config("deepseek_v4", 4, 1), None, 2)
    assert (v4.num_attention_heads, v4.num_key_value_heads) == (4, 1)
    assert (v4.hf_config.num_attention_heads, v4.hf_config.num_key_value_heads) == (4, 1)
    other = adjust(_model_config("qwen3", 4, 1), None, 2)
    assert (other.num_attention_heads, other.num_key_value_heads) == (8, 2)  # SGLang's own padding, untouched
    for heads, groups in ((4, 1), (3, 1), (6, 3)):
        with pytest.raises(ValueError, match=r"sglang-hs dsv4_cpu_tp: DeepSeek-V4 attention tensor parallel 2: its "):
            adjust(_model_config("deepseek_v4", heads, 1, groups), None, 2)
    # under DP attention SGLang passes the whole TP size; the heads split over attention TP (TP / DP) only
    # (review: --tp 4 --dp 2 --enable-dp-attention passed the launcher, then failed in load_model)
    assert adjust(_model_config("deepseek_v4", 4, 1, 2), None, 4).num_attention_heads == 4  # attention TP 2
    with pytest.raises(ValueError, match=r"attention tensor parallel 4: its 4 query heads and 2 output groups"):
        dsv4_cpu_tp._keeping_v4_heads(_padding, attn_tp_size=lambda: 4)(_model_config("deepseek_v4", 4, 1, 2), None, 4)


def test_local_heads_is_upstreams_sink_slice(mods):
    """dsv4_torch_native.local_heads: rank r of t takes heads r * H/t .. (r + 1) * H/t of a whole per-head tensor
    (MqaAttentionBase._local_attn_sink's slice); the ranks' slices tile the heads in order."""
    sink = torch.arange(8.0)
    parts = [mods.tn.local_heads(sink, r, 2) for r in range(4)]
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert torch.equal(torch.cat(parts), sink)


def test_the_cpu_inplace_all_reduce_kernel_reduces_on_the_named_group(cpu_engine_imports, monkeypatch):
    """cpu_inplace_all_reduce registers its own kernel: the named group's in-place all-reduce, as SGLang's op body.
    It took the op's Python name's __wrapped__ before, which with SGLANG_KERNEL_API_LOGLEVEL > 0 is the op itself:
    a kernel that calls itself (RecursionError at V4's first DP-attention gather; review)."""
    import weakref

    with cpu_engine_imports():
        from sglang.srt.distributed import parallel_state as ps

        from sglang_hs.server.patches import cpu_inplace_all_reduce

    class Group:
        def _all_reduce_in_place(self, tensor):
            tensor.mul_(2)  # a stand-in "sum over two ranks" of equal tensors

    group = Group()
    monkeypatch.setitem(ps._groups, "hs-test-group", weakref.ref(group))
    kernel = cpu_inplace_all_reduce.apply()
    x = torch.arange(4, dtype=torch.int32)
    kernel(x, "hs-test-group")
    assert x.tolist() == [0, 2, 4, 6]
    y = torch.arange(4, dtype=torch.int32)
    torch.ops.sglang.inplace_all_reduce(y, "hs-test-group")  # through the dispatcher: the CPU kernel is ours
    assert y.tolist() == [0, 2, 4, 6]


_LOGGED_ALL_REDUCE = """
import sys, weakref, torch
sys.path.insert(0, sys.argv[1])
from sglang.kernels import kernel_api_logging
assert kernel_api_logging._KERNEL_API_LOG_LEVEL > 0
from sglang.srt.distributed import parallel_state as ps
from sglang_hs.server.patches import cpu_inplace_all_reduce

class Group:
    def _all_reduce_in_place(self, tensor):
        tensor.mul_(2)

group = Group()
ps._groups["hs-test-group"] = weakref.ref(group)
cpu_inplace_all_reduce.apply()
y = torch.arange(4, dtype=torch.int32)
torch.ops.sglang.inplace_all_reduce(y, "hs-test-group")
print(y.tolist())
"""


def test_the_cpu_inplace_all_reduce_kernel_with_sglangs_kernel_api_logging_on(tmp_path):
    """The same through the dispatcher in a process started with SGLANG_KERNEL_API_LOGLEVEL=1, which SGLang reads
    when it imports (so a process of its own): its logging wrapper is then the op's Python name, and a kernel taken
    from that name calls itself (the review's RecursionError)."""
    import subprocess
    import sys

    from sglang_hs.server.cpu import stubs_dir

    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_KERNEL_API_LOGLEVEL="1",
               SGLANG_KERNEL_API_LOGDEST=str(tmp_path / "kernel_api.log"))
    r = subprocess.run([sys.executable, "-c", _LOGGED_ALL_REDUCE, stubs_dir()], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "[0, 2, 4, 6]", r.stdout[-2000:]
