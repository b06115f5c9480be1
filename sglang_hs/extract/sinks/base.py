"""The sink interface: where a run's training samples go, one small surface whatever the format.

  write(sample)    one sample (a TrainingSample) into its file, written to a temporary name and renamed when
                   complete (after an fsync), so a crash never leaves a file that looks done; returns the bytes.
                   write(sample, chunks=...) writes a long record's rows a chunk at a time (each format's
                   _save_chunks: the header first, the rows at their offsets), the same file as _save's
  finalize()       what a completed run adds beside the sample files (speculators' dataset), or None
  resume_state()   what --output already holds of this format's files (a restarted run skips those samples)

A format is a subclass (its `name`, the final state its trainer reads, its `path` and `_save`) in a file of
its own, listed in sinks/__init__.py's SINKS. Torch is imported where a tensor is handled, not here: the
registry's names are the --format choices, and `--help` stays quick.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, List, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    import torch

TMP_SUFFIX = ".tmp"


class SinkError(RuntimeError):
    """A one-line error about the files in the output folder."""


class TrainingSample(NamedTuple):
    """One sample as a sink stores it: its tokens [T], loss mask [T], aux rows [T, K * rows_per_layer, H] and the
    final state [T, H] its trainer reads (None: the server captured none)."""
    index: int
    input_ids: "torch.Tensor"
    loss_mask: "torch.Tensor"
    aux: "torch.Tensor"
    last: Optional["torch.Tensor"]


class Chunk(NamedTuple):
    """Rows [start, stop) of a sample: its aux rows [n, R, H] and final state [n, H] (None: none captured)."""
    start: int
    stop: int
    aux: "torch.Tensor"
    last: Optional["torch.Tensor"]


def _side_by_side(aux: "torch.Tensor", last: Optional["torch.Tensor"]) -> Optional["torch.Tensor"]:
    """The rows [n, R+1, H] that aux [n, R, H] and last [n, H] are the two views rows[:, :R] and rows[:, R] of
    (what a record, or a chunk of one, holds), as a view; None when they are not."""
    if last is None or aux.dim() != 3 or aux.dtype != last.dtype or aux.device != last.device:
        return None
    n, R, H = aux.shape
    if n and aux.untyped_storage().data_ptr() == last.untyped_storage().data_ptr() and \
            aux.stride() == ((R + 1) * H, H, 1) and last.stride() == ((R + 1) * H, 1) and \
            last.shape == (n, H) and last.data_ptr() == aux.data_ptr() + R * H * aux.element_size():
        return aux.as_strided((n, R + 1, H), ((R + 1) * H, H, 1), aux.storage_offset())
    return None


def chunk_states(aux: "torch.Tensor", last: Optional["torch.Tensor"]) -> "torch.Tensor":
    """[n, R+1, H]: aux [n, R, H] and last [n, H] side by side (aux alone without last): a view when they are
    the two views of the same rows (_side_by_side, what a record's chunk holds), else a copy of the chunk."""
    import torch

    if last is None:
        return aux
    rows = _side_by_side(aux, last)
    return rows if rows is not None else torch.cat([aux, last[:, None]], dim=1)


def write_at(f, offset: int, x: "torch.Tensor") -> None:
    """x's bytes (contiguous, as they lie in memory) into open file `f` at `offset`."""
    import torch

    f.seek(offset)
    f.write(x.contiguous().view(torch.uint8).numpy())


def in_order(chunks: Iterable[Chunk], T: int):
    """The chunks, each checked to start where the one before stopped and to be inside [0, T); then that they
    covered every row (else SinkError: the file would not be whole)."""
    done = 0
    for c in chunks:
        if c.start != done or not c.start < c.stop <= T or c.aux.shape[0] != c.stop - c.start:
            raise SinkError(f"a chunk of rows [{c.start}, {c.stop}) ({c.aux.shape[0]} rows) after row {done} of {T}")
        yield c
        done = c.stop
    if done != T:
        raise SinkError(f"the sample's chunks end at row {done} of its {T}: the file is not whole")


@dataclass(frozen=True)
class ResumeState:
    """What the output folder holds of a sink's files when a run starts."""
    files: int  # complete sample files (a temporary file of an interrupted write is none)
    done: Callable[[int], bool]  # whether sample `index` has its file


def _commit(tmp: str, final: str) -> int:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return os.path.getsize(final)


class Sink:
    name = ""
    needs_last = False  # refuse a server without the final state
    wants_last = False  # start our own server with --hs-last
    final_state = "post-norm"  # which final state the trainer reads (--hs-last's value that captures it)

    save_dtypes: Tuple[Optional[str], ...] = (None, "bf16")

    def __init__(self, out_dir: str, save_dtype: Optional[str] = None, share_gid: Optional[int] = None) -> None:
        if save_dtype not in self.save_dtypes:
            raise SinkError(f"--format {self.name} cannot store --save-dtype {save_dtype}")
        self.out_dir = out_dir
        self.save_dtype = save_dtype
        self.share_gid = share_gid  # --output-group: files 0640 and folders 0750 of it (else 0600/0700)
        self.layer_ids: Optional[List[int]] = None  # recorded in the files where the format has room
        # aux rows per layer id: DeepSeek-V4 with --hs-hc-streams full captures hc_mult (the manifest's
        # rows_per_layer); aux [T, K * rows_per_layer, H] then holds stream s of the k-th id at row k*hc_mult+s
        self.rows_per_layer = 1

    def describe_capture(self, manifest: dict) -> None:
        """Take what the server's manifest says its records hold: the layer ids the files record, and the
        aux rows per layer id."""
        self.layer_ids = list(manifest["layer_ids"])
        self.rows_per_layer = int(manifest.get("rows_per_layer", 1))

    def aux_layers(self, aux: "torch.Tensor") -> int:
        """The layer ids `aux` [T, R, H] holds: R / rows_per_layer (SinkError when R does not fit this sink's
        layer ids and rows per layer)."""
        R, per = int(aux.shape[1]), int(self.rows_per_layer)
        K = R // per if per >= 1 and R % per == 0 else None
        if K is None or (self.layer_ids is not None and K != len(self.layer_ids)):
            want = f"{len(self.layer_ids)} layer ids x " if self.layer_ids is not None else "a multiple of "
            raise SinkError(f"aux holds {R} rows per token, expected {want}{per} rows per layer id")
        return K

    def finalize(self) -> Optional[dict]:
        """What a completed run adds beside the sample files; None when the format needs nothing."""
        return None

    def resume_state(self) -> ResumeState:
        return ResumeState(self.existing(), self.done)

    def final_of(self, record):
        """The final state of a reader's record that this format stores (None if the server captured none)."""
        return record.last_hidden_state if self.final_state == "post-norm" else record.last_pre_norm

    def sample_of(self, index: int, record, loss_mask: "torch.Tensor") -> TrainingSample:
        """The TrainingSample of a reader's record (its views, not copies) with this loss mask."""
        return TrainingSample(index, record.input_ids, loss_mask, record.aux_hidden_states, self.final_of(record))

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

    def write(self, sample, *fields, before_commit: Optional[Callable[[], None]] = None,
              chunks: Optional[Iterable[Chunk]] = None) -> int:
        """Write one sample: a TrainingSample, or its fields in order (index, input_ids, loss_mask, aux, last);
        returns the bytes written. `before_commit` is called once the bytes are in the temporary file, before it
        takes the sample's name: raising there leaves no file (a zero-copy record's ring bytes are checked to
        be still its own). `chunks`: the sample's rows in order as Chunks (HiddenStateReader.chunks of a long
        record): the file is written a chunk at a time, its bytes the same as without; aux and last are then
        read only for their shapes and dtypes (a format that cannot, writes the whole sample)."""
        import torch

        from sglang_hs.fsutil import create_private_file, make_private_dirs, set_private_mode

        index, input_ids, loss_mask, aux, last = sample if not fields else TrainingSample(sample, *fields)
        self.aux_layers(aux)  # rows that do not fit the layer ids: refused before any file is made

        final = self.path(index)
        make_private_dirs(os.path.dirname(final), self.share_gid)
        tmp = final + f".{os.getpid()}{TMP_SUFFIX}"
        chunked = chunks is not None and self.writes_chunks(aux, last)
        if self.save_dtype == "bf16" and not chunked:  # chunked: each chunk is cast as it is written
            aux, last = aux.to(torch.bfloat16), None if last is None else last.to(torch.bfloat16)
        try:
            create_private_file(tmp, self.share_gid)  # its mode before any byte of it is written
            if chunked:
                self._save_chunks(tmp, input_ids.long(), loss_mask.long(), aux, last, chunks)
            else:
                self._save(tmp, input_ids.long(), loss_mask.long(), aux, last)
            set_private_mode(tmp, self.share_gid)  # a writer that made a file of its own
            if before_commit is not None:
                before_commit()
            return _commit(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        raise NotImplementedError

    def writes_chunks(self, aux: "torch.Tensor", last: Optional["torch.Tensor"]) -> bool:
        """Whether this format writes a sample of these tensors chunk by chunk (_save_chunks)."""
        return False

    def _save_chunks(self, tmp, input_ids, loss_mask, aux, last, chunks: Iterable[Chunk]) -> None:
        """_save's file, its rows taken from `chunks` in order (aux and last: only their shapes and dtypes)."""
        raise NotImplementedError

    def out_dtype(self, dtype: "torch.dtype") -> "torch.dtype":
        """The dtype the states of `dtype` are stored in (--save-dtype bf16 casts; FP8 is the format's)."""
        import torch

        return torch.bfloat16 if self.save_dtype == "bf16" else dtype


def numbered_files(out_dir: str, prefix: str, suffix: str) -> List[Tuple[int, str]]:
    """(sample index, path) of every `prefix`{index}`suffix` file in `out_dir`, in sample order (a temporary
    file of an interrupted write is none)."""
    import re

    out = []
    for p in glob.glob(os.path.join(out_dir, f"{prefix}*{suffix}")):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)" + re.escape(suffix), os.path.basename(p))
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def link_sample_file(path: str, dst: str) -> None:
    """`dst` made the sample file `path` (which lies in dst's parent's parent folder): a hard link, no extra disk,
    or where the filesystem has none, a relative symlink (it survives moving the output folder)."""
    try:
        os.link(path, dst)
    except OSError:
        os.symlink(os.path.join(os.pardir, os.path.basename(path)), dst)


def cut_short(unreadable: List[Tuple[str, str]], made: str) -> SinkError:
    """The one-line error of finalize over sample files that are not whole ((path, why) each): nothing is
    removed, and `made` (what finalize makes) is not written."""
    (p, why), others = unreadable[0], [os.path.basename(q) for q, _ in unreadable[1:]]
    nor = f", nor are {len(others)} more ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
    return SinkError(f"{p} is not a whole sample file ({why})" + (nor if others else "")
                     + ": cut short (a copy that did not finish, a full disk?); copy it again, or delete it and rerun "
                     f"the extraction with --resume to remake it; no {made} written")


def record_rows(aux: "torch.Tensor", last: Optional["torch.Tensor"]) -> Optional["torch.Tensor"]:
    """The record's rows [T, K+1, H] when `aux` [T, K, H] and `last` [T, H] are its two views rows[:, :K] and
    rows[:, K] (what HiddenStateReader hands out) and their storage is exactly those rows; else None."""
    rows = _side_by_side(aux, last)
    if rows is None or aux.storage_offset() != 0 or aux.untyped_storage().nbytes() != rows.numel() * rows.element_size():
        return None
    return rows
