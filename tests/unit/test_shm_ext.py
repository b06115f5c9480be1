"""The C++ ring primitives (csrc/shm.cpp): private file creation, mapping, acquire/release atomics."""
import multiprocessing as mp
import os
import stat

import pytest

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover - the Makefile always builds it
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.store.shm import SharedRegion  # noqa: E402


def test_create_is_private_and_exclusive(tmp_path):
    r = SharedRegion.create(str(tmp_path), "ring", 1 << 16)
    st = os.stat(r.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 16 and r.nbytes == 1 << 16
    with pytest.raises(RuntimeError, match="cannot create .*File exists"):
        SharedRegion.create(str(tmp_path), "ring", 4096)


def test_open_checks_size_and_shares_memory(tmp_path):
    a = SharedRegion.create(str(tmp_path), "r", 4096)
    b = SharedRegion.open(str(tmp_path), "r", 4096)
    a.buf[100:108] = 7
    assert b.buf[100:108].tolist() == [7] * 8
    assert SharedRegion.open(str(tmp_path), "r").nbytes == 4096
    with pytest.raises(RuntimeError, match="has 4096 bytes, expected 8192"):
        SharedRegion.open(str(tmp_path), "r", 8192)
    with pytest.raises(RuntimeError, match="cannot open .*No such file"):
        SharedRegion.open(str(tmp_path), "missing")


def test_never_through_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    SharedRegion.create(str(real), "r", 4096)
    (tmp_path / "file-link").symlink_to(real / "r")
    with pytest.raises(RuntimeError, match="cannot open .*file-link"):
        SharedRegion.open(str(tmp_path), "file-link")
    (tmp_path / "dir-link").symlink_to(real)
    with pytest.raises(RuntimeError, match="cannot open dump folder"):
        SharedRegion.open(str(tmp_path / "dir-link"), "r")
    # A planted symlink where a new file is to be created is refused too (O_EXCL | O_NOFOLLOW).
    (tmp_path / "planted").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="cannot create"):
        SharedRegion.create(str(tmp_path), "planted", 4096)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("name", ["", "a/b", "..", "."])
def test_names_are_plain(tmp_path, name):
    with pytest.raises(RuntimeError, match="plain file name"):
        SharedRegion.create(str(tmp_path), name, 4096)


def test_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RuntimeError):
        SharedRegion.open(str(tmp_path), "fifo")


def test_enospc_is_reported_at_creation(tmp_path):
    # posix_fallocate reserves the pages: an impossible size fails here (not SIGBUS on a later write),
    # and no half-made file is left behind.
    with pytest.raises(RuntimeError, match="cannot reserve"):
        SharedRegion.create("/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path), "sglang-hs-test-huge", 1 << 50)
    assert not os.path.exists("/dev/shm/sglang-hs-test-huge")


def test_atomics_and_their_contract(tmp_path):
    r = SharedRegion.create(str(tmp_path), "c", 64)
    assert r.load_acquire(8) == 0
    r.store_release(8, 41)
    assert r.fetch_add(8, 1) == 41 and r.load_acquire(8) == 42
    r.store_release(56, -1)
    assert r.load_acquire(56) == -1  # int64 round trip
    with pytest.raises(RuntimeError, match="not 8-byte aligned"):
        r.load_acquire(4)
    with pytest.raises(RuntimeError, match="outside a buffer of 64 bytes"):
        r.store_release(64, 1)
    with pytest.raises(RuntimeError, match="outside"):
        r.load_acquire(-8)
    import torch

    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ext().load_acquire(torch.zeros(8, dtype=torch.int64), 0)


RECORDS, SLOT, SLOTS = 20000, 64, 8


def _producer(dir_path):
    """Fill a record with its sequence number, then publish it with a release store of the head."""
    r = SharedRegion.open(dir_path, "ring")
    import torch

    for seq in range(1, RECORDS + 1):
        while seq - r.load_acquire(8) > SLOTS:  # wait until the consumer freed a slot (tail at 8)
            pass
        off = 64 + (seq % SLOTS) * SLOT
        r.buf[off : off + SLOT] = torch.full((SLOT,), seq % 251, dtype=torch.uint8)
        r.store_release(0, seq)


def test_publish_consume_across_processes(tmp_path):
    """A consumer that acquire-loads the head must see every record it covers complete."""
    r = SharedRegion.create(str(tmp_path), "ring", 64 + SLOTS * SLOT)
    p = mp.get_context("spawn").Process(target=_producer, args=(str(tmp_path),))
    p.start()
    seen = 0
    torn = 0
    while seen < RECORDS:
        head = r.load_acquire(0)
        while seen < head:
            seen += 1
            off = 64 + (seen % SLOTS) * SLOT
            vals = r.buf[off : off + SLOT]
            torn += int((vals != seen % 251).any())
            r.store_release(8, seen)
        assert p.exitcode in (None, 0)
    p.join(30)
    assert p.exitcode == 0 and torn == 0 and r.load_acquire(0) == RECORDS


def test_host_register_reports_cuda_errors(tmp_path):
    C = ext()
    if not C.with_cuda:
        pytest.skip("extension built without CUDA (SGLANG_HS_SKIP_CUDA_BUILD or no toolkit)")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu covers registration")
    r = SharedRegion.create(str(tmp_path), "s", 4096)
    with pytest.raises(RuntimeError, match=r"sglang_hs.host_register: cuda\w+ \(\d+\)"):
        C.host_register(r.buf)
