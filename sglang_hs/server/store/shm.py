"""A file under the dump dir mapped into memory, with 64-bit acquire/release counters inside it.

The building block of the store and the output ring: `SharedRegion.create()` makes a new 0600 file
(never through a symlink, pages reserved up front so a full /dev/shm fails here and not with SIGBUS
later), `SharedRegion.open()` maps an existing one, `SharedRegion.attach()` too, through a file descriptor it
keeps (`fd`): a reader's, which can then tell its file was unlinked (a restarted server made a new one) and
locks it. `buf` is a uint8 torch tensor over the mapping.
Counters are 8-byte aligned words: a writer fills a record, then `store_release`s the counter that
publishes it; a reader that `load_acquire`s the new value sees the whole record.
"""
from __future__ import annotations

import mmap
import os
import stat
import warnings
from typing import Optional

from sglang_hs._ext import ext


class SharedRegion:
    def __init__(self, dir_path: str, name: str, buf, fd: Optional[int] = None, mm: Optional[mmap.mmap] = None) -> None:
        self.dir_path, self.name, self.buf = dir_path, name, buf
        self.fd = fd  # attach(): the open file the mapping is of
        self.mm = mm  # attach(): the mapping (drop_pages)

    @classmethod
    def create(cls, dir_path: str, name: str, nbytes: int) -> "SharedRegion":
        return cls(dir_path, name, ext().map_file(os.path.abspath(dir_path), name, int(nbytes), True))

    @classmethod
    def open(cls, dir_path: str, name: str, nbytes: int = 0, owner_uid: int = -1) -> "SharedRegion":
        """Map an existing file of `owner_uid` (-1: this user)."""
        return cls(dir_path, name, ext().map_file(os.path.abspath(dir_path), name, int(nbytes), False, owner_uid))

    @classmethod
    def attach(cls, dir_path: str, name: str, owner_uid: int = -1, writable: bool = True,
               populate: bool = True) -> "SharedRegion":
        """Map an existing regular file of `owner_uid` (-1: this user) through one descriptor, opened
        without following a symlink (neither the folder nor the file) and kept open as `fd`: the mapping
        is of exactly the file `fd` is, whatever happens to its name meanwhile. Read-only unless
        `writable`. The caller closes `fd` (the mapping stays until its last view is freed); a flock on
        `fd` ends when it is closed. `populate`: map every page now (MAP_POPULATE); False: each page as it
        is first touched (a reader that reads long records in chunks keeps only the pages it reads mapped:
        drop_pages)."""
        dir_path = os.path.abspath(dir_path)
        path = os.path.join(dir_path, name)
        dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(name, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            owner = os.geteuid() if owner_uid < 0 else owner_uid
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if st.st_uid != owner:
                raise ValueError(f"{path} is owned by uid {st.st_uid}, not by uid {owner}"
                                 + (" (this user)" if owner_uid < 0 else " (the owner the reader trusts)"))
            if st.st_size <= 0:
                raise ValueError(f"{path} is empty")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0),
                           prot=prot)
            # `fd` is the file the mapping is of, but not its open file: the mapping holds that one (a flock on
            # it would last as long as the mapping), so a new open file of the same file, through the fd
            own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # a read-only mapping: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            import torch

            buf = torch.frombuffer(mm, dtype=torch.uint8)
        return cls(dir_path, name, buf, own, mm)

    def unlinked(self) -> bool:
        """Whether the file attach() mapped no longer has a name (a restarted server unlinked it and made a
        new one of that name; or the dump dir was removed)."""
        return self.fd is not None and os.fstat(self.fd).st_nlink == 0

    def drop_pages(self, offset: int, nbytes: int) -> int:
        """Unmap from this process the whole pages inside [offset, offset + nbytes) of an attach()ed mapping
        (madvise MADV_DONTNEED): they leave its resident memory (RssShmem), the file keeps them (a shared
        mapping: the bytes stay the file's, and a later read maps them again). The pages the range only
        partly covers stay. Returns the bytes unmapped: 0 where the kernel refuses (EINVAL with mlockall,
        EAGAIN): dropping is only a saving, never a reason for an ack to fail."""
        page = mmap.PAGESIZE
        start = max(0, -(-offset // page) * page)
        end = min(self.nbytes, offset + nbytes) // page * page
        if self.mm is None or end <= start:
            return 0
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except OSError:
            return 0
        return end - start

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
