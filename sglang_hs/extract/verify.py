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
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

from sglang_hs.envs import DEFAULT_PART_BYTES

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
          temperature: float = 0.0, sampled_from: Optional[int] = None, chunks: Optional[Iterable] = None,
          part_bytes: Optional[int] = None) -> float:
    """Raise VerificationError naming the sample when the capture disagrees; returns the max difference.

    `last`: the record's T captured final states. `tokens`: the record's T tokens, then the token after
    its last row (the last one generated): T + 1. `server_logprobs[i]` (and `server_token_ids[i]`): the
    server's logprob of tokens[i] (and the token it says that is), None at 0: T + 1 too. Every row t is
    checked against the logprob of tokens[t + 1]. Tokens from index `sampled_from` on were sampled at
    `temperature` (0: greedy, all logprobs unscaled). `chunks`: `last` read in order as the reader's
    RecordChunks (a long record: each chunk's ring pages unmapped once the next is read; None: `last`
    sliced). The logits are computed `part_bytes` of them at a time (None: DEFAULT_PART_BYTES), never for every
    row at once."""
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
    target = torch.tensor(tokens[1:])[:, None]
    theirs = torch.tensor([float(x) for x in server_logprobs[1:]])
    sampled = temperature >= SAMPLING_EPS and sampled_from is not None and sampled_from <= T
    first_sampled_row = max(sampled_from - 1, 0) if sampled else T  # rows from here on predicted sampled tokens
    rows_per_block = max(1, (part_bytes or DEFAULT_PART_BYTES) // (4 * lm_head.shape[0]))  # float32 logits [n, V]
    worst, bad, first = 0.0, 0, None
    for start, rows in _row_blocks(last, chunks, rows_per_block):
        stop = start + rows.shape[0]
        ours, diff, tol = _block_diffs(rows, lm_head, target[start:stop], theirs[start:stop],
                                       first_sampled_row - start, temperature)
        worst = max(worst, float(diff.nan_to_num(nan=float("inf")).max()))
        wrong = (~(diff <= tol)).nonzero().flatten().tolist()  # a NaN state disagrees too
        bad += len(wrong)
        if wrong and first is None:
            t = wrong[0]
            first = (start + t, float(ours[t]), float(theirs[start + t]), float(tol[t]))
    if first is not None:
        t, our, their, tol_t = first
        raise VerificationError(f"sample {index}: row {t} (the state before token {t + 1}"
                                f"{', the last row' if t == T - 1 else ''}): the captured final state gives "
                                f"logprob {our:.4f}, the server {their:.4f} (tolerance {tol_t:.3f}); "
                                f"{bad} of {T} rows disagree")
    return worst


def _row_blocks(last: torch.Tensor, chunks: Optional[Iterable], rows_per_block: int) -> Iterator[Tuple[int, torch.Tensor]]:
    """(first row, final states) of at most `rows_per_block` rows at a time, in order: of `chunks` (RecordChunks,
    each read before the next is asked for), or slices of `last`."""
    parts = ((c.start, c.last_hidden_state) for c in chunks) if chunks is not None else [(0, last)]
    for at, rows in parts:
        for i in range(0, rows.shape[0], rows_per_block):
            yield at + i, rows[i:i + rows_per_block]


def _block_diffs(rows: torch.Tensor, lm_head: torch.Tensor, target: torch.Tensor, theirs: torch.Tensor,
                 first_sampled: int, temperature: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(our logprob, |ours - theirs|, tolerance) of each of a block's rows; rows from `first_sampled` on (an
    index into the block, may be outside it) predicted sampled tokens: they also pass against the
    temperature-scaled logprob, within the tolerance divided by the temperature where it is below 1."""
    logits = rows.float() @ lm_head.T
    ours = torch.log_softmax(logits, dim=-1).gather(1, target).squeeze(1)
    diff = (ours - theirs).abs()
    tol = torch.full((rows.shape[0],), ATOL)
    r = slice(max(first_sampled, 0), rows.shape[0])
    if first_sampled < rows.shape[0]:
        scaled = torch.log_softmax(logits[r] / temperature, dim=-1).gather(1, target[r]).squeeze(1)
        diff[r] = torch.minimum(diff[r], (scaled - theirs[r]).abs())
        tol[r] = ATOL / min(temperature, 1.0)
    return ours, diff, tol


def check_stored(index: int, path: str, aux: torch.Tensor, last: Optional[torch.Tensor],
                 save_dtype: Optional[str] = None, chunks: Optional[Iterable] = None) -> None:
    """The --format safetensors file of a verified sample, read back, holds the captured rows: exactly
    (cast to bf16 with --save-dtype bf16), or with FP8 dequantized the way speculators' FP8Transfer does
    (bf16) and within e4m3's rounding bound of every element (sglang_hs/extract/fp8.py). `chunks`: the
    captured rows in order as the sinks' Chunks (a long record's, HiddenStateReader.chunks: each read before
    the next is asked for); the file is then read back the same rows at a time (safe_open's get_slice), so
    neither the file nor the rows are ever held whole. None: aux and last are one chunk."""
    from safetensors import safe_open

    from sglang_hs.extract import fp8
    from sglang_hs.extract.sinks.base import Chunk, SinkError, in_order

    T, K, H = aux.shape
    want_shape = (T, K + (last is not None), H)
    fp8_stored = False
    bad, first = 0, None
    with safe_open(path, "pt") as f:
        stored = f.get_slice("hidden_states")
        if tuple(stored.get_shape()) != want_shape:
            raise VerificationError(f"sample {index}: {path} holds hidden_states {tuple(stored.get_shape())}, "
                                    f"captured {want_shape}")
        scales = f.get_slice(fp8.SCALES_KEY) if fp8.SCALES_KEY in f.keys() else None
        fp8_stored = scales is not None
        try:  # every row once, in order (a chunk is read before the next is asked for)
            for c in in_order(chunks if chunks is not None else [Chunk(0, T, aux, last)], T):
                scale = None if scales is None else scales[c.start:c.stop]
                wrong = _stored_rows_wrong(stored[c.start:c.stop], scale, c.aux, c.last, save_dtype)
                bad += int(wrong.sum())
                if wrong.any() and first is None:
                    row, layer = wrong.nonzero()[0].tolist()
                    first = (c.start + row, layer)
        except SinkError as e:
            raise VerificationError(f"sample {index}: {e}") from None
    if first is not None:
        what = "dequantized, are off FP8's rounding bound of" if fp8_stored else "differ from"
        raise VerificationError(f"sample {index}: {path}: {bad} stored rows {what} the captured ones "
                                f"(first: row {first[0]}, layer {first[1]} of {want_shape[1]})")


def _stored_rows_wrong(got: torch.Tensor, scale: Optional[torch.Tensor], aux: torch.Tensor,
                       last: Optional[torch.Tensor], save_dtype: Optional[str]) -> torch.Tensor:
    """[n, L] bool: which (row, layer) of the stored rows `got` (FP8 with `scale`) are not the captured ones."""
    from sglang_hs.extract import fp8

    want = aux if last is None else torch.cat([aux, last[:, None]], dim=1)
    if save_dtype == "bf16":
        want = want.to(torch.bfloat16)
    if scale is None:  # the bytes (a NaN row stored as captured is the same row)
        if got.dtype == want.dtype and got.is_floating_point():
            as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
            return (got.contiguous().view(as_int) != want.contiguous().view(as_int)).any(-1)
        return (got != want).any(-1)
    diff = (fp8.dequantize(got, scale).float() - want.float()).abs()
    return (~(diff <= fp8.error_bound(want, scale))).any(-1)  # a byte that dequantizes to NaN is off too
