"""The output folder: made, or checked, before anything is written into it (prepare_output).

What else goes in it has a module of its own: the sample files (sinks/), manifest.json (manifest.py), the
trainer's run config (trainers.py), the harvest journal (journal.py); the run's counts are stats.py's and the
capture's checks capture_checks.py's. Their names stay importable from here as before.
"""
from __future__ import annotations

from typing import Optional

from sglang_hs.extract.capture_checks import check_final_state, check_streams  # noqa: F401 (importable here)
from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.manifest import draft_config, write_manifest  # noqa: F401
from sglang_hs.extract.stats import SKIPS_LISTED, SKIPS_PRINTED, Stats, print_summary  # noqa: F401
from sglang_hs.extract.trainers import (DRAFT_VOCAB_SIZE, SPECFORGE_CONFIG, model_vocab_size,  # noqa: F401
                                        print_training_command, specforge_config, training_command)


def prepare_output(out_dir: str, gid: Optional[int]) -> None:
    """--output made, or checked, as the dump dir is (fsutil.ensure_output_dir): this user's folder, not a
    symlink, 0700 (0750 of --output-group); another user's folder (a world-writable tmpfs lets anyone make
    one first) is refused in one line."""
    from sglang_hs.fsutil import ensure_output_dir

    try:
        ensure_output_dir(out_dir, gid)
    except (OSError, ValueError) as e:
        raise ExtractError(str(e)) from None

