"""Run a test module as a script in its own process group (`python FILE NAME TMP`), for scenarios with
DataLoader workers or threads that a hang must not leave behind: the last stdout line is the scenario's
JSON result."""
import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_scenario(script: str, name: str, tmp_path, limit_s: float) -> dict:
    """`script`'s scenario `name`; a hang past `limit_s` (only a hang reaches it) kills the group and fails."""
    path = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]  # tests/: helpers
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.Popen([sys.executable, os.path.abspath(script), name, str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{name}: hung (no end after {limit_s}s); stdout {stdout[-2000:]!r} stderr {stderr[-3000:]!r}")
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])
