"""--format specforge: SpecForge's offline layout, rows_{k}-{k+2000}/data_{i}.ckpt, a torch.save dict (torch's
zip format, loadable with mmap=True) with input_ids [T] int64, loss_mask [T] int64, hidden_state [1, T, H]
(final post-norm state: SpecForge applies lm_head to it) and aux_hidden_state [1, T, K*H] (the K layers side
by side), bf16 by default (SpecForge 0.2.0's TargetHead reads bf16 only; it has no FP8 reader: this sink takes
no FP8).

Speed (benchmarks/bench_host_path.py): when aux and last are the two views of one record's rows [T, K+1, H]
(as HiddenStateReader hands them out, copied or zero-copy) and that storage holds nothing else,
hidden_state and aux_hidden_state are saved as views sharing the one storage (torch saves a shared storage
once: the file is no bigger; torch.load gives them back as non-contiguous views, which SpecForge's reader
slices as it does any tensor). The sink also skips torch.save's CRC-32 of every zip entry (torch.load does
not need it; `unzip -t` then reports CRC errors): torch's flag is set around the sink's own torch.save only
(torch keeps it per thread: other threads' saves keep their CRC).
"""
from __future__ import annotations

import contextlib
import glob
import os
from typing import TYPE_CHECKING, Optional

from sglang_hs.extract.sinks.base import Sink, record_rows

if TYPE_CHECKING:
    import torch

GROUP = 2000  # SpecForge's --file-group-size


@contextlib.contextmanager
def _without_crc32():
    """torch.save in this thread skips the CRC-32 of its zip entries meanwhile (torch's config is per thread:
    a ContextVar since torch 2.x's config module)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


def specforge_sample(input_ids: "torch.Tensor", loss_mask: "torch.Tensor", aux: "torch.Tensor",
                     last: "torch.Tensor", contiguous: bool = True, dtype: Optional["torch.dtype"] = None) -> dict:
    """One sample in SpecForge's offline layout, as its data_{i}.ckpt holds it (input_ids [T] and
    loss_mask [T] int64, hidden_state [1, T, H], aux_hidden_state [1, T, K*H]); also what
    sglang_hs.live yields, so files and live samples cannot drift apart. contiguous=False: the states
    stay views of their rows where a view can hold them (the sink's shared rows). `dtype`: cast the states
    to it (None: as they come)."""
    T = input_ids.shape[0]
    hidden, aux = last.reshape(1, T, -1), aux.reshape(1, T, -1)
    if dtype is not None:
        hidden, aux = hidden.to(dtype), aux.to(dtype)
    if contiguous:
        hidden, aux = hidden.contiguous(), aux.contiguous()
    return {"input_ids": input_ids.long(), "loss_mask": loss_mask.long(), "hidden_state": hidden,
            "aux_hidden_state": aux}


class SpecForgeSink(Sink):
    name, needs_last, wants_last = "specforge", True, True
    crc32 = False  # torch.save's CRC-32 of every entry (True: as torch.save does by default)
    share_rows = True  # a record's rows saved as they lie (module docstring); False: contiguous copies

    def path(self, index: int) -> str:
        k = index // GROUP * GROUP
        return os.path.join(self.out_dir, f"rows_{k}-{k + GROUP}", f"data_{index}.ckpt")

    def existing(self) -> int:
        return len(glob.glob(os.path.join(self.out_dir, "rows_*", "data_*.ckpt")))

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        import torch

        shared = self.share_rows and record_rows(aux, last) is not None  # views of the one storage: saved once
        sample = specforge_sample(input_ids, loss_mask, aux, last, contiguous=not shared)
        with contextlib.nullcontext() if self.crc32 else _without_crc32():
            torch.save(sample, tmp)
