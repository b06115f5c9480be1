"""Sharing a dump with readers of other users (--hs-share-group): private modes by default; with a share
group, the folder 0750, the manifest and the rings 0640 and the rings' offset files 0660 of that group, the
store still 0600. A reader running as another user of the group reads and acknowledges (into the offset
file) when told whose files to trust, and is refused otherwise; a group-writable offset file of any other
group, a group-writable ring, or a world-writable file is refused."""
import os
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs import fsutil  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

OTHER_UID, SHARE_GID = 4242, 4343  # a reader user and the group it shares with the server (root runs)
H, T = 16, 4
# Record i's rows [T, P, H] and token ids, every value different and exact in bf16 (an odd mantissa below
# 256 numbering the layer and hidden index, times a power of two numbering the record and token), so a
# reader handing out another record's, token's or layer's row fails; the child reader runs the same code.
EXPECTED = """
import torch
def expected_rows(i, T, P, H):
    t, p, h = torch.arange(T).view(T, 1, 1), torch.arange(P).view(1, P, 1), torch.arange(H).view(1, 1, H)
    return ((2 * (h + H * p) + 1) * torch.pow(2.0, 8 * i + t - 40)).bfloat16()
def expected_ids(i, T):
    return torch.arange(T, dtype=torch.int32) * 7 + 100 * i
def is_exact(rec, i, T, H):
    rows = expected_rows(i, T, 2, H)
    return (rec.rid == f"r{i}" and torch.equal(rec.input_ids, expected_ids(i, T))
            and torch.equal(rec.aux_hidden_states, rows[:, :1]) and torch.equal(rec.last_pre_norm, rows[:, 1]))
"""
exec(EXPECTED)


def _mode(path):
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def _dump(parent, monkeypatch, gid):
    if gid is None:
        monkeypatch.delenv("SGLANG_HS_SHARE_GID", raising=False)
    else:
        monkeypatch.setenv("SGLANG_HS_SHARE_GID", str(gid))
    d = fsutil.ensure_private_dir(os.path.join(parent, "hs"), gid)
    w = CaptureWriter(d, CaptureSpec.resolve([1], "pre-norm", 4, H), 8, torch.bfloat16, 1 << 16)  # speculators' state
    for i in range(3):
        w.ring.publish(f"r{i}", expected_ids(i, T), expected_rows(i, T, 2, H))  # noqa: F821 (from EXPECTED)
    return d


def test_private_by_default(tmp_path, monkeypatch):
    d = _dump(str(tmp_path), monkeypatch, None)
    assert _mode(d)[0] == 0o700
    for name in ("manifest.json", "ring-w0.bin", "ring-w0.offset", "store-w0.bin"):
        assert _mode(f"{d}/{name}")[0] == 0o600
    assert HiddenStateReader(d, wait=1).manifest["share_gid"] is None


def test_shared_modes_and_this_user_still_reads(tmp_path, monkeypatch):
    gid = os.getegid()
    d = _dump(str(tmp_path), monkeypatch, gid)
    assert _mode(d) == (0o750, gid)
    assert _mode(f"{d}/manifest.json") == (0o640, gid)
    assert _mode(f"{d}/ring-w0.bin") == (0o640, gid)  # only the writer writes the ring
    assert _mode(f"{d}/ring-w0.offset") == (0o660, gid)  # the reader writes its read offset
    assert _mode(f"{d}/store-w0.bin")[0] == 0o600  # readers never need the store
    reader = HiddenStateReader(d, wait=1)
    assert reader.manifest["share_gid"] == gid and is_exact(reader.take("r1", timeout=1), 1, T, H)  # noqa: F821


def test_group_writable_ring_of_another_group_or_world_writable_is_refused(tmp_path, monkeypatch):
    d = _dump(str(tmp_path), monkeypatch, os.getegid())
    m = f"{d}/manifest.json"
    text = open(m).read().replace(f'"share_gid": {os.getegid()}', f'"share_gid": {os.getegid() + 1}')
    fsutil.write_private_file(d, "manifest.json", text.encode())  # declares a group the ring does not have
    with pytest.raises(ValueError, match=r"ring-w0.offset: group- or world-writable \(mode 0660"):
        HiddenStateReader(d, wait=1)
    fsutil.write_private_file(d, "manifest.json", text.replace(f'"share_gid": {os.getegid() + 1}',
                                                                f'"share_gid": {os.getegid()}').encode())
    os.chmod(f"{d}/ring-w0.bin", 0o660)  # the ring is the writer's alone, whatever the group
    with pytest.raises(ValueError, match=r"ring-w0.bin: group- or world-writable \(mode 0660"):
        HiddenStateReader(d, wait=1)
    (tmp_path / "b").mkdir()
    d2 = _dump(str(tmp_path / "b"), monkeypatch, os.getegid())
    os.chmod(f"{d2}/ring-w0.bin", 0o662)
    with pytest.raises(ValueError, match=r"ring-w0.bin: group- or world-writable \(mode 0662"):
        HiddenStateReader(d2, wait=1)


# The child imports as root (the interpreter and torch live under /root, closed to other users), then
# drops to the other user for good before it touches the dump.
_CHILD = """
import os, sys
import pwd, grp
from sglang_hs import HiddenStateReader
exec(sys.argv[5])  # EXPECTED: the rows the server published
from sglang_hs._ext import ext
ext()
gids = [int(g) for g in sys.argv[4].split(",")]
os.setgroups(gids)
os.setgid(gids[0])
os.setuid(int(sys.argv[3]))
try:
    reader = HiddenStateReader(sys.argv[1], wait=1, ack=True, **({"owner": sys.argv[2]} if sys.argv[2] else {}))
except Exception as e:
    print("ERROR", type(e).__name__, e)
    sys.exit(3)
rec = reader.take("r1", timeout=5)
first = reader.next(timeout=5)
reader.ack(first)
print("OK", rec.rid, rec.num_tokens, first.rid, "exact" if is_exact(rec, 1, 4, 16) and is_exact(first, 0, 4, 16) else "WRONG ROWS")
"""


def _as_user(uid, gids, dump, owner):
    return subprocess.run([sys.executable, "-c", _CHILD, dump, owner, str(uid), ",".join(map(str, gids)), EXPECTED],
                          capture_output=True, text=True, timeout=120, cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a reader as another user")
def test_a_reader_of_another_user_in_the_group(monkeypatch):
    parent = tempfile.mkdtemp(prefix="sglang-hs-share-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.chmod(parent, 0o755)  # the dump dir's parent must let the other user through
        d = _dump(parent, monkeypatch, SHARE_GID)
        out = _as_user(OTHER_UID, [SHARE_GID], d, "")  # not told whom to trust: refused, saying how
        assert out.returncode == 3 and "owned by uid 0" in out.stdout and "pass owner=" in out.stdout, out
        out = _as_user(OTHER_UID, [SHARE_GID], d, "0")  # the server's user named: reads, and acks
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.split() == ["OK", "r1", "4", "r0", "exact"]  # every row, as the server published it
        import struct

        from sglang_hs.server.store.ring import record_bytes

        with open(f"{d}/ring-w0.offset", "rb") as f:  # its ack reached the writer: the end of record r0
            assert struct.unpack("<Q", f.read(8))[0] == record_bytes(T, 2, H, 2, 2)
        out = _as_user(OTHER_UID, [SHARE_GID + 1], d, "0")  # not in the group: the folder is closed to it
        assert out.returncode == 3 and "ERROR PermissionError" in out.stdout and "--hs-share-group" in out.stdout, out
    finally:
        import shutil

        shutil.rmtree(parent, ignore_errors=True)


_CLI_CHILD = """
import os, sys
from sglang_hs.extract import cli
from sglang_hs._ext import ext
ext()

def model_side(ns, manifest, url=None):  # the reader is open: say so, then end the run
    print("READER OK", manifest["share_gid"], flush=True)
    raise ValueError("stop here")

cli._model_side = model_side
os.setgroups([int(sys.argv[3])])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))
sys.exit(cli.main(["--data", sys.argv[4], "--output", sys.argv[5], "--server", "http://127.0.0.1:9",
                   "--hs-dump-dir", sys.argv[1], "--format", "safetensors", *sys.argv[6:]]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the extraction CLI as another user")
def test_the_extraction_cli_of_another_user_names_the_server_user_with_hs_owner(monkeypatch):
    parent = tempfile.mkdtemp(prefix="sglang-hs-share-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.chmod(parent, 0o755)
        d = _dump(parent, monkeypatch, SHARE_GID)
        data = os.path.join(parent, "d.jsonl")
        with open(data, "w") as f:
            f.write('{"input_ids": [5, 6, 7]}\n')
        os.chmod(data, 0o644)

        def run(*flags):
            out = os.path.join(parent, f"out{len(flags)}")
            os.mkdir(out)
            os.chown(out, OTHER_UID, SHARE_GID)
            return subprocess.run([sys.executable, "-c", _CLI_CHILD, d, str(OTHER_UID), str(SHARE_GID), data, out,
                                   *flags], capture_output=True, text=True, timeout=120, cwd="/")

        p = run()
        assert p.returncode == 1 and "READER OK" not in p.stdout, p.stdout + p.stderr
        assert "owned by uid 0" in p.stderr and "--hs-owner" in p.stderr, p.stderr
        p = run("--hs-owner", "0")
        assert p.returncode == 1 and f"READER OK {SHARE_GID}" in p.stdout and "stop here" in p.stderr, p.stdout + p.stderr
    finally:
        import shutil

        shutil.rmtree(parent, ignore_errors=True)
