"""sglang-hs: SGLang with a correct, fast hidden-state dump for training EAGLE-3 drafters.

Importing this package is cheap and never loads SGLang, torch or the compiled extension.

Layout (docs/development.md#code-layout-and-imports): server/ runs inside SGLang's processes (overlay models,
patches, store, copy kernel); reader.py, live.py and extract/ read the dump; tools/ holds the launcher, plan,
selftest and demo, whose commands are the top-level launch_server, plan, selftest and demo modules.
"""
from sglang_hs.version import SGLANG_VERSION, __version__

__all__ = ["__version__", "SGLANG_VERSION", "HiddenStateReader", "NotCaptured", "ServerRestarted"]


def __getattr__(name):
    if name in ("HiddenStateReader", "NotCaptured", "ServerRestarted"):  # lazily: importing sglang_hs stays cheap
        from sglang_hs import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'sglang_hs' has no attribute {name!r}")
