"""The reader refuses a dump it cannot trust, with one clear line naming the file and why: a truncated,
corrupted or other-version manifest, a manifest pointing outside the dump dir, files that others may
write (saying whose they are), another user's files, and symlinks."""
import json
import os

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402


@pytest.fixture
def dump(tmp_path):
    CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, 16), 8, torch.bfloat16, 1 << 16)
    return tmp_path


def _edit_manifest(dump, fn):
    path = dump / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def test_a_good_dump_opens(dump):
    assert HiddenStateReader(str(dump), wait=1).poll() == 0


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "manifest.json").write_text('{"format_version": 1, "layer'), "truncated or corrupted JSON"),
    (lambda d: _edit_manifest(d, lambda m: m.update(format_version=9)), "format version 9, this reader reads 1"),
    (lambda d: _edit_manifest(d, lambda m: m.pop("writers")), "not a valid manifest"),
    (lambda d: _edit_manifest(d, lambda m: m["writers"][0].update(ring="../../etc/x")), "is not a file name inside"),
    (lambda d: os.chmod(d / "manifest.json", 0o666), r"group- or world-writable \(mode 0666, owner uid \d+"),
    (lambda d: os.chmod(d / "ring-w0.bin", 0o620), r"ring-w0.bin: group- or world-writable \(mode 0620"),
    (lambda d: os.chown(d / "ring-w0.bin", 4242, -1), r"owned by uid 4242, not by this user"),
    (lambda d: ((d / "manifest.json").rename(d / "real.json"), os.symlink(d / "real.json", d / "manifest.json")),
     "not a regular file"),
    (lambda d: (d / "ring-w0.bin").write_bytes(b"GARBAGE!" + bytes(5000)), "not an sglang-hs output ring"),
])
def test_untrusted_dumps_are_refused(dump, damage, message):
    if "chown" in repr(damage.__code__.co_names) and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    damage(dump)
    with pytest.raises(ValueError, match=message):
        HiddenStateReader(str(dump), wait=1)
