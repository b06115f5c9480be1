"""Reading flags out of a command line (argv as a list of words), as argparse would take them: `--flag value`
or `--flag=value`. The launcher, the supervisor and the self-test read SGLang's flags this way without
parsing them (SGLang's parser is SGLang's, and loading it costs seconds)."""
from __future__ import annotations

from typing import List, Optional


def flag_value(argv: List[str], *flags: str) -> Optional[str]:
    """The value of the last of `flags` given (argparse's: a flag given twice takes its last value), else None."""
    value = None
    for i, a in enumerate(argv):
        for flag in flags:
            if a == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
    return value


def has_flag(argv: List[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)
