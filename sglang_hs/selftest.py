"""`python -m sglang_hs.selftest`: the self-test (serve a model, judge its rows against HF).

The code is sglang_hs/tools/selftest.py (docs/development.md#code-layout-and-imports)."""
import sys

from sglang_hs.tools.selftest import main

if __name__ == "__main__":
    sys.exit(main())
