"""`--verify FRACTION`: check captured final states against the server's own logprobs of the same request.

For a verified sample the request also asks for `return_logprob` from position 0. Row t of a record is
the final hidden state the server computed the token after it from, so for every row, the last one
included, the server's logprob of the next token must equal the one computed here from the captured row
with the model's `lm_head` (float32): what a drafter trained on these rows will be taught. The last
row's next token is the last generated one, which has no row of its own; its logprob is the first (or,
with --regenerate, the last) of the reply's `output_token_logprobs`. Logprobs are compared rather than
argmaxes, so near-ties in the top-1 cannot fail a correct capture; the tolerance covers the server's
bf16 lm_head. A wrong layer, a row from another token or a shifted position is off by whole nats.

A sampled token's logprob (--regenerate --temperature T > 0) is reported by SGLang 0.5.23 from the
temperature-scaled distribution, log softmax(logits / T), before top-p/top-k filtering (sampler.py,
the standard path), or from the unscaled one when the server sets SGLANG_RETURN_ORIGINAL_LOGPROB: such a
row passes when it matches either, within the tolerance divided by T where T < 1.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

import torch

ATOL = 0.08  # nats: the server's bf16 logits vs float32 here, measured at most ~0.02 on the tiny model
SAMPLING_EPS = 1e-6  # SGLang samples greedily below this temperature (sampling_params._SAMPLING_EPS)


class VerificationError(RuntimeError):
    pass


def load_lm_head(model_path: str) -> torch.Tensor:
    """The lm_head weight [V, H] from a local safetensors checkpoint (tied embeddings when there is none)."""
    from safetensors import safe_open

    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        single = os.path.join(model_path, "model.safetensors")
        if not os.path.exists(single):
            raise VerificationError(f"--verify: no safetensors checkpoint in {model_path} to read lm_head from")
        with safe_open(single, "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in weight_map:
            with safe_open(os.path.join(model_path, weight_map[name]), "pt") as f:
                return f.get_tensor(name).float()
    raise VerificationError(f"--verify: neither lm_head.weight nor model.embed_tokens.weight in {model_path}")


def check(index: int, tokens: List[int], last: torch.Tensor, lm_head: torch.Tensor,
          server_logprobs: List[Optional[float]], server_token_ids: Optional[List[int]] = None,
          temperature: float = 0.0, sampled_from: Optional[int] = None) -> float:
    """Raise VerificationError naming the sample when the capture disagrees; returns the max difference.

    `last`: the record's T captured final states. `tokens`: the record's T tokens, then the token after
    its last row (the last one generated): T + 1. `server_logprobs[i]` (and `server_token_ids[i]`): the
    server's logprob of tokens[i] (and the token it says that is), None at 0: T + 1 too. Every row t is
    checked against the logprob of tokens[t + 1]. Tokens from index `sampled_from` on were sampled at
    `temperature` (0: greedy, all logprobs unscaled)."""
    T = last.shape[0]
    if len(tokens) != T + 1:
        raise VerificationError(f"sample {index}: {T} captured rows for {len(tokens) - 1} tokens forwarded")
    if len(server_logprobs) != T + 1:
        raise VerificationError(f"sample {index}: the server returned {len(server_logprobs)} logprobs for "
                                f"{T + 1} tokens")
    if server_token_ids is not None and list(server_token_ids[1:]) != list(tokens[1:]):
        raise VerificationError(f"sample {index}: the server's logprobs are of other tokens than the record's")
    if T == 0:
        return 0.0
    logits = last.float() @ lm_head.T
    target = torch.tensor(tokens[1:])[:, None]
    ours = torch.log_softmax(logits, dim=-1).gather(1, target).squeeze(1)
    theirs = torch.tensor([float(x) for x in server_logprobs[1:]])
    diff = (ours - theirs).abs()
    tol = torch.full((T,), ATOL)
    sampled = temperature >= SAMPLING_EPS and sampled_from is not None and sampled_from <= T
    if sampled:  # rows sampled_from - 1 .. T - 1 predicted sampled tokens
        r = slice(max(sampled_from - 1, 0), T)
        scaled = torch.log_softmax(logits[r] / temperature, dim=-1).gather(1, target[r]).squeeze(1)
        diff[r] = torch.minimum(diff[r], (scaled - theirs[r]).abs())
        tol[r] = ATOL / min(temperature, 1.0)
    bad = (diff > tol).nonzero().flatten().tolist()
    if bad:
        t = bad[0]
        raise VerificationError(f"sample {index}: row {t} (the state before token {t + 1}"
                                f"{', the last row' if t == T - 1 else ''}): the captured final state gives "
                                f"logprob {ours[t]:.4f}, the server {theirs[t]:.4f} (tolerance {float(tol[t]):.3f}); "
                                f"{len(bad)} of {T} rows disagree")
    return float(diff.max())


def check_stored(index: int, path: str, aux: torch.Tensor, last: Optional[torch.Tensor],
                 save_dtype: Optional[str] = None) -> None:
    """The --format safetensors file of a verified sample, read back, holds the captured rows: exactly
    (cast to bf16 with --save-dtype bf16), or with FP8 dequantized the way speculators' FP8Transfer does
    (bf16) and within e4m3's rounding bound of every element (sglang_hs/extract/fp8.py)."""
    from safetensors.torch import load_file

    from sglang_hs.extract import fp8

    t = load_file(path)
    want = aux if last is None else torch.cat([aux, last[:, None]], dim=1)
    if save_dtype == "bf16":
        want = want.to(torch.bfloat16)
    got = t["hidden_states"]
    if got.shape != want.shape:
        raise VerificationError(f"sample {index}: {path} holds hidden_states {tuple(got.shape)}, captured "
                                f"{tuple(want.shape)}")
    if fp8.SCALES_KEY not in t:
        bad = (got != want).any(-1)
        what = "differ from"
    else:
        scale = t[fp8.SCALES_KEY]
        diff = (fp8.dequantize(got, scale).float() - want.float()).abs()
        bad = (diff > fp8.error_bound(want, scale)).any(-1)
        what = "dequantized, are off FP8's rounding bound of"
    if bad.any():
        row, layer = bad.nonzero()[0].tolist()
        raise VerificationError(f"sample {index}: {path}: {int(bad.sum())} stored rows {what} the captured ones "
                                f"(first: row {row}, layer {layer} of {want.shape[1]})")
