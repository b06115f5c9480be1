"""`python -m sglang_hs.plan`: sizes /dev/shm and the ring for a model and layout.

The code is sglang_hs/tools/plan.py (docs/development.md#code-layout-and-imports)."""
import sys

from sglang_hs.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
