"""Training files, one per sample, written to a temporary name and renamed when complete (after an
fsync), so a crash never leaves a file that looks done and `--resume` can trust what exists.

  specforge     SpecForge's offline layout: rows_{k}-{k+2000}/data_{i}.ckpt, a torch.save dict
                (torch's zip format, loadable with mmap=True) with input_ids [T] int64, loss_mask [T]
                int64, hidden_state [1, T, H] (final post-norm state: SpecForge applies lm_head to it)
                and aux_hidden_state [1, T, K*H] (the K layers side by side), in the model's dtype.
  safetensors   speculators' layout: hs_{i}.safetensors with hidden_states [T, L, H] (the K layers,
                then the final state when captured), token_ids [T] and loss_mask [T], int64.
"""
from __future__ import annotations

import glob
import os
from typing import Optional

import torch

GROUP = 2000  # SpecForge's --file-group-size
TMP_SUFFIX = ".tmp"


def _commit(tmp: str, final: str) -> int:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return os.path.getsize(final)


class Sink:
    name = ""
    needs_last = False

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def path(self, index: int) -> str:
        raise NotImplementedError

    def done(self, index: int) -> bool:
        return os.path.exists(self.path(index))

    def existing(self) -> int:
        raise NotImplementedError

    def remove_partial(self) -> int:
        """Delete the temporary files an interrupted run left; returns how many."""
        stale = glob.glob(os.path.join(self.out_dir, "**", f"*{TMP_SUFFIX}"), recursive=True)
        for p in stale:
            os.unlink(p)
        return len(stale)

    def write(self, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
              last: Optional[torch.Tensor]) -> int:
        """Write one sample (aux [T, K, H], last [T, H]); returns the bytes written."""
        final = self.path(index)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = final + f".{os.getpid()}{TMP_SUFFIX}"
        try:
            self._save(tmp, input_ids.long(), loss_mask.long(), aux, last)
            return _commit(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        raise NotImplementedError


class SpecForgeSink(Sink):
    name, needs_last = "specforge", True

    def path(self, index: int) -> str:
        k = index // GROUP * GROUP
        return os.path.join(self.out_dir, f"rows_{k}-{k + GROUP}", f"data_{index}.ckpt")

    def existing(self) -> int:
        return len(glob.glob(os.path.join(self.out_dir, "rows_*", "data_*.ckpt")))

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        T = input_ids.shape[0]
        torch.save({"input_ids": input_ids, "loss_mask": loss_mask,
                    "hidden_state": last.reshape(1, T, -1).contiguous(),
                    "aux_hidden_state": aux.reshape(1, T, -1).contiguous()}, tmp)


class SafetensorsSink(Sink):
    name = "safetensors"

    def path(self, index: int) -> str:
        return os.path.join(self.out_dir, f"hs_{index}.safetensors")

    def existing(self) -> int:
        return len(glob.glob(os.path.join(self.out_dir, "hs_*.safetensors")))

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        from safetensors.torch import save_file

        states = aux if last is None else torch.cat([aux, last[:, None]], dim=1)
        save_file({"hidden_states": states.contiguous(), "token_ids": input_ids.contiguous(),
                   "loss_mask": loss_mask.contiguous()}, tmp)


SINKS = {s.name: s for s in (SpecForgeSink, SafetensorsSink)}
