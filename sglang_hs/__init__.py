"""sglang-hs: SGLang with a correct, fast hidden-state dump for training EAGLE-3 drafters.

Importing this package is cheap and never loads SGLang, torch or the compiled extension.
"""
from sglang_hs.version import SGLANG_VERSION, __version__

__all__ = ["__version__", "SGLANG_VERSION"]
