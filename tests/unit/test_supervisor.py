"""The supervisor stops a server that does not stop: SIGTERM waits `stop_grace` seconds for SGLang's
own shutdown, then kills every process of the server session; a second signal kills at once."""
import signal
import subprocess
import sys
import time

import pytest

# A "server" that ignores SIGTERM, like SGLang stuck in its lifespan shutdown; it reports its pid.
STUCK = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(600)"
SUPERVISE = ("import sys; from sglang_hs.supervisor import Supervisor; "
             "sys.exit(Supervisor([sys.executable, '-c', sys.argv[1]], 300, None, stop_grace=float(sys.argv[2])).run())")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("grace, signals", [(2.0, 1), (300.0, 2)])
def test_a_server_ignoring_sigterm_is_killed(grace, signals):
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE, STUCK, str(grace)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    child = int(sup.stdout.readline())  # relayed by the supervisor once the child runs
    t0 = time.monotonic()
    for _ in range(signals):
        sup.send_signal(signal.SIGTERM)
        time.sleep(1)
    _, err = sup.communicate(timeout=120)
    assert sup.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 60 and not _alive(child)
    if signals == 1:
        assert "the server did not stop within 2s of SIGTERM; killing its processes" in err
    else:
        assert "SIGTERM again: killing the server's processes now" in err
