"""The extraction's one-line errors, and the command's name they are printed under: shared by the command
line (cli.py), the harvester (harvest.py) and the live dataset (sglang_hs/live.py)."""
from __future__ import annotations

PROG = "python -m sglang_hs.extract"


class ExtractError(RuntimeError):
    """A one-line error for the user; the run exits non-zero after writing what it completed."""
