"""Spill files: a long record's tensors in unlinked files on disk, mapped copy on write, handed from one process to
another as the file, never as a copy (issue 47: a 64K-128K-token sample is never held twice in memory).

A spill file is made in a folder (LiveHiddenStates' spill_dir, else the temp folder: spill_folder, which warns once,
in one line, when the folder is on a tmpfs or ramfs, where a file is memory again and spilling saves nothing),
unlinked at once and kept open (SpillFile): nothing is left behind whatever happens to the process. Its tensors are `torch.from_file` of /proc/self/fd/N, MAP_PRIVATE:
their pages are the page cache's until written to (copy on write: a trainer may change them in place).

Across processes (DataLoader workers to the main process, LiveHiddenStates' record router to the workers) a
tensor goes through multiprocessing's ForkingPickler, and torch's own reduction moves its storage into a new
shared-memory segment, a second full copy (and for a `from_file` storage fails: it keeps no descriptor to share).
`crossing_as_file(t, spill)` registers the mapping: pickled by ForkingPickler, it and every tensor viewing its
storage (slices, reshapes, in-place results: what a wrapper or a collate may make of it in the worker) are the
file's descriptor (multiprocessing's DupFd, as torch hands its own shared-memory descriptors over) and the view
(dtype, shape, strides, offset), and the receiving process maps the same file: a plain tensor, the same values, no
copy made. A tensor with storage of its own (a batch that default_collate stacks, a cast) goes torch's own way,
through shared memory: batch_size=None keeps a long sample file-backed.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Optional, Tuple

import torch

PREFIX = ".sglang-hs-spill-"
_spill_dirs_checked: set = set()  # the spill folders this process has checked (and warned of) once


def warn_if_spill_dir_in_memory(folder: str, given: bool) -> Optional[str]:
    """Once per folder and process: one line on stderr when spill folder `folder` (`given`: spill_dir=, else the
    temp folder) is on a file system that keeps its files in memory (tmpfs, ramfs): spilling there saves nothing.
    Returns the line (None: no warning)."""
    from sglang_hs.fsutil import MEMORY_FILE_SYSTEMS, fs_type_of

    if folder in _spill_dirs_checked:
        return None
    _spill_dirs_checked.add(folder)
    kind = fs_type_of(folder)
    if kind not in MEMORY_FILE_SYSTEMS:
        return None
    what = f"spill_dir {folder}" if given else f"spill_dir (None: the temp folder, {folder})"
    line = (f"[sglang-hs] warning: LiveHiddenStates {what} is on {kind}, so a long record spilled there is still "
            "held in memory: expected a disk-backed directory (spill_dir=)")
    print(line, file=sys.stderr, flush=True)
    return line


def spill_folder(spill_dir: Optional[str]) -> str:
    """Where long records spill: `spill_dir`, else the temp folder; warned of once if it is in memory."""
    folder = spill_dir or tempfile.gettempdir()
    warn_if_spill_dir_in_memory(folder, spill_dir is not None)
    return folder


class SpillFile:
    """An unlinked file in `folder`, open for reading and writing until this object goes."""

    def __init__(self, folder: str) -> None:
        fd, path = tempfile.mkstemp(prefix=PREFIX, dir=folder)
        os.unlink(path)
        self.file = os.fdopen(fd, "r+b")

    @property
    def fd(self) -> int:
        return self.file.fileno()

    def map(self, numel: int, dtype: torch.dtype, shared: bool = False) -> torch.Tensor:
        """Its first `numel` elements of `dtype`, mapped copy on write (written bytes flushed first); `shared`: the
        file's own pages (MAP_SHARED: a write goes to the file, so a process it crosses to sees it)."""
        self.file.flush()
        return _map_fd(self.fd, numel, dtype, shared)

    def close(self) -> None:
        self.file.close()

    def __del__(self) -> None:
        try:
            self.file.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _map_fd(fd: int, numel: int, dtype: torch.dtype, shared: bool = False) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(f"/proc/self/fd/{fd}", shared=shared, size=numel, dtype=dtype)


# The spill mappings that cross as their file: a mapping's storage (its StorageImpl, StorageWeakRef.cdata) -> (a weak
# reference to it, its SpillFile). A weak reference keeps the StorageImpl's address from being reused, so a live entry
# is that storage and no other; an expired one (the sample dropped) is pruned with its file at the next registration.
_CROSSING: dict = {}
# Registrations come from more than one thread of a process: DataLoader worker 0 runs the record router (spill_record,
# its thread) beside its own samples (live.py, the worker's thread). Pruning and adding hold this lock; a lookup
# (_crossing_file) is one dict.get. A fork (a DataLoader worker) gets a lock of its own, never one held.
_CROSSING_LOCK = threading.Lock()


def _new_crossing_lock() -> None:
    global _CROSSING_LOCK
    _CROSSING_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_crossing_lock)
_torch_reduce_tensor = None  # torch's own reduction of a tensor (torch.multiprocessing.reductions.reduce_tensor)


def crossing_as_file(t: torch.Tensor, spill: SpillFile) -> torch.Tensor:
    """Returns `t` (a mapping of `spill`, or a view of one), registered so that ForkingPickler pickles it, and every
    tensor viewing the same storage (a slice, a reshape, the result of an in-place op: what a collate or a wrapper
    in the worker may make of it), as the file's descriptor and the view: the receiving process maps the same file
    (rebuild_spilled). Any other tensor (a stack, a cast: new storage) goes torch's own way. Only a process that
    registers a mapping replaces ForkingPickler's reduction of tensors (_install)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    _install()
    ref = StorageWeakRef(t.untyped_storage())
    with _CROSSING_LOCK:
        for key in [k for k, (old, _) in _CROSSING.items() if old.expired()]:
            del _CROSSING[key]
        _CROSSING[ref.cdata] = (ref, spill)
    return t


def _crossing_file(t: torch.Tensor) -> Optional[SpillFile]:
    if not _CROSSING or t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    entry = _CROSSING.get(t.untyped_storage()._cdata)
    return entry[1] if entry is not None and not entry[0].expired() else None


def _reduce_tensor(t: torch.Tensor):
    spill = _crossing_file(t)
    if spill is None:
        return _torch_reduce_tensor(t)
    return rebuild_spilled, (DupFd(spill.fd), t.untyped_storage().nbytes() // t.element_size(), t.dtype,
                             tuple(t.shape), t.stride(), t.storage_offset())


def _install() -> None:
    """ForkingPickler's reduction of torch.Tensor becomes _reduce_tensor (torch's own for every tensor that is not a
    registered spill mapping), once per process, after torch registered its own (torch.multiprocessing)."""
    global _torch_reduce_tensor
    if _torch_reduce_tensor is None:
        from torch.multiprocessing.reductions import reduce_tensor

        _torch_reduce_tensor = reduce_tensor
        ForkingPickler.register(torch.Tensor, _reduce_tensor)


def rebuild_spilled(dup, numel: int, dtype: torch.dtype, size: Tuple[int, ...], stride: Tuple[int, ...],
                    offset: int) -> torch.Tensor:
    """The receiving side: the same view of the spill file, mapped here copy on write (a plain tensor)."""
    fd = dup.detach()
    try:
        base = _map_fd(fd, numel, dtype)
    finally:
        os.close(fd)
    return base.as_strided(size, stride, offset)


STATES = ("aux_hidden_states", "last_hidden_state", "last_pre_norm")  # a record's (and RecordChunk's) state tensors


def spill_record(reader, rec, folder: str):
    """A copy of long record `rec` (views of the ring) whose state tensors are one spill file in `folder`, written a
    chunk at a time from reader.chunks(rec) (each chunk's ring pages unmapped once the next is read), in their
    dtype and shapes, crossing to another process as that file (crossing_as_file); its token ids copied. The
    caller acknowledges `rec` afterwards."""
    import dataclasses
    import math

    from sglang_hs.extract.sinks.base import write_at

    T = rec.num_tokens
    names = [n for n in STATES if getattr(rec, n) is not None]
    # elements of one token's row, from the shape alone (a streamed record's states are stand-ins, StreamedRows)
    width = {n: math.prod(getattr(rec, n).shape[1:]) if T else 0 for n in names}
    dtype = rec.aux_hidden_states.dtype
    start, end = {}, 0
    for n in names:
        start[n], end = end, end + T * width[n]
    spill = SpillFile(folder)
    for c in reader.chunks(rec):
        for n in names:
            write_at(spill.file, (start[n] + c.start * width[n]) * dtype.itemsize, getattr(c, n))
    base = spill.map(end, dtype)
    states = {n: crossing_as_file(base[start[n]:start[n] + T * width[n]].view(getattr(rec, n).shape), spill)
              for n in names}
    return dataclasses.replace(rec, input_ids=rec.input_ids.clone(), views=False, _rows_at=-1, _stream=None, **states)


def slice_chunks(rec, bound: int):
    """`rec`'s rows in order as RecordChunks of at most `bound` row bytes (at least one token's): slices of a record
    that is no view of a ring (a spilled one), as HiddenStateReader.chunks hands a copied record."""
    from sglang_hs.reader import RecordChunk

    T, row = rec.num_tokens, rec._row_bytes
    n = max(1, bound // row) if row else max(T, 1)
    for s in range(0, T, n):
        e = min(T, s + n)
        yield RecordChunk(s, e, rec.input_ids[s:e], *(None if getattr(rec, k) is None else getattr(rec, k)[s:e]
                                                      for k in STATES))
