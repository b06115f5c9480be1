"""Reading flags out of a command line (argv as a list of words), as argparse would take them: `--flag value`
or `--flag=value`. The launcher, the supervisor and the self-test read SGLang's flags this way without
parsing them (SGLang's parser is SGLang's, and loading it costs seconds)."""
from __future__ import annotations

from typing import List, Optional


def flag_value(argv: List[str], *flags: str) -> Optional[str]:
    for i, a in enumerate(argv):
        for flag in flags:
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def has_flag(argv: List[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)
