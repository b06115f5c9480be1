"""`python -m sglang_hs.launch_server`: the launcher (SGLang's launch_server with capture).

The code is sglang_hs/tools/launch_server.py (docs/development.md#code-layout-and-imports)."""
import sys

from sglang_hs.tools.launch_server import main

if __name__ == "__main__":
    sys.exit(main())
