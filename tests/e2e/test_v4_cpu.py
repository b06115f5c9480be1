"""DeepSeek-V4 on the CPU engine (issue 45, slice 1): a tiny V4 whose layers are all sliding-window (compress ratio
0: no compressor, no indexer), served float32 by SGLang's own DeepseekV4ForCausalLM through the CPU-engine patches
(sglang_hs/server/patches/dsv4_cpu_server_args.py, dsv4_torch_native.py, dsv4_cpu_moe.py), every captured row judged
against HF transformers' DeepseekV4ForCausalLM float32 (eager attention: the sinks) on the same weights.

The checkpoint is tiny_model's "v4-swa": 4 layers, hc_mult 4, a window of 8 keys, random attention sinks and
hyper-connection biases, the first layer hash-routed, sqrtsoftplus routing over one expert group. One server per
capture convention (module scope): --hs-hc-streams mean (a row per layer id: the streams' mean) and full (hc_mult
rows per id), both with layers 1,2,3 and both final states, chunked prefill of 5 tokens (each chunk's window reaches
into earlier chunks' keys) and the radix cache on. --skip-tokenizer-init: SGLang's V4 chat encoder needs DeepSeek-V4's
special tokens, which the embedded tokenizer lacks; requests send token ids.

Judged per row as every float32 family (tests/e2e/row_judge.py): within TOL of its own HF row and closer to it than
to the neighbouring tokens' and layers' rows. Measured: worst row 6.9e-07 (mean and full). Planted bugs (scratch copies
of the patches, the long-prompt test of the mean server): the window one key wider -> rows 8 on (the first past the
window) off by up to 0.7; the attention sink dropped -> every row off, up to 0.92; the routed experts' SwiGLU clamp
dropped (dsv4_cpu_moe) -> every row off, up to 0.14. Each fails the judge.
"""
import concurrent.futures as cf

import pytest
import torch

import row_judge
from conftest import States, _serve
from sglang_hs import HiddenStateReader
from sglang_hs.tools import tiny_model

pytestmark = pytest.mark.e2e
LAYERS = [1, 2, 3]
CHUNK = 5  # below the window (8): a chunk's queries see keys of the chunks before it
GREEDY = {"temperature": 0}
VARIANT = "v4-swa"


@pytest.fixture(scope="module")
def hf():
    """HF float32 on the checkpoint: hf(ids) -> States of output_hidden_states ([T, hc_mult, H] for i < n, the
    post-norm [T, H] at n) with the final norm's input as .pre_norm."""
    import transformers

    ckpt = tiny_model.ensure(VARIANT)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # every tensor under a name HF reads (as SGLang does)
    model.eval()

    def states(ids):
        taken = []
        handle = model.model.norm.register_forward_hook(lambda mod, args, out: taken.append(args[0][0].detach()))
        try:
            with torch.no_grad():
                out = States(h[0] for h in model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states)
        finally:
            handle.remove()
        out.pre_norm = taken[0]
        return out

    states.model, states.config = model, model.config
    return states


@pytest.fixture(scope="module", params=["mean", "full"])
def v4(request, tmp_path_factory, hf):
    """(server, reader, streams): the float32 V4 server of one convention."""
    gen = _serve(tmp_path_factory.mktemp(f"hs-v4-{request.param}") / "dump",
                 ["--model-path", tiny_model.ensure(VARIANT), "--device", "cpu", "--dtype", "float32",
                  "--skip-tokenizer-init", "--hs-layers", ",".join(map(str, LAYERS)), "--hs-last", "both",
                  "--hs-hc-streams", request.param, "--chunked-prefill-size", str(CHUNK)])
    server = next(gen)
    reader = HiddenStateReader(str(server.dump))
    try:
        yield server, reader, request.param
    finally:
        reader.close()
        next(gen, None)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, tiny_model.variant_config(VARIANT)["vocab_size"], (n,), generator=g).tolist()


def judge(rec, hf, want_ids, streams):
    """Every row against HF float32 (row_judge.assert_exact): the mean convention's rows as they are, full streams
    one stream at a time (stream s of each id: rows k * hc_mult + s against HF's stream s). Returns the worst."""
    hs = hf(want_ids)
    n, hc = hf.config.num_hidden_layers, hf.config.hc_mult
    assert rec.input_ids.tolist() == list(want_ids), rec.rid
    if streams == "mean":
        view = States([h.mean(dim=-2) if h.dim() == 3 else h for h in hs])
        view.pre_norm = hs.pre_norm
        return row_judge.assert_exact(rec, lambda ids: view, want_ids, LAYERS, n, hf.config.hidden_size)
    T, K = len(want_ids), len(LAYERS)
    assert tuple(rec.aux_hidden_states.shape) == (T, K * hc, hf.config.hidden_size)
    worst = 0.0
    for s in range(hc):
        view = States([h[:, s] if h.dim() == 3 else h for h in hs])
        view.pre_norm = hs.pre_norm
        one = _Stream(rec, s, hc, K)
        worst = max(worst, row_judge.assert_exact(one, lambda ids: view, want_ids, LAYERS, n, hf.config.hidden_size))
    return worst


class _Stream:
    """A full-streams record seen as one stream's [T, K, H] rows (the record's finals unchanged)."""

    def __init__(self, rec, s, hc, K):
        self.rid, self.input_ids = f"{rec.rid}[stream {s}]", rec.input_ids
        self.aux_hidden_states = rec.aux_hidden_states[:, [k * hc + s for k in range(K)]]
        self.last_hidden_state, self.last_pre_norm = rec.last_hidden_state, rec.last_pre_norm


def test_the_window_the_sinks_and_the_clamp_matter(hf):
    """The checkpoint is one a wrong window, a dropped sink or a missing SwiGLU clamp shows in: every layer
    sliding-window, the window below the judged prompts' lengths, and HF's own rows move when its window is widened
    past them, its sinks zeroed or its experts' swiglu_limit lifted."""
    cfg = hf.config
    assert set(cfg.layer_types) == {"sliding_attention"} and cfg.sliding_window == 8 and cfg.hc_mult == 4
    ids = _prompt(40, 1)
    base = hf(ids)
    wide = cfg.sliding_window
    sinks = [layer.self_attn.sinks.detach().clone() for layer in hf.model.model.layers]
    try:
        cfg.sliding_window = 4096
        widened = hf(ids)
        cfg.sliding_window = wide
        for layer in hf.model.model.layers:
            layer.self_attn.sinks.data.zero_()
        sinkless = hf(ids)
    finally:
        cfg.sliding_window = wide
        for layer, s in zip(hf.model.model.layers, sinks):
            layer.self_attn.sinks.data.copy_(s)
    clamps = [m for m in hf.model.modules() if hasattr(m, "limit")]
    assert len(clamps) == 2 * cfg.num_hidden_layers and cfg.swiglu_limit == 0.15  # shared and routed experts
    try:
        for m in clamps:
            m.limit = 1e9
        unclamped = hf(ids)
    finally:
        for m in clamps:
            m.limit = cfg.swiglu_limit
    n = cfg.num_hidden_layers
    assert row_judge.rel(unclamped[n], base[n]).min() > 1e-3
    assert row_judge.rel(widened[n][wide:], base[n][wide:]).min() > 1e-3  # every row past the window
    assert torch.equal(widened[n][:wide], base[n][:wide]) or row_judge.rel(widened[n][:wide], base[n][:wide]).max() < 1e-6
    assert row_judge.rel(sinkless[n], base[n]).min() > 1e-3


def test_prompt_and_decode_rows_across_the_window(v4, hf):
    """A 50-token prompt (ten 5-token chunks, six windows) and 7 greedy tokens: every prompt and decode row of every
    layer id and both final states; the generated tokens are HF's greedy ones."""
    server, reader, streams = v4
    ids = _prompt(50, 3)
    out = server.generate(input_ids=ids, rid=f"v4-{streams}-long", sampling_params={"max_new_tokens": 7, **GREEDY})
    assert out["meta_info"]["cached_tokens"] == 0 and len(out["output_ids"]) == 7
    full = ids + out["output_ids"]
    worst = judge(reader.take(f"v4-{streams}-long", timeout=60), hf, full[:-1], streams)
    print(f"v4 {streams}: {len(full) - 1} rows, worst {worst:.2e}")
    with torch.no_grad():
        logits = hf.model(torch.tensor([full[:-1]])).logits[0]
    assert logits[len(ids) - 1:].argmax(-1).tolist() == out["output_ids"]


def test_radix_hits_and_concurrent_requests(v4, hf):
    """Rows the server did not forward come from the store, and keys a hit's first new token attends over come from
    the KV pool: the same prompt again (all but its last token cached) and a prompt sharing a 23-token prefix; then
    three requests of different lengths at once (prefill and decode steps shared)."""
    server, reader, streams = v4
    a = _prompt(37, 5)
    b = a[:23] + _prompt(14, 6)
    sp = {"max_new_tokens": 4, **GREEDY}
    jobs = [(f"v4-{streams}-a", a), (f"v4-{streams}-b", b), (f"v4-{streams}-a-again", a)]
    outs = {rid: (ids, server.generate(input_ids=ids, rid=rid, sampling_params=sp)) for rid, ids in jobs}
    assert outs[f"v4-{streams}-b"][1]["meta_info"]["cached_tokens"] >= 20
    assert outs[f"v4-{streams}-a-again"][1]["meta_info"]["cached_tokens"] >= len(a) - 1
    together = [(f"v4-{streams}-c{i}", _prompt(n, 10 + i)) for i, n in enumerate((31, 9, 44))]
    with cf.ThreadPoolExecutor(3) as pool:
        for (rid, ids), out in zip(together, pool.map(lambda j: server.generate(
                input_ids=j[1], rid=j[0], sampling_params={"max_new_tokens": 5, **GREEDY}), together)):
            outs[rid] = (ids, out)
    worst = 0.0
    for rid, (ids, out) in outs.items():
        worst = max(worst, judge(reader.take(rid, timeout=60), hf, (ids + out["output_ids"])[:-1], streams))
    print(f"v4 {streams}: {len(outs)} records, worst {worst:.2e}")
