import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import env_at_start  # noqa: E402,F401 - first: os.environ before any test module is imported

pytest_plugins = ["strict_skips", "parts"]
