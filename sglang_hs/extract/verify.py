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
    verdict = LogprobCheck(index, tokens, last.shape[0], lm_head, server_logprobs, server_token_ids, temperature,
                           sampled_from, part_bytes)
    for at, rows in (((c.start, c.last_hidden_state) for c in chunks) if chunks is not None else [(0, last)]):
        verdict.feed(at, rows)
    return verdict.result()


class LogprobCheck:
    """check()'s verdict built from the final states a block at a time, in row order: feed(first row, rows) for
    each, then result(). What a streamed record needs (HiddenStateRecord.streamed: its rows come once, as the sink
    writes them, so the check is fed from that same pass, SampleWriter._write). The sample's sizes are checked
    here, before any row."""

    def __init__(self, index: int, tokens: List[int], T: int, lm_head: torch.Tensor,
                 server_logprobs: List[Optional[float]], server_token_ids: Optional[List[int]] = None,
                 temperature: float = 0.0, sampled_from: Optional[int] = None,
                 part_bytes: Optional[int] = None) -> None:
        if len(tokens) != T + 1:
            raise VerificationError(f"sample {index}: {T} captured rows for {len(tokens) - 1} tokens forwarded")
        if len(server_logprobs) != T + 1:
            raise VerificationError(f"sample {index}: the server returned {len(server_logprobs)} logprobs for "
                                    f"{T + 1} tokens")
        if server_token_ids is not None and list(server_token_ids[1:]) != list(tokens[1:]):
            raise VerificationError(f"sample {index}: the server's logprobs are of other tokens than the record's")
        self.index, self.T, self.lm_head, self.temperature = index, T, lm_head, temperature
        self.target = torch.tensor(tokens[1:])[:, None]
        self.theirs = torch.tensor([float(x) for x in server_logprobs[1:]])
        sampled = temperature >= SAMPLING_EPS and sampled_from is not None and sampled_from <= T
        self.first_sampled_row = max(sampled_from - 1, 0) if sampled else T  # rows from here predicted sampled tokens
        # float32 logits [n, V]
        self.rows_per_block = max(1, (part_bytes or DEFAULT_PART_BYTES) // (4 * lm_head.shape[0]))
        self.worst, self.bad, self.first, self.seen = 0.0, 0, None, 0

    def feed(self, at: int, rows: torch.Tensor) -> None:
        """The final states of rows [at, at + len(rows)), the next ones in order."""
        if at != self.seen:
            raise VerificationError(f"sample {self.index}: final states of row {at} after row {self.seen}")
        for i in range(0, rows.shape[0], self.rows_per_block):
            block = rows[i:i + self.rows_per_block]
            start, stop = at + i, at + i + block.shape[0]
            ours, diff, tol = _block_diffs(block, self.lm_head, self.target[start:stop], self.theirs[start:stop],
                                           self.first_sampled_row - start, self.temperature)
            self.worst = max(self.worst, float(diff.nan_to_num(nan=float("inf")).max()))
            wrong = (~(diff <= tol)).nonzero().flatten().tolist()  # a NaN state disagrees too
            self.bad += len(wrong)
            if wrong and self.first is None:
                t = wrong[0]
                self.first = (start + t, float(ours[t]), float(self.theirs[start + t]), float(tol[t]))
        self.seen = at + rows.shape[0]

    def result(self) -> float:
        """The largest difference, or VerificationError naming the first bad row and the count."""
        T = self.T
        if self.seen != T:
            raise VerificationError(f"sample {self.index}: the final states of {self.seen} of its {T} rows were read")
        if self.first is not None:
            t, our, their, tol_t = self.first
            raise VerificationError(f"sample {self.index}: row {t} (the state before token {t + 1}"
                                    f"{', the last row' if t == T - 1 else ''}): the captured final state gives "
                                    f"logprob {our:.4f}, the server {their:.4f} (tolerance {tol_t:.3f}); "
                                    f"{self.bad} of {T} rows disagree")
        return self.worst


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


class StoredDigest:
    """--verify's read-back of a streamed record (HiddenStateRecord.streamed: its parts go back to the server as
    the one pass the sink writes from reads them, so there is no second pass to compare the file with). tee() hands
    the sink its Chunks and keeps, for each (row, layer), a CRC-32 of the bytes the file must hold there: the
    captured row cast to the stored dtype, or with FP8 the row quantized per token as the sink does (each checked
    then to be within e4m3's rounding bound of the captured one, as check_stored does) and its scales. check() then
    reads the file back a chunk's rows at a time (get_slice) and compares: the same verdict as check_stored, and
    the rows never held whole."""

    def __init__(self, save_dtype: Optional[str] = None) -> None:
        self.save_dtype = save_dtype
        self.kept: list = []  # (start, stop, CRCs of the stored states [n, L], of the scales [n] or None, bound bad)

    def tee(self, chunks: Iterable) -> Iterator:
        for c in chunks:
            self._keep(c)
            yield c

    def _keep(self, c) -> None:
        from sglang_hs.extract import fp8
        from sglang_hs.extract.sinks.base import chunk_states

        want = chunk_states(c.aux, c.last)
        scale_crcs, off_bound = None, torch.zeros(want.shape[:2], dtype=torch.bool)
        if self.save_dtype in ("fp8", "fp8-per-layer"):
            stored, scale = fp8.quantize(want, per_layer=self.save_dtype == "fp8-per-layer")
            diff = (fp8.dequantize(stored, scale).float() - want.float()).abs()
            off_bound = (~(diff <= fp8.error_bound(want, scale))).any(-1)
            scale_crcs = _crcs(scale.reshape(scale.shape[0], 1, -1))[:, 0]
        else:
            stored = want.to(torch.bfloat16) if self.save_dtype == "bf16" else want
        self.kept.append((c.start, c.stop, _crcs(stored), scale_crcs, off_bound))

    def check(self, index: int, path: str, want_shape: Tuple[int, int, int]) -> None:
        """VerificationError naming the sample, the count and the first (row, layer) when the file's rows are not
        the ones kept (or the sink's FP8 rows were off their bound)."""
        from safetensors import safe_open

        from sglang_hs.extract import fp8

        bad, first = 0, None
        with safe_open(path, "pt") as f:
            stored = f.get_slice("hidden_states")
            if tuple(stored.get_shape()) != tuple(want_shape):
                raise VerificationError(f"sample {index}: {path} holds hidden_states {tuple(stored.get_shape())}, "
                                        f"captured {tuple(want_shape)}")
            scales = f.get_slice(fp8.SCALES_KEY) if fp8.SCALES_KEY in f.keys() else None
            if (scales is not None) != (self.save_dtype in ("fp8", "fp8-per-layer")):
                raise VerificationError(f"sample {index}: {path} {'holds' if scales is not None else 'lacks'} FP8 "
                                        f"scales, stored as {self.save_dtype or 'captured'}")
            done = 0
            for start, stop, crcs, scale_crcs, off_bound in self.kept:
                wrong = off_bound | (_crcs(stored[start:stop]) != crcs)
                if scale_crcs is not None:
                    got = scales[start:stop]
                    wrong |= (_crcs(got.reshape(got.shape[0], 1, -1))[:, 0] != scale_crcs)[:, None]
                bad += int(wrong.sum())
                if wrong.any() and first is None:
                    row, layer = wrong.nonzero()[0].tolist()
                    first = (start + row, layer)
                done = stop
        if done != want_shape[0]:
            raise VerificationError(f"sample {index}: {done} of its {want_shape[0]} rows went by the read-back")
        if first is not None:
            what = "dequantized, are off FP8's rounding bound of" if scales is not None else "differ from"
            raise VerificationError(f"sample {index}: {path}: {bad} stored rows {what} the captured ones "
                                    f"(first: row {first[0]}, layer {first[1]} of {want_shape[1]})")


def _crcs(x: torch.Tensor) -> torch.Tensor:
    """[n, L] int64: the CRC-32 of each x[i, l]'s bytes (x [n, L, ...])."""
    import zlib

    n, L = x.shape[:2]
    b = x.contiguous().view(torch.uint8).reshape(n, L, -1).numpy()
    return torch.tensor([[zlib.crc32(b[i, j]) for j in range(L)] for i in range(n)], dtype=torch.int64).reshape(n, L)
