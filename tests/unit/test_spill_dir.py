"""LiveHiddenStates' spill folder on a file system that keeps files in memory (issue 47, leftover 2): spilling a
long record to a tmpfs (e.g. /dev/shm, or a temp folder that is one) saves nothing, so the first spill there warns,
once, in one line naming the folder and what was expected. The file system is found from the mount table
(fsutil.fs_type_of: the mount of the folder's device, else of the longest mount point above it), here a fake
one in which the test's folder is on tmpfs, ext4 or a mount point with a space."""
import os

import pytest

from sglang_hs import fsutil, spill


def _table(tmp_path, lines):
    path = tmp_path / "mountinfo"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _dev(path):
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def test_the_mount_of_the_folders_device_gives_its_type(tmp_path):
    folder = tmp_path / "spill"
    folder.mkdir()
    dev = _dev(folder)
    other = "0:9999" if dev != "0:9999" else "0:9998"
    table = _table(tmp_path, [
        "22 27 0:21 / /proc rw,relatime - proc proc rw",
        "not a mountinfo line",
        f"30 25 {other} / / rw - ext4 /dev/sda1 rw",
        f"31 25 {dev} / /mnt/some\\040where rw,relatime shared:7 - tmpfs tmpfs rw,size=1k",  # optional fields
    ])
    assert fsutil.fs_type_of(str(folder), table) == "tmpfs"  # by device, wherever it is mounted
    assert fsutil.fs_type_of(str(folder / "missing"), table) == ""
    assert fsutil.fs_type_of(str(folder), str(tmp_path / "no-table")) == ""


def test_without_a_device_match_the_longest_mount_point_above_it(tmp_path):
    folder = tmp_path / "a b" / "spill"
    folder.mkdir(parents=True)
    spaced = str(tmp_path / "a b").replace(" ", "\\040")
    table = _table(tmp_path, [
        "30 25 0:9999 / / rw - ext4 /dev/sda1 rw",
        f"31 30 0:9998 / {spaced} rw - ramfs ramfs rw",
        f"32 31 0:9997 / {spaced}/sp rw - tmpfs tmpfs rw",  # longer, but a prefix of the name, not a folder above it
    ])
    assert fsutil.fs_type_of(str(folder), table) == "ramfs"
    os.symlink(folder, tmp_path / "link")
    assert fsutil.fs_type_of(str(tmp_path / "link"), table) == "ramfs"  # the real path's mount


@pytest.mark.parametrize("kind, given", [("tmpfs", True), ("ramfs", False), ("ext4", True)])
def test_a_spill_folder_in_memory_is_warned_of_once_in_one_line(tmp_path, monkeypatch, capsys, kind, given):
    folder = tmp_path / "spill"
    folder.mkdir()
    monkeypatch.setattr(fsutil, "MOUNTINFO", _table(tmp_path, [f"31 25 {_dev(folder)} / /x rw - {kind} x rw"]))
    monkeypatch.setattr(spill, "_spill_dirs_checked", set())
    lines = [spill.warn_if_spill_dir_in_memory(str(folder), given) for _ in range(3)]
    err = capsys.readouterr().err.splitlines()
    if kind == "ext4":
        assert lines == [None] * 3 and err == []
        return
    assert lines[1:] == [None, None] and err == [lines[0]], err  # once, one line
    assert str(folder) in err[0] and f"is on {kind}" in err[0], err[0]
    assert "expected a disk-backed directory (spill_dir=)" in err[0], err[0]
    assert ("spill_dir " + str(folder)) in err[0] if given else "(None: the temp folder" in err[0]


def test_dev_shm_is_memory_here():
    """The real mount table: /dev/shm, where this machine has one, is a tmpfs (the case the warning is for)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    assert fsutil.fs_type_of("/dev/shm") in fsutil.MEMORY_FILE_SYSTEMS
