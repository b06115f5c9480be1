import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# libgomp's default spin-wait, in the test process and every child it starts (HF references, row judges,
# trainers' steps, the extraction CLI; servers get the launcher's PASSIVE anyway): on two cores shared with
# the servers and the other part, an idle OpenMP thread spinning for its turn burns the CPU the servers need.
# Measured on this 2-core machine under load: one float32 forward of the tiny V3 over 40 tokens took 2.0 s of
# CPU with libgomp's default wait and 2 threads, 40 ms with PASSIVE. Read by libgomp when torch loads it,
# so before anything imports torch; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import env_at_start  # noqa: E402,F401 - first: os.environ before any test module is imported

pytest_plugins = ["strict_skips", "parts"]
