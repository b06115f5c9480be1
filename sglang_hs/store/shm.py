"""A file under the dump dir mapped into memory, with 64-bit acquire/release counters inside it.

The building block of the store and the output ring: `SharedRegion.create()` makes a new 0600 file
(never through a symlink, pages reserved up front so a full /dev/shm fails here and not with SIGBUS
later), `SharedRegion.open()` maps an existing one. `buf` is a uint8 torch tensor over the mapping.
Counters are 8-byte aligned words: a writer fills a record, then `store_release`s the counter that
publishes it; a reader that `load_acquire`s the new value sees the whole record.
"""
from __future__ import annotations

import os

from sglang_hs._ext import ext


class SharedRegion:
    def __init__(self, dir_path: str, name: str, buf) -> None:
        self.dir_path, self.name, self.buf = dir_path, name, buf

    @classmethod
    def create(cls, dir_path: str, name: str, nbytes: int) -> "SharedRegion":
        return cls(dir_path, name, ext().map_file(os.path.abspath(dir_path), name, int(nbytes), True))

    @classmethod
    def open(cls, dir_path: str, name: str, nbytes: int = 0, owner_uid: int = -1) -> "SharedRegion":
        """Map an existing file of `owner_uid` (-1: this user)."""
        return cls(dir_path, name, ext().map_file(os.path.abspath(dir_path), name, int(nbytes), False, owner_uid))

    @property
    def path(self) -> str:
        return os.path.join(self.dir_path, self.name)

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def load_acquire(self, offset: int) -> int:
        return ext().load_acquire(self.buf, offset)

    def store_release(self, offset: int, value: int) -> None:
        ext().store_release(self.buf, offset, value)

    def fetch_add(self, offset: int, delta: int) -> int:
        return ext().fetch_add(self.buf, offset, delta)

    def unlink(self) -> None:
        dfd = os.open(self.dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.unlink(self.name, dir_fd=dfd)
        finally:
            os.close(dfd)
