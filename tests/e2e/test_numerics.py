"""Teacher-forced prompt logprobs of the CPU server against HF transformers on the same checkpoint.

This proves the CPU-mode MLA fix (sglang_hs/server/patches/mla_torch_native.py): without it the first chunk
goes down the broken MHA path (a shape error for these head sizes; wrong numbers for others).

Tolerance: SGLang computes in bf16 (8-bit mantissa, relative rounding 2^-9 per op) through 8 layers
with MLA and MoE; the reference is HF in float32 on the same bf16 weights. Measured on this prompt
(53 tokens): median |diff| ~0.002 nats, 90th percentile ~0.006, and two tokens at 0.07 and 0.10, where
bf16 rounding flips a near-tied MoE routing choice. So we judge by median (< 0.01) and 90th
percentile (< 0.03), and bound the worst token loosely (< 0.3). Dropping just the last decoder layer
from the reference moves the median far beyond that (checked below), so the test separates "right
model, bf16 noise" from "wrong computation". Greedy tokens are compared only where the reference's
top-1 margin exceeds 0.1 nats: random weights give near-ties elsewhere.
"""
import functools

import pytest
import torch

from conftest import CHUNK
from sglang_hs.tools import tiny_model

pytestmark = pytest.mark.e2e
TEXT = (
    "Speculative decoding makes generation faster without changing its result. A small draft model "
    "proposes several tokens ahead, the large target model checks all of them in one forward pass, and "
    "every proposal the target agrees with is accepted for free."
)
MEDIAN, P90, WORST, MARGIN = 0.01, 0.03, 0.3, 0.1


@functools.lru_cache(maxsize=1)
def _hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model.ensure()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _ref_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_match_hf(capture_server):
    check_prompt_logprobs(capture_server)


def check_prompt_logprobs(server):
    model, tok = _hf()
    ids = [tok.bos_token_id] + tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 * CHUNK + 1  # spans three prefill chunks: prefix attention is exercised too
    out = server.generate(
        input_ids=ids, rid="e2e-numerics", return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
    )
    meta = out["meta_info"]
    got = torch.tensor([x[0] for x in meta["input_token_logprobs"][1:]])
    assert [x[1] for x in meta["input_token_logprobs"]] == ids
    ref = _ref_logprobs(model, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    diff = (got - want).abs()
    median, p90 = diff.median().item(), diff.quantile(0.9).item()
    print(f"prompt logprobs vs HF fp32 over {len(diff)} tokens: median {median:.4f} p90 {p90:.4f} "
          f"max {diff.max():.4f}")
    assert median < MEDIAN and p90 < P90 and diff.max() < WORST

    # Greedy agreement where the reference is decisive.
    top2 = ref[:-1].topk(2, -1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > MARGIN
    sg_top1 = torch.tensor([t[0][1] for t in meta["input_top_logprobs"][1:]])
    assert clear.sum() >= 5
    assert torch.equal(sg_top1[clear], top2.indices[:, 0][clear])

    # Control: the same comparison against a reference missing its last layer fails clearly.
    layers = model.model.layers
    model.model.layers = layers[:-1]
    try:
        broken = _ref_logprobs(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    finally:
        model.model.layers = layers
    assert (got - broken).abs().median() > 5 * MEDIAN
