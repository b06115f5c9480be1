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

from sglang_hs.extract.sinks.base import Sink, SinkError, chunk_states, in_order, record_rows, write_at

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


def _check_read_back(path, input_ids, loss_mask, ends) -> None:
    """The chunked file read as SpecForge reads it (torch.load, mmap: nothing but what is compared is read): the
    token ids and loss mask in their own entries and the first and last rows where the chunks put them. The
    storages' entries are matched to the tensors by torch.save's numbering and their sizes, and input_ids and
    loss_mask have the same size: a torch that numbered them otherwise would swap them silently."""
    import torch

    got = torch.load(path, mmap=True, weights_only=True)
    ok = torch.equal(got["input_ids"], input_ids.long()) and torch.equal(got["loss_mask"], loss_mask.long())
    for row, (aux_row, last_row) in ends.items():
        ok = ok and torch.equal(got["aux_hidden_state"][0, row], aux_row) and \
            torch.equal(got["hidden_state"][0, row], last_row)
    if not ok:
        raise SinkError("torch.save laid the sample out otherwise (the file read back is not the sample written in "
                        "chunks): no file written in chunks")


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

    def writes_chunks(self, aux, last) -> bool:
        return last is not None and not self.crc32  # a zip entry's CRC-32 is written before its bytes

    def _save_chunks(self, tmp, input_ids, loss_mask, aux, last, chunks) -> None:
        """_save's file a chunk of rows at a time. torch.save under torch.serialization.skip_data() writes the
        whole zip (the pickle, every record, each storage's entry at its 64-byte aligned offset) but none of the
        storages' bytes; they then go in at the offsets Python's zipfile reads from the entries' headers:
        token ids and loss mask whole, the rows a chunk at a time. The same bytes torch.save writes (its entries
        without CRC-32, as _save's). The tensors it pickles are the record's own views when their dtype is the
        file's (nothing of them read), else placeholders over untouched anonymous memory."""
        import mmap
        import zipfile

        import torch
        from torch.serialization import skip_data

        T, H = aux.shape[0], aux.shape[2]
        dtype = self.out_dtype(aux.dtype)
        # as _save gets them: Sink.write casts aux and last apart (--save-dtype bf16 of float32 rows), which makes
        # them two storages: then not the shared layout
        # a streamed record's states (reader.StreamedRows: no tensor, the rows come through the chunks) are laid out
        # as its views would be: one storage of rows [T, R + 1, H]
        streamed = getattr(aux, "same_rows", None) is not None and aux.same_rows(last)
        shared = self.share_rows and aux.dtype == dtype and (streamed or record_rows(aux, last) is not None)

        def like(shape):
            n = max(1, int(torch.Size(shape).numel()) * dtype.itemsize)
            return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype)[:torch.Size(shape).numel()].view(shape)

        if shared:
            rows = like((T, aux.shape[1] + 1, H)) if streamed else record_rows(aux, last)
            a, l = rows[:, :-1], rows[:, -1]
        else:  # a view is pickled as it is only when it is its storage's whole (else its offset or its siblings
            # would be saved: with T = 1, aux and last of one record's rows are both contiguous, one storage)
            def whole(t):
                return isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_contiguous() and \
                    t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()

            a = aux if whole(aux) else like(aux.shape)
            l = last if whole(last) else like(last.shape)
        sample = specforge_sample(input_ids, loss_mask, a, l, contiguous=False)
        storages = []  # in the order torch.save numbers them (first seen while pickling the dict, in order)
        for t in sample.values():
            if all(t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for s in storages):
                storages.append(t)
        with _without_crc32(), skip_data():
            torch.save(sample, tmp)
        with zipfile.ZipFile(tmp) as z:
            entries = {i.filename.rsplit("/data/", 1)[1]: i for i in z.infolist() if "/data/" in i.filename}
        at = {}
        with open(tmp, "r+b") as f:
            for key, t in enumerate(storages):
                info = entries.get(str(key))
                want = t.untyped_storage().nbytes()
                if info is None or info.file_size != want or info.compress_type != zipfile.ZIP_STORED:
                    raise SinkError(f"torch.save laid the sample out otherwise (storage {key} of {want} bytes is "
                                    f"{info and info.file_size}): no file written in chunks")
                f.seek(info.header_offset)
                local = f.read(30)  # a zip local file header: its name and extra field lengths end it
                at[key] = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + \
                    int.from_bytes(local[28:30], "little")
            write_at(f, at[0], sample["input_ids"])
            write_at(f, at[1], sample["loss_mask"])
            K = aux.shape[1]
            ends = {}  # the first and the last row as written (aux flattened, final): the read-back check's
            for c in in_order(chunks, T):
                if shared:
                    write_at(f, at[2] + c.start * (K + 1) * H * dtype.itemsize, chunk_states(c.aux, c.last).to(dtype))
                else:  # hidden_state (the final state) then aux_hidden_state, each a storage of its own
                    write_at(f, at[2] + c.start * H * dtype.itemsize, c.last.to(dtype))
                    write_at(f, at[3] + c.start * K * H * dtype.itemsize, c.aux.to(dtype))
                for row, i in ((c.start, 0), (c.stop - 1, -1)):
                    if row in (0, T - 1):
                        ends[row] = (c.aux[i].reshape(-1).to(dtype).clone(), c.last[i].to(dtype).clone())
        _check_read_back(tmp, input_ids, loss_mask, ends)
