"""CPU engine: DeepSeek-V4's attention (sliding-window, compressed sparse and heavily compressed) and its
hyper-connections in plain torch, as HF's `deepseek_v4` computes them. Layers of compress ratio 0, 4 and 128; other
ratios (V4.1's 1 and 2) raise at their first forward.

See the ledger in sglang_hs/server/patches/__init__.py. Applied in CPU mode only:

- The KV pool: SGLang builds DeepSeekV4TokenToKVPool for V4 (FP8, 256-token pages, compressed-state pools; CUDA
  kernels). On the CPU engine `kv_cache_configurator.is_deepseek_v4` answers no, so V4 gets SGLang's plain MHA pool
  (the model config says MHA: one KV head of head_dim, in the model's dtype, one-token pages,
  sglang_hs/server/patches/dsv4_cpu_server_args.py): the attention writes each token's shared key/value at its KV
  slot and reads its request's keys through req_to_token, so prefix-cache hits, later chunks and decode see them.
- `MQALayer.forward` (upstream: the FlashMLA dsv4 backend): HF DeepseekV4Attention for a sliding layer: q = wq_b(
  q_norm(wq_a x)) with a per-head unweighted RMS norm, kv = kv_norm(wkv x), interleaved RoPE on the last
  qk_rope_head_dim channels (SGLang's own freqs_cis table of the layer), attention of each query over the
  `sliding_window` keys ending at its own position (the config's, HF's `sliding_window`: upstream's kernels use a
  fixed 128) with one learned sink logit per head (softmax over keys + sink, the sink's share dropped), value =
  key, the conjugate rotation at the query position on the output's rope channels, then the grouped wo_a and wo_b.
  Weights are used in the activations' dtype (wo_a is created bf16 upstream; a float32 server computes in float32).
- Ratio-128 layers (HF DeepseekV4HCACompressor): the compressor's per-token kv and gate (wkv_gate, = [wkv; wgate])
  are kept per layer at each token's KV slot (a store on the pool object, like the V3.2 index keys), and every step
  recomputes its requests' compressed keys from them (`hca_entries`: per closed 128-token block, kv_norm of the
  softmax(gate + ape)-weighted sum, RoPE at the block's first position), so chunked prefill, decode and prefix-cache
  hits need no compressor state; a query at position p also attends over the keys of blocks closed by p
  ((p + 1) // 128 of them), the sink's softmax covering both.
- Ratio-4 layers (HF DeepseekV4CSACompressor + DeepseekV4Indexer): the same per-token store for the compressor
  (kv and gate of 2 x head_dim: `csa_entries`, overlapping blocks: a block's key mixes its tokens' second halves with
  the previous block's first halves over 2 x 4 slots) and one for the indexer's own compressor (index_head_dim);
  each query scores the closed blocks' index keys (sum over index heads of weights_proj(x) * n^-0.5 * ReLU(q . k) *
  d^-0.5, q = indexer.wq_b(q_norm(wq_a x)) with the compress RoPE) and attends over the window and its index_topk
  best closed blocks. SGLang's loader permutes an overlapping compressor's ape (_apply_ape_hotfix): undone here
  (`_hf_ape`). No Hadamard rotation (HF has none; it is orthogonal on both sides in the CUDA path).
- `DeepseekV4DecoderLayerBase.hc_pre/hc_post` and `DeepseekV4Model.hc_head` (upstream: TileLang/Triton kernels,
  `hc_split_sinkhorn` has no CPU path): HF DeepseekV4HyperConnection / DeepseekV4HyperHead in torch.

Attention tensor parallel (--tp > 1, as SGLang splits V4: MqaAttentionBase): each rank computes its n_heads / tp query
heads (wq_b is column parallel) with their sinks (attn_sink is kept whole: this rank's slice, as _local_attn_sink) over
the one shared key of each token, which every rank keeps whole in its own pool, as it keeps the compressors and the
indexer (replicated); wo_a holds this rank's o_groups / tp groups, and wo_b (row parallel) goes through upstream's
`_project_wo_b`, whose all-reduce sums the ranks' partial outputs. Head counts: sglang_hs/server/patches/dsv4_cpu_tp.py.
IDLE batches attend over nothing (zeros). A decode batch DP attention pads to the other group's size comes with
padded requests too (request 0, length 1): their rows read and write only slot 0, which SGLang reserves, and are
never captured (the writer takes real requests' rows only).

Not done here: V4.1's ratios 1/2, the hybrid SWA and compressed-state pools (every key and
per-token compressor input is kept; the window and blocks are applied here, recomputed per step: O(request length)
per compressed layer and step), FP8 KV. Exactly tied index scores (every head's ReLU 0) have no defined order, in HF's
top-k as here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_hs.server.patches.dsa_torch_native import _requests
from sglang_hs.version import SGLANG_VERSION


def _rms(x: torch.Tensor, eps: float, weight=None) -> torch.Tensor:
    """HF DeepseekV4RMSNorm (weighted) / DeepseekV4UnweightedRMSNorm over the last dim, in float32."""
    dtype = x.dtype
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(dtype)


def _rope(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE (HF apply_rotary_pos_emb) on the last 2 * freqs_cis.shape[-1] channels of x [T, ..., D]."""
    f = freqs_cis.index_select(0, positions.long())  # [T, R/2] complex
    cos, sin = f.real.float(), f.imag.float()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rd = 2 * f.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def local_heads(per_head: torch.Tensor, rank: int, n_local: int) -> torch.Tensor:
    """This attention-TP rank's slice of a per-head tensor kept whole on every rank (MqaAttentionBase.attn_sink: its
    heads rank * n_local .. (rank + 1) * n_local, as upstream's _local_attn_sink; wq_b's rows are sharded the same)."""
    return per_head[rank * n_local:(rank + 1) * n_local]


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight.to(x.dtype))


def window_mask(prefix: int, n: int, length: int, window: int, device) -> torch.Tensor:
    """[n, length] bool: query t (position prefix + t) sees key j iff pos - window < j <= pos (HF's sliding mask)."""
    q_pos = torch.arange(prefix, prefix + n, device=device).unsqueeze(1)
    j = torch.arange(length, device=device).unsqueeze(0)
    return (j <= q_pos) & (j > q_pos - window)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [n, H, D], keys [L, D] (value = key), mask [n, L], sink [H]: HF eager_attention_forward with s_aux."""
    logits = torch.einsum("nhd,ld->nhl", q, keys) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    combined = torch.cat([logits, sink.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("nhl,ld->nhd", probs, keys)


def requests_of(forward_batch):
    """Per request of a batch: (request pool index, keys before this step, new tokens at positions prefix ..
    prefix + n - 1). A speculative verify pass's requests are sglang_hs/server/patches/dsv4_cpu_spec.py's, which
    rebinds this function while it is applied."""
    if forward_batch.forward_mode.is_target_verify():
        raise NotImplementedError("sglang-hs DeepSeek-V4 on the CPU engine: a speculative verify pass without the "
                                  "dsv4_cpu_spec patch")
    return _requests(forward_batch)


_SOURCES = "_hs_dsv4_compressor_sources"  # per-layer store of the HCA compressor's per-token kv and gate


def _source_store(pool, key, layer_id: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """[KV slots, dim] float32 under `key` (slots as in layer `layer_id`'s KV buffer), kept on the KV pool object."""
    stores = pool.__dict__.setdefault(_SOURCES, {})
    store = stores.get(key)
    if store is None:
        rows = pool.get_key_buffer(layer_id).shape[0]
        store = stores[key] = torch.zeros((rows, dim), dtype=torch.float32, device=like.device)
    return store


def hca_entries(sources: torch.Tensor, ratio: int, ape: torch.Tensor, norm, freqs_cis: torch.Tensor) -> torch.Tensor:
    """HF DeepseekV4HCACompressor: one key per closed `ratio`-token block of a request's tokens [L, 2D] (kv | gate):
    kv_norm(sum over the block of softmax(gate + ape) * kv), RoPE at the block's first position. [L // ratio, D]."""
    n = sources.shape[0] // ratio
    D = sources.shape[1] // 2
    if n == 0:
        return sources.new_zeros((0, D))
    kv, gate = sources[:n * ratio].view(n, ratio, 2 * D).float().split([D, D], dim=-1)
    w = (gate + ape.float()).softmax(dim=1)
    entries = _rms((kv * w).sum(dim=1), norm.variance_epsilon, norm.weight)
    return _rope(entries, freqs_cis, torch.arange(n, device=sources.device) * ratio)


def _hf_ape(comp) -> torch.Tensor:
    """The compressor's position bias in HF's layout [ratio, coff * D]: SGLang's loader permutes an overlapping
    (ratio-4) compressor's at load (Compressor._apply_ape_hotfix: the two halves stacked by rows)."""
    ape = comp.ape
    if comp.overlap and comp.ape_converted:
        ape = torch.cat(ape.reshape(2 * comp.ratio, -1).chunk(2, dim=0), dim=-1)
    return ape


def csa_entries(sources: torch.Tensor, ratio: int, ape: torch.Tensor, norm, freqs_cis: torch.Tensor) -> torch.Tensor:
    """HF DeepseekV4CSACompressor / the indexer's compressor: a key per closed `ratio`-token block from its tokens'
    second halves (Cb) and the previous block's first halves (Ca), softmax(gate + ape) over the 2 * ratio slots,
    kv_norm, RoPE at the block's first position. sources [L, 4D] (kv 2D | gate 2D) -> [L // ratio, D]."""
    n = sources.shape[0] // ratio
    D = sources.shape[1] // 4
    if n == 0:
        return sources.new_zeros((0, D))
    kv, gate = sources[:n * ratio].view(n, ratio, 4 * D).float().split([2 * D, 2 * D], dim=-1)
    gate = gate + ape.float()
    new_kv = kv.new_zeros((n, 2 * ratio, D))
    new_gate = gate.new_full((n, 2 * ratio, D), float("-inf"))
    new_kv[:, ratio:], new_gate[:, ratio:] = kv[..., D:], gate[..., D:]
    new_kv[1:, :ratio], new_gate[1:, :ratio] = kv[:-1, :, :D], gate[:-1, :, :D]
    entries = _rms((new_kv * new_gate.softmax(dim=1)).sum(dim=1), norm.variance_epsilon, norm.weight)
    return _rope(entries, freqs_cis, torch.arange(n, device=sources.device) * ratio)


def indexer_keep(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, softmax_scale: float,
                 closed: torch.Tensor, topk: int) -> torch.Tensor:
    """HF DeepseekV4Indexer's choice as a mask: `closed` [n, L] (the blocks each query may see) and-ed with its
    `topk` best blocks by sum_h weights[t, h] * relu(q[t, h] . keys[l]) * softmax_scale (DeepseekV4IndexerScorer),
    blocks not closed never chosen. q [n, heads, d] (roped), keys [L, d] (the indexer's compressed keys), weights
    [n, heads] (weights_proj(x) / sqrt(heads))."""
    score = (F.relu(torch.einsum("nhd,ld->nhl", q, keys)) * softmax_scale
             * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~closed, float("-inf"))
    top = score.topk(min(topk, keys.shape[0]), dim=-1).indices
    return closed & torch.zeros_like(closed).scatter_(1, top, True)


def query_rows(attn, q_a: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """An MQA layer's queries [T, H, D] from wq_a's output: q_norm, wq_b, the per-head norm (q_head_norm), RoPE."""
    q = _linear(attn.wq_b, _rms(q_a, attn.q_norm.variance_epsilon, attn.q_norm.weight))
    q = q.view(q_a.shape[0], attn.n_local_heads, attn.head_dim)
    if attn.q_head_norm:
        q = _rms(q, attn.eps)
    return _rope(q, attn.freqs_cis, positions)


def key_rows(attn, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """An MQA layer's keys (= values) [T, D] from wkv's output: kv_norm, then RoPE at the token's position."""
    return _rope(_rms(kv, attn.kv_norm.variance_epsilon, attn.kv_norm.weight), attn.freqs_cis, positions)


def output_rows(attn, o: torch.Tensor, positions: torch.Tensor, dtype) -> torch.Tensor:
    """An MQA layer's attention output [T, H, D] to wo_b's input [T, G * o_lora_rank]: the conjugate rotation at the
    query position on the rope channels, then the grouped wo_a."""
    o = _rope(o, attn.freqs_cis, positions, inverse=True)
    G = attn.n_local_groups
    wo_a = attn.wo_a.weight.to(dtype).view(G, attn.o_lora_rank, -1)
    return torch.einsum("tgd,grd->tgr", o.reshape(o.shape[0], G, -1), wo_a).flatten(1)


def mqa_forward(self, x, positions, forward_batch, x_quant=None, defer_all_reduce=False):
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    if self.compress_ratio not in (0, 4, 128) or (self.compress_ratio and self.compressor is None) or (
            self.compress_ratio == 4 and self.indexer is None):
        raise NotImplementedError(f"sglang-hs DeepSeek-V4 on the CPU engine: layer {self.layer_id} has compress ratio "
                                  f"{self.compress_ratio}; only sliding-window (0), CSA (4) and HCA (128) layers are "
                                  "served")
    T, H, D = x.shape[0], self.n_local_heads, self.head_dim
    if T == 0:
        return x
    if self.fuse_wqa_wkv:
        q_a, kv = _linear(self.wqkv_a, x).split([self.q_lora_rank, self.head_dim], dim=-1)
    else:
        q_a, kv = _linear(self.wq_a, x), _linear(self.wkv, x)
    q = query_rows(self, q_a, positions)
    kv = key_rows(self, kv, positions)

    pool = get_token_to_kv_pool()
    pool.set_kv_buffer(self.attn_mqa, forward_batch.out_cache_loc, kv.unsqueeze(1), kv.unsqueeze(1))
    cache = pool.get_key_buffer(self.attn_mqa.layer_id)
    req_to_token = get_req_to_token_pool().req_to_token
    window = self.hs_window
    sources = None
    ratio = self.compress_ratio
    if self.compressor is not None:  # the compressor's per-token kv and gate, kept at the KV slots
        comp = self.compressor
        sources = _source_store(pool, ("compressor", self.attn_mqa.layer_id), self.attn_mqa.layer_id,
                                comp.wkv_gate.weight.shape[0], x)
        sources[forward_batch.out_cache_loc] = _linear(comp.wkv_gate, x).float()
    if self.indexer is not None:  # CSA: the indexer's own compressor sources, its queries and head weights
        idx = self.indexer
        isources = _source_store(pool, ("indexer", self.attn_mqa.layer_id), self.attn_mqa.layer_id,
                                 idx.compressor.wkv_gate.weight.shape[0], x)
        isources[forward_batch.out_cache_loc] = _linear(idx.compressor.wkv_gate, x).float()
        q_lora = _rms(q_a, self.q_norm.variance_epsilon, self.q_norm.weight)
        iq = _rope(_linear(idx.wq_b, q_lora).view(T, idx.n_heads, idx.head_dim), self.freqs_cis, positions).float()
        iw = _linear(idx.weights_proj, x).float() * idx.n_heads ** -0.5
    o = torch.zeros((T, H, D), dtype=x.dtype, device=x.device)  # rows past the requests' pad the batch (DP attention)
    sink = local_heads(self.attn_sink, self.attn_tp_rank, H)
    start = 0
    for req, prefix, n in ([] if forward_batch.forward_mode.is_idle() else requests_of(forward_batch)):
        length = prefix + n
        first = max(0, prefix - window + 1)  # no query of this step sees a key before it
        keys = cache[req_to_token[req, first:length].long()].view(length - first, D).to(x.dtype)
        mask = window_mask(prefix - first, n, length - first, window, x.device)
        if sources is not None:
            slots = req_to_token[req, :length].long()
            make = hca_entries if ratio == 128 else csa_entries
            entries = make(sources[slots], ratio, _hf_ape(comp), comp.norm, self.freqs_cis).to(x.dtype)
            q_pos = torch.arange(prefix, length, device=x.device).unsqueeze(1)
            closed = torch.arange(entries.shape[0], device=x.device).unsqueeze(0) < (q_pos + 1) // ratio
            if self.indexer is not None:  # HF DeepseekV4Indexer: each query keeps its index_topk best closed blocks
                ikeys = csa_entries(isources[slots], ratio, _hf_ape(idx.compressor), idx.compressor.norm,
                                    self.freqs_cis)
                closed = indexer_keep(iq[start:start + n], ikeys, iw[start:start + n], idx.softmax_scale, closed,
                                      idx.index_topk)
            keys, mask = torch.cat([keys, entries]), torch.cat([mask, closed], dim=1)
        o[start:start + n] = sink_attention(q[start:start + n], keys, mask, sink, self.softmax_scale)
        start += n
    # wo_b is row parallel over the attention-TP ranks: upstream's own projection, which all-reduces the ranks' partial
    # sums (the TP group, or the attention-TP group under DP attention)
    return self._project_wo_b(output_rows(self, o, positions, x.dtype), defer_all_reduce)


def hc_pre(self, x, hc_fn, hc_scale, hc_base, norm=None, forward_batch=None):
    """HF DeepseekV4HyperConnection.forward: (collapsed, post [T, hc], comb [T, hc, hc], norm not applied)."""
    hc, dtype = self.hc_mult, x.dtype
    T = x.shape[0]
    if T == 0:
        return (x.new_empty((0, x.shape[-1])), x.new_empty((0, hc), dtype=torch.float32),
                x.new_empty((0, hc, hc), dtype=torch.float32), False)
    flat = x.reshape(T, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.rms_norm_eps)
    mixes = F.linear(flat, hc_fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    base = hc_base.float()
    scale = hc_scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + base[:hc]) + self.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + self.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
    for _ in range(self.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(dtype)
    return collapsed, post, comb, False


def hc_post(self, x, residual, post, comb):
    """HF DeepseekV4DecoderLayer's mix: post * out + comb^T @ streams."""
    dtype = residual.dtype
    return (post.to(dtype).unsqueeze(-1) * x.unsqueeze(-2)
            + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)).to(dtype)


def hc_head(self, x, hc_fn, hc_scale, hc_base, *args, **kwargs):
    """HF DeepseekV4HyperHead.forward (the final collapse, before the model's norm)."""
    flat = x.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
    pre = torch.sigmoid(F.linear(flat, hc_fn.float()) * hc_scale.float() + hc_base.float()) + self.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def sliding_window(config) -> int:
    """The keys a query sees (itself included): HF's `sliding_window`, else SGLang's `window_size`."""
    return int(getattr(config, "sliding_window", None) or config.window_size)


def _unscaled_rope_on_cpu(wrapper):
    """get_rope_wrapper as MQALayer calls it: the CPU factory asserts a rope_scaling (DeepSeek YaRN), which a
    sliding layer's plain RoPE has none of; the generic table instead (unused here: the forward reads freqs_cis)."""
    def get_rope_wrapper(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                         dtype=None, partial_rotary_factor=1.0, device=None):
        if rope_scaling is None:
            from sglang.srt.layers.rotary_embedding.factory import get_rope

            return get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, dtype,
                            partial_rotary_factor)
        return wrapper(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                       partial_rotary_factor, device)

    return get_rope_wrapper


def _with_window(original):
    def __init__(self, config, *args, **kwargs):
        from sglang.srt.models import deepseek_v4

        wrapper = deepseek_v4.get_rope_wrapper
        deepseek_v4.get_rope_wrapper = _unscaled_rope_on_cpu(wrapper)
        try:
            original(self, config, *args, **kwargs)
        finally:
            deepseek_v4.get_rope_wrapper = wrapper
        self.hs_window = sliding_window(config)

    __init__.__wrapped__ = original
    return __init__


def apply() -> dict:
    import sglang
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.models import deepseek_v4

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-hs patch dsv4_torch_native targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    originals = {"kv_cache_configurator.is_deepseek_v4": kv_cache_configurator.is_deepseek_v4,
                 "MQALayer.__init__": deepseek_v4.MQALayer.__init__,
                 "MQALayer.forward": deepseek_v4.MQALayer.forward,
                 "DeepseekV4DecoderLayerBase.hc_pre": deepseek_v4.DeepseekV4DecoderLayerBase.hc_pre,
                 "DeepseekV4DecoderLayerBase.hc_post": deepseek_v4.DeepseekV4DecoderLayerBase.hc_post,
                 "DeepseekV4Model.hc_head": deepseek_v4.DeepseekV4Model.hc_head}
    kv_cache_configurator.is_deepseek_v4 = lambda hf_config: False  # the plain MHA pool, token pages
    deepseek_v4.MQALayer.__init__ = _with_window(deepseek_v4.MQALayer.__init__)
    deepseek_v4.MQALayer.forward = mqa_forward
    deepseek_v4.DeepseekV4DecoderLayerBase.hc_pre = hc_pre
    deepseek_v4.DeepseekV4DecoderLayerBase.hc_post = hc_post
    deepseek_v4.DeepseekV4Model.hc_head = hc_head
    return originals
