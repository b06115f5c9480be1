"""What `--save-dtype fp8` costs against the bf16 rows the server captures, and what it saves.

Rows are computed with HF transformers (no server: the quantization is a function of the rows) on the
embedded tiny DeepSeek-V3 and on the held-out-style variants of sglang_hs.tools.tiny_model (v2, kimi-k2), at
the default EAGLE-3 layers [2, n//2, n-3] plus the final post-norm state, cast to bf16 as captured, over
tokenized conversations. Each row set is quantized as the safetensors sink does (sglang_hs/extract/fp8.py)
with one scale per token over all layers (`fp8`, speculators' scheme) and per token and layer
(`fp8-per-layer`), and dequantized as speculators' FP8Transfer does (bf16). Figures:
  rel_l2_*     ||deq - x|| / ||x|| per row, per layer: mean, median, 99th percentile, max
  top1         the fraction of tokens where argmax(lm_head . deq_final) == argmax(lm_head . bf16_final)
               (the drafter's training target), with the bf16 rows' own agreement with float32 rows beside it;
               also over the tokens whose bf16 top-1 logit leads the second by more than 0.1 (and their share)
  kl           mean KL(softmax(bf16 logits) || softmax(deq logits)), nats; top1_prob_median: the median
               top-1 probability (the tiny models' random weights give flat distributions over 1024 tokens,
               whose top-1 flips under small perturbations: a trained model's agreement will be higher)
A stress case adds a "massive activation" channel to the middle aux layer, M times the final state's
largest value (real large models carry such channels in the residual stream), so the shared scale grows
and the final state's values fall toward e4m3's subnormal range: the sweep shows where it starts to cost.
Sizes: one DeepSeek-V3-wide sample (H 7168, 3 aux layers + the final state) written by the sink in bf16
and fp8.

    python benchmarks/measure_fp8.py --out benchmarks/results   # measure_fp8.csv (+ .png with matplotlib)
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, write_csv  # noqa: E402
from sglang_hs.tools import tiny_model  # noqa: E402
from sglang_hs.server.capture_spec import default_layer_ids  # noqa: E402
from sglang_hs.extract import fp8  # noqa: E402

MODES = ("fp8", "fp8-per-layer")
MARGIN = 0.1  # logits: top-1 agreement is also given over the tokens whose reference top-1 leads by more
MODELS = (("v3", "embedded tiny DeepSeek-V3"), ("v2", "held-out-style tiny DeepSeek-V2"),
          ("kimi-k2", "held-out-style tiny Kimi-K2"))
WORDS = ("the a of to and in is it that was for on are with as be at by this have from or one had not but what "
         "all were when we there can an your which their said if do will each about how up out them then she many "
         "some so these would other into has more her two like him see time could no make than first").split()


def prompts(tok, n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
        msgs = [{"role": "user", "content": text(5, 40)}, {"role": "assistant", "content": text(20, 200)}]
        out.append(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids)
    return out


@torch.no_grad()
def capture(variant, n, seed):
    """(rows [N, L, H] bf16 as captured: aux layers then the final post-norm state, the same rows in
    float32, lm_head [V, H] float32, layer names)."""
    import transformers

    path = tiny_model.ensure(variant)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model.ensure())  # the variants share it
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=tiny_model.hf_config(path, variant),
                                                              dtype=torch.float32).eval()
    layers = default_layer_ids(model.config.num_hidden_layers)
    rows = []
    for ids in prompts(tok, n, seed):
        out = model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        final = hs[-1][0]
        # the last entry is the post-norm state: lm_head of it is the model's own logits
        assert torch.allclose(final @ model.lm_head.weight.T, out.logits[0].float(), atol=1e-3, rtol=1e-3)
        rows.append(torch.stack([hs[i][0] for i in layers] + [final], dim=1))
    x32 = torch.cat(rows)
    return x32.bfloat16(), x32, model.lm_head.weight.float(), [f"hf{i}" for i in layers] + ["final"]


def logits_figures(lm_head, ref, other):
    a, b = ref.float() @ lm_head.T, other.float() @ lm_head.T
    agree = a.argmax(-1) == b.argmax(-1)
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    top2 = a.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN  # the reference's top-1 leads by more than MARGIN
    return agree.float().mean().item(), kl.item(), agree[clear].float().mean().item(), clear.float().mean().item()


def top1_prob(lm_head, x):
    """Median probability of the top-1 token: how flat the distributions are (flat ones flip easily)."""
    return (x.float() @ lm_head.T).softmax(-1).amax(-1).median().item()


def row_figures(x, deq):
    rel = (deq.float() - x.float()).norm(dim=-1) / x.float().norm(dim=-1).clamp_min(1e-30)  # [N, L]
    q = torch.quantile(rel, torch.tensor([0.5, 0.99]), dim=0)
    return {"rel_l2_mean": rel.mean(0), "rel_l2_median": q[0], "rel_l2_p99": q[1], "rel_l2_max": rel.amax(0)}


def measure(label, variant, x, x32, lm_head, names, case="as captured"):
    rows = []
    base_top1, base_kl, _, _ = logits_figures(lm_head, x32[:, -1], x[:, -1])
    p1 = top1_prob(lm_head, x[:, -1])
    for mode in MODES:
        q, scale = fp8.quantize(x, per_layer=mode == "fp8-per-layer")
        deq = fp8.dequantize(q, scale)
        figs = row_figures(x, deq)
        top1, kl, top1_clear, clear = logits_figures(lm_head, x[:, -1], deq[:, -1])
        for j, name in enumerate(names):
            rows.append({"model": variant, "what": label, "case": case, "mode": mode, "layer": name,
                         "tokens": x.shape[0], "row_norm_median": round(x[:, j].float().norm(dim=-1).median().item(), 4),
                         **{k: round(v[j].item(), 5) for k, v in figs.items()},
                         **({"top1_vs_bf16": round(top1, 5), f"top1_vs_bf16_margin_gt_{MARGIN}": round(top1_clear, 5),
                             f"tokens_margin_gt_{MARGIN}": round(clear, 4), "kl_vs_bf16": f"{kl:.3g}",
                             "bf16_top1_vs_fp32": round(base_top1, 5), "bf16_kl_vs_fp32": f"{base_kl:.3g}",
                             "top1_prob_median": round(p1, 5)}
                            if name == "final" else {})})
    return rows


def sizes(tmp):
    from sglang_hs.extract.sinks import SafetensorsSink

    T, K, H = 512, 3, 7168
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(0, 129280, (T,), generator=g), torch.ones(T, dtype=torch.long)
    aux, last = torch.randn(T, K, H, generator=g).bfloat16(), torch.randn(T, H, generator=g).bfloat16()
    out = {}
    for d in (None, "fp8", "fp8-per-layer"):
        out[d or "bf16"] = SafetensorsSink(os.path.join(tmp, d or "bf16"), d).write(0, ids, mask, aux, last)
    return [{"model": "DeepSeek-V3 width", "what": f"one sample, T {T}, 3 aux layers + final, H {H}", "mode": k,
             "file_bytes": v, "bytes_per_token": round(v / T, 1), "ratio_to_bf16": round(v / out["bf16"], 4)}
            for k, v in out.items()]


def plot(path, rows):
    plt = _pyplot()
    if plt is None:
        return
    base = [r for r in rows if r.get("case") == "as captured"]
    models = list(dict.fromkeys(r["model"] for r in base))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4 * len(models) + 4.5, 3.8))
    for ax, m in zip(axes, models):
        for k, mode in enumerate(MODES):
            rs = [r for r in base if r["model"] == m and r["mode"] == mode]
            xs = [i + 0.38 * k for i in range(len(rs))]
            ax.bar(xs, [100 * float(r["rel_l2_mean"]) for r in rs], width=0.38, label=mode)
            ax.set_xticks([i + 0.19 for i in range(len(rs))], [r["layer"] for r in rs])
        ax.set_title(f"{m}, as captured", fontsize=9)
    axes[0].set_ylabel("mean relative L2 error per row, %")
    axes[0].legend(fontsize=8)
    ax = axes[-1]  # the stress sweep: error per layer against the outlier channel's size
    sweep = [r for r in rows if str(r.get("case", "")).startswith("outlier")]
    for mode, style in zip(MODES, ("-", "--")):
        for layer in ("hf2", "hf5", "final"):
            rs = [r for r in sweep if r["mode"] == mode and r["layer"] == layer]
            ax.plot([float(r["case"].split()[2][:-1]) for r in rs], [100 * float(r["rel_l2_mean"]) for r in rs],
                    style, marker="o", label=f"{mode} {layer}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("outlier channel in hf4, x the final state's max")
    ax.set_title("v3, a massive-activation channel added", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(plt, fig, path, "FP8 e4m3 (bf16 dequantized) vs the bf16 rows, per layer")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--samples", type=int, default=24, help="conversations per model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-only", action="store_true", help="only redraw the plot from --out's CSV")
    ns = p.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    if ns.plot_only:
        import csv

        with open(os.path.join(ns.out, "measure_fp8.csv")) as f:
            plot(os.path.join(ns.out, "measure_fp8.png"), list(csv.DictReader(f)))
        return
    torch.manual_seed(ns.seed)
    t0 = time.monotonic()
    rows = []
    for variant, label in MODELS:
        x, x32, lm_head, names = capture(variant, ns.samples, ns.seed)
        rows += measure(label, variant, x, x32, lm_head, names)
        if variant == "v3":  # the stress sweep: a massive-activation channel in the middle aux layer
            for ratio in (10, 100, 1000, 3000, 10000):
                xs = x32.clone()
                peak = xs[:, -1].abs().amax(-1)
                xs[:, 1, 7] = ratio * peak
                rows += measure(label, variant, xs.bfloat16(), xs, lm_head, names,
                                case=f"outlier channel {ratio}x the final state's max")
    with tempfile.TemporaryDirectory() as tmp:
        rows += sizes(tmp)
    for r in rows:
        r["machine"] = machine()
    path = os.path.join(ns.out, "measure_fp8.csv")
    write_csv(path, rows)
    plot(os.path.join(ns.out, "measure_fp8.png"), rows)
    for r in rows:
        if r.get("layer") == "final" or "file_bytes" in r:
            print({k: v for k, v in r.items() if k not in ("machine", "what")})
    print(f"{path} ({time.monotonic() - t0:.0f}s)")


if __name__ == "__main__":
    main()
