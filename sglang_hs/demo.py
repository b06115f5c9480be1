"""`python -m sglang_hs.demo`: the demo `make demo` runs.

The code is sglang_hs/tools/demo.py (docs/development.md#code-layout-and-imports)."""
import sys

from sglang_hs.tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
