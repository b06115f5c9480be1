"""The extraction CLI: `python -m sglang_hs.extract` (see sglang_hs/extract/cli.py)."""
