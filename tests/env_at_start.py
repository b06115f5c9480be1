"""os.environ as it was before any test module was imported (tests/conftest.py imports this first;
tests/unit/test_isolation.py checks that collecting the suite leaves it so)."""
import os

ENV = dict(os.environ)
