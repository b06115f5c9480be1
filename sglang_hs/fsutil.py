"""File-system helpers for the dump dir: private modes, never through a symlink, atomic replace."""
from __future__ import annotations

import fcntl
import os
import stat
import uuid

LOCK_NAME = ".lock"


def ensure_private_dir(path: str) -> str:
    """Create `path` (mode 0700) if missing; refuse a symlink, a non-folder or another user's folder."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--hs-dump-dir {path}: parent folder {parent} does not exist")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"--hs-dump-dir {path}: is a symlink; give the real folder")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"--hs-dump-dir {path}: exists and is not a folder")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"--hs-dump-dir {path}: owned by uid {st.st_uid}, not by this user")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"--hs-dump-dir {path}: not writable")
    return path


def write_private_file(dir_path: str, name: str, data: bytes) -> None:
    """Write `dir_path/name` atomically (temp file + rename), mode 0600, never following a symlink."""
    dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        tmp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def lock_dump_dir(path: str) -> int:
    """Hold an exclusive lock on the dump dir for this process's lifetime; returns the fd.

    One server per dump dir: a second launcher on the same folder is refused, and files a dead server
    left behind (its lock died with it) can be replaced safely."""
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"--hs-dump-dir {path}: in use by another sglang-hs server (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def check_private_file(path: str) -> os.stat_result:
    """Refuse a dump file that is not a regular file of this user, or that others may write."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file (a symlink or special file); refusing it")
    owner = _user(st.st_uid)
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path}: owned by {owner}, not by this user ({_user(os.geteuid())}); run the reader as "
                         "the server's user (in a container: docker run --user $(id -u):$(id -g))")
    if st.st_mode & 0o022:
        raise ValueError(f"{path}: group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}, owner {owner}): "
                         "anyone could have altered it; refusing it")
    return st


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"
