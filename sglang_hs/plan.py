"""`python -m sglang_hs.plan`: sizes /dev/shm and the ring for a model and layout. The code is sglang_hs/tools/plan.py (see docs/development.md, Code layout)."""
import sys

from sglang_hs.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
