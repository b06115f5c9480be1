"""`--verify FRACTION`: check captured final states against the server's own logprobs of the same request.

For a verified sample the request also asks for `return_logprob` from position 0. The server's logprob
of each next prompt token must equal the one computed here from the captured final hidden state with
the model's `lm_head` (float32): what a drafter trained on these rows will be taught. Logprobs are
compared rather than argmaxes, so near-ties in the top-1 cannot fail a correct capture; the tolerance
covers the server's bf16 lm_head. A wrong layer, a row from another token or a shifted position is off
by whole nats.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

import torch

ATOL = 0.08  # nats: the server's bf16 logits vs float32 here, measured at most ~0.02 on the tiny model


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


def check(index: int, input_ids: List[int], last: torch.Tensor, lm_head: torch.Tensor,
          server_logprobs: List[Optional[float]]) -> float:
    """Raise VerificationError naming the sample when the capture disagrees; returns the max difference."""
    T = len(input_ids)
    if last.shape[0] != T:
        raise VerificationError(f"sample {index}: {last.shape[0]} captured rows for {T} tokens")
    if len(server_logprobs) < T:
        raise VerificationError(f"sample {index}: the server returned {len(server_logprobs)} logprobs for {T} tokens")
    if T < 2:
        return 0.0
    logp = torch.log_softmax(last[:-1].float() @ lm_head.T, dim=-1)
    ours = logp.gather(1, torch.tensor(input_ids[1:])[:, None]).squeeze(1)
    theirs = torch.tensor([float(x) for x in server_logprobs[1:T]])
    diff = (ours - theirs).abs()
    worst = int(diff.argmax())
    if diff[worst] > ATOL:
        raise VerificationError(f"sample {index}: at position {worst + 1} the captured final state gives logprob "
                                f"{ours[worst]:.4f}, the server {theirs[worst]:.4f} (tolerance {ATOL})")
    return float(diff.max())
