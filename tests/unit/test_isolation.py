"""Collecting the suite leaves the process as it found it: every server a later test starts inherits this
process's environment (a module that set TRITON_INTERPRET=1 at import made every later server interpret
its kernels)."""
import os

import env_at_start

SERVER_RELEVANT = ("TRITON_INTERPRET", "SGLANG_USE_CPU_ENGINE", "SGLANG_HS_TEST_FINISH_DELAY", "SGLANG_HS_TESTING",
                   "SGLANG_INIT_NEW_TOKEN_RATIO", "TORCHDYNAMO_DISABLE")


def test_the_environment_after_collection_is_the_one_the_suite_started_with():
    changed = {k: (env_at_start.ENV.get(k), os.environ.get(k)) for k in SERVER_RELEVANT
               if env_at_start.ENV.get(k) != os.environ.get(k)}
    assert not changed, f"set by a test module at import, or by a test that did not undo it: {changed}"
