"""The one place the sglang-hs version and the pinned upstream version are written."""
__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"
