"""File-system helpers for the dump dir: private modes, never through a symlink, atomic replace.

By default the dump dir is 0700 and its files 0600. `--hs-share-group GROUP` lets readers running as
other users of GROUP in: the folder 0750, the manifest and the output rings 0640, the rings' offset files
0660 (a reader writes its read offset there), all of group GROUP; the store and the lock file stay 0600.
A reader then names the server's user (HiddenStateReader(dir, owner=USER)), accepts a group-writable
offset file only of the group the manifest declares, and no group-writable ring."""
from __future__ import annotations

import fcntl
import os
import stat
import uuid
from typing import Optional

LOCK_NAME = ".lock"
# In the dump dir of a node that hosts no writer (SGLang --nnodes, e.g. --tp 2 over 2 nodes: the one writer is
# TP rank 0, on node 0), written by that node's launcher instead of a manifest: readers refuse it in one line.
NO_WRITER = "no-writer.json"


def resolve_share_group(text: str, flag: str = "--hs-share-group") -> int:
    """The gid of `flag` GROUP (a group name or number) that this user may give its files to."""
    import grp

    try:
        gid = int(text) if text.isdigit() else grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"{flag} {text}: no such group") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ValueError(f"{flag} {text}: this user (uid {os.geteuid()}) is not a member of group {gid}; "
                         "add it to the group (and log in again) or share with one of its groups")
    return gid


def ensure_private_dir(path: str, share_gid: Optional[int] = None, flag: str = "--hs-dump-dir") -> str:
    """Create `path` if missing; refuse a symlink, a non-folder or another user's folder. Its mode is
    set to 0700, or 0750 of group `share_gid` when the dump is shared. `flag` names it in errors."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{flag} {path}: parent folder {parent} does not exist")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{flag} {path}: is a symlink; give the real folder")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{flag} {path}: exists and is not a folder")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{flag} {path}: owned by uid {st.st_uid}, not by this user")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {path}: not writable")
    _set_mode_at(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0o700, 0o750, share_gid)
    return path


def ensure_output_dir(path: str, share_gid: Optional[int] = None, flag: str = "--output") -> str:
    """An output folder gets the dump dir's care (ensure_private_dir): its parents are made as needed, then
    it is made or checked (this user's, not a symlink) and set to 0700 (0750 of `share_gid`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return ensure_private_dir(path, share_gid, flag)


def make_private_dirs(path: str, share_gid: Optional[int] = None) -> None:
    """`path` (a folder inside an output folder) made 0700, or 0750 of `share_gid`, if missing."""
    if os.path.isdir(path):
        return
    os.makedirs(path, 0o700, exist_ok=True)
    if share_gid is not None:
        _set_mode_at(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0o700, 0o750, share_gid)


def create_private_file(path: str, share_gid: Optional[int] = None) -> None:
    """Create `path` empty, 0600 (0640 of `share_gid`), never through a symlink and never an existing file,
    for a writer that then opens it by name (torch.save, safetensors): truncating keeps the mode, so the
    contents are never readable by others, not even while they are written."""
    _set_mode_at(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, 0o640, share_gid)


def set_private_mode(path: str, share_gid: Optional[int] = None) -> None:
    """A file a library wrote by name (it may have made its own: safetensors writes a new 0600 file) made 0600,
    or 0640 of `share_gid`, never through a symlink."""
    _set_mode_at(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, 0o640, share_gid)


def set_private_modes(top: str, share_gid: Optional[int] = None) -> None:
    """Every folder (0700 / 0750) and regular file (0600 / 0640 of `share_gid`) under `top`, `top` too, that
    a library made with default modes (datasets' save_to_disk)."""
    for root, dirs, files in os.walk(top):
        for name, dmode, gmode in [(root, 0o700, 0o750)] + [(os.path.join(root, f), 0o600, 0o640) for f in files]:
            if os.path.islink(name):
                continue
            _set_mode_at(name, os.O_RDONLY | os.O_NOFOLLOW, dmode, gmode, share_gid)


def _set_mode_at(path: str, flags: int, private: int, shared: int, share_gid: Optional[int],
                 dir_fd: Optional[int] = None) -> None:
    """Open `path` with `flags` (made 0600 first when they create it), give it `_set_mode`'s mode, close it."""
    fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    try:
        _set_mode(fd, private, shared, share_gid)
    finally:
        os.close(fd)


def _set_mode(fd: int, private: int, shared: int, share_gid: Optional[int]) -> None:
    if share_gid is not None:
        os.fchown(fd, -1, share_gid)
    os.fchmod(fd, private if share_gid is None else shared)


def share_file(dir_path: str, name: str, mode: int, share_gid: Optional[int]) -> None:
    """Give a file the dump dir made (0600) `mode` and group `share_gid`; nothing when not sharing."""
    if share_gid is None:
        return
    dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _set_mode_at(name, os.O_RDONLY | os.O_NOFOLLOW, 0o600, mode, share_gid, dir_fd=dfd)
    finally:
        os.close(dfd)


def write_private_file(dir_path: str, name: str, data: bytes, share_gid: Optional[int] = None) -> None:
    """Write `dir_path/name` atomically (temp file + rename), mode 0600 (0640 of group `share_gid`
    when sharing), never following a symlink."""
    dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        tmp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            _set_mode(fd, 0o600, 0o640, share_gid)
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


def owner_uid(owner) -> int:
    """A user name or uid (HiddenStateReader's `owner`) as a uid; None: this user."""
    if owner is None:
        return os.geteuid()
    if isinstance(owner, int) or str(owner).isdigit():
        return int(owner)
    import pwd

    try:
        return pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise ValueError(f"owner={owner!r}: no such user") from None


def check_private_file(path: str, owner: Optional[int] = None, writable_by_gid: Optional[int] = None) -> os.stat_result:
    """Refuse a dump file that is not a regular file of `owner` (a uid; None: this user), or that others
    may write: never the world, and the group only where it is `writable_by_gid` (a shared ring)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file (a symlink or special file); refusing it")
    who = _user(st.st_uid)
    want = os.geteuid() if owner is None else owner
    if st.st_uid != want:
        if owner is None:
            raise ValueError(f"{path}: owned by {who}, not by this user ({_user(want)}); run the reader as the "
                             "server's user (in a container: docker run --user $(id -u):$(id -g)), or, if the server "
                             "shares the dump with your group (--hs-share-group), pass owner=<the server's user> "
                             "(to python -m sglang_hs.extract: --hs-owner)")
        raise ValueError(f"{path}: owned by {who}, not by {_user(want)}, the owner this reader was told to trust")
    group_ok = writable_by_gid is not None and st.st_gid == writable_by_gid
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and not group_ok):
        raise ValueError(f"{path}: group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}, owner {who}, "
                         f"group {st.st_gid}): anyone could have altered it; refusing it")
    return st


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # their files' pages are memory: a file there saves no RAM
MOUNTINFO = "/proc/self/mountinfo"


def _unescape_mount_field(text: str) -> str:
    """A mountinfo path with its octal escapes (\\040 for a space, \\011, \\012, \\134) undone."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def fs_type_of(path: str, mountinfo: Optional[str] = None) -> str:
    """The file-system type of the mount that holds the existing `path`, '' if unknown: the mount of its device
    (st_dev, as mountinfo's major:minor; symlinks and bind mounts resolved by the kernel), else the mount whose
    mount point is the longest prefix of its real path (a btrfs subvolume's st_dev is not its mount's).
    `mountinfo`: the mount table read (default MOUNTINFO, this process's)."""
    try:
        st = os.stat(path)
        with open(mountinfo or MOUNTINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    real = os.path.realpath(path)
    by_dev, best, by_prefix = "", "", ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        kind, mnt = right.split()[0], _unescape_mount_field(fields[4])
        if fields[2] == dev:
            by_dev = kind  # the last one: a mount over another at the same point is the one seen
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, by_prefix = mnt, kind
    return by_dev or by_prefix
