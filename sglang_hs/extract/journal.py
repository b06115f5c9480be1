"""harvest.jsonl, the harvest's journal in --output: which file holds which record (rid, ring, sequence number),
the number of each ring first seen, and the setup the files were made with (a harvester started again against
another setup is refused). Appended and fsynced a line at a time, held under an exclusive lock for the
harvester's life (sglang_hs/extract/harvest.py says why)."""
from __future__ import annotations

import fcntl
import json
import os
import stat
from typing import Optional

from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.manifest import previous

JOURNAL = "harvest.jsonl"

# what the files in one --output must share (manifest.json's names): a harvester started again checks them
SETUP_KEYS = ("format", "save_dtype", "model_path", "architecture", "dtype", "hidden_size", "num_hidden_layers",
              "layer_ids", "last_hidden_state")


class Journal:
    """harvest.jsonl: a line with the setup ({"setup": {...}}), a line per ring first seen ({"ring",
    "number"}) and per file ({"index", "rid", ...}), each appended and fsynced. Opening it takes an
    exclusive lock (flock, dropped by the kernel when the process dies, so a SIGKILLed harvester leaves
    none behind) or refuses; a line a crash cut short is dropped."""

    def __init__(self, out_dir: str, share_gid: Optional[int] = None) -> None:
        self.path = os.path.join(out_dir, JOURNAL)
        self.rings: dict = {}  # ring_id -> number
        self.files: dict = {}  # file index -> its line
        self.setup: Optional[dict] = None
        try:  # 0600 (0640 of --output-group), never through a symlink, never a special file
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                               | os.O_NONBLOCK, 0o600)
        except OSError as e:
            why = "a symlink: refusing to follow it" if os.path.islink(self.path) else e.strerror
            raise ExtractError(f"{self.path}: cannot open the harvest journal ({why})") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(self._fd)
            raise ExtractError(f"{self.path}: not a regular file of this user (uid {st.st_uid}): refusing it")
        from sglang_hs.fsutil import _set_mode

        _set_mode(self._fd, 0o600, 0o640, share_gid)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ExtractError(f"--output {out_dir} is being harvested into by another harvester (it holds the lock "
                               f"on {JOURNAL}): give each harvester its own --output") from None
        try:
            self._load()
        except BaseException:
            os.close(self._fd)
            raise

    def _load(self) -> None:
        with os.fdopen(os.dup(self._fd), "rb") as f:  # the file opened, not whatever the name is now
            f.seek(0)
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            os.ftruncate(self._fd, end)
        for n, line in enumerate(data[:end].splitlines(), 1):
            try:
                entry = json.loads(line)
                if "index" in entry:
                    self.files[int(entry["index"])] = entry
                elif "setup" in entry:
                    self.setup = dict(entry["setup"])
                else:
                    self.rings[str(entry["ring"])] = int(entry["number"])
            except (ValueError, KeyError, TypeError):
                raise ExtractError(f"{self.path}: line {n} is not a journal entry ({line[:80]!r})") from None

    def check_setup(self, setup: dict, out_dir: str) -> None:
        """The files already in --output were made with `setup`, or there are none yet (then it is written):
        files of another --format, --save-dtype or model (its layers, hidden size, dtype) are not one set."""
        before = self.setup
        if before is None:  # a journal of a version that wrote none: the last run's manifest says it
            last_run = previous(out_dir)
            if last_run is not None:
                before = {k: v for k, v in last_run.items() if k in SETUP_KEYS} or None
        if before is not None:
            differ = [k for k in SETUP_KEYS if k in before and before[k] != setup[k]]
            if differ:
                said = "; ".join(f"{k} {before[k]!r} there, {setup[k]!r} now" for k in differ)
                raise ExtractError(f"--output {out_dir} holds files harvested with another setup ({said}): harvest "
                                   "into another --output")
        if self.setup is None:
            self.setup = dict(setup)
            self._append({"setup": self.setup})

    def _append(self, entry: dict) -> None:
        os.write(self._fd, (json.dumps(entry) + "\n").encode())
        os.fsync(self._fd)

    def ring_number(self, ring_id: str) -> int:
        if ring_id not in self.rings:
            self.rings[ring_id] = len(self.rings)
            self._append({"ring": ring_id, "number": self.rings[ring_id]})
        return self.rings[ring_id]

    def add_file(self, entry: dict) -> None:
        self._append(entry)
        self.files[entry["index"]] = entry

    def close(self) -> None:
        """Unlocks; a journal left empty (a run refused before its setup line) is removed, so the folder
        does not look like a harvest's."""
        if os.fstat(self._fd).st_size == 0:
            os.unlink(self.path)
        os.close(self._fd)


def setup_of(output, manifest: dict) -> dict:
    """What the files of this run are (SETUP_KEYS), from the output's --format and --save-dtype (`output`:
    config.OutputSettings) and the server's manifest."""
    return {"format": output.format, "save_dtype": output.save_dtype, "model_path": manifest["model_path"],
            "architecture": manifest["architecture"], "dtype": manifest["dtype"],
            "hidden_size": manifest["hidden_size"], "num_hidden_layers": manifest["num_hidden_layers"],
            "layer_ids": list(manifest["layer_ids"]), "last_hidden_state": manifest["last"]}
