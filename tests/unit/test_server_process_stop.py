"""ServerProcess.stop() (sglang_hs/tools/server_process.py) leaves no process of the server's session: not when
the launcher outlasts stop()'s grace (it kills the session itself, the launcher then cleans up and exits),
not when the launcher was killed from outside. A real tree: the real Supervisor as the launcher, over a
"server" that ignores SIGTERM and has a child that ignores it too (SGLang's scheduler stuck in a
collective, holding the GPU's memory and the port)."""
import inspect
import re
import signal
import sys
import time

from sglang_hs.tools import server_process as sp
from sglang_hs.tools.supervisor import LAUNCHER_EXIT_AFTER_STOP_S, STOP_GRACE_S
# The launcher: the real supervisor with its SGLang grace (argv[2]) around the server (argv[1]), as
# test_supervisor runs it; it ignores the --host/--port ServerProcess adds.
from test_supervisor import SUPERVISE as LAUNCHER, _alive  # noqa: E402

DEAF_WITH_CHILD = (
    "import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(1, flush=True); time.sleep(600)'], stdout=subprocess.PIPE); c.stdout.readline(); "
    "print('pids', os.getpid(), c.pid, flush=True); time.sleep(600)")


def _started(server, timeout=120):
    """The server's pid and its child's, once the server says them (relayed into the launcher's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"^pids (\d+) (\d+)$", open(server.log_path).read(), re.M)
        if m:
            return int(m.group(1)), int(m.group(2))
        assert server.alive(), server.log_tail()
        time.sleep(0.1)
    raise AssertionError(f"the stand-in server did not start:\n{server.log_tail()}")


def _server(grace_in_launcher="300"):
    return sp.ServerProcess([DEAF_WITH_CHILD, grace_in_launcher], launcher=[sys.executable, "-c", LAUNCHER])


def test_stop_kills_the_session_when_the_launcher_outlasts_its_grace():
    """stop()'s grace ends while the launcher still gives SGLang its own: the session is killed by stop(),
    and the launcher, its server gone, cleans up and exits by itself (not killed: its dump-dir clean-up ran)."""
    server = _server()
    try:
        pids = _started(server)
        sid = server.session()
        assert sid == pids[0] and sorted(sp.processes_in_session(sid)) == sorted(pids)
        rc = server.stop(grace=1)
        assert not any(_alive(p) for p in pids), "a server process outlived stop()"
        assert sp.processes_in_session(sid) == []
        assert rc == 128 + signal.SIGTERM, server.log_tail()  # the launcher's own exit, after its clean-up
        assert "stopped by SIGTERM; all server processes are gone" in server.log_tail()
    finally:
        server.proc.kill()
        server._kill_session()


def test_stop_after_the_launcher_was_killed_leaves_no_server_process():
    """A launcher SIGKILLed from outside (the OOM killer, a job scheduler) leaves its server's session running,
    holding the port and the dump dir whose lock died with it: stop() kills it."""
    server = _server()
    try:
        pids = _started(server)
        server.proc.kill()
        server.proc.wait(60)
        assert all(_alive(p) for p in pids)  # orphaned, still running
        assert server.stop() == -signal.SIGKILL
        assert not any(_alive(p) for p in pids), "a server process outlived stop()"
    finally:
        server._kill_session()


def test_stops_default_grace_outlasts_the_launchers_own_shutdown():
    """Killing the launcher while it still waits for SGLang (60 s) or escalates would orphan the server:
    stop() waits longer than the launcher can take before it kills anything itself."""
    default = inspect.signature(sp.ServerProcess.stop).parameters["grace"].default
    assert LAUNCHER_EXIT_AFTER_STOP_S > STOP_GRACE_S and default > LAUNCHER_EXIT_AFTER_STOP_S, \
        (default, LAUNCHER_EXIT_AFTER_STOP_S)


def test_stop_never_kills_a_later_session_that_got_the_servers_session_id():
    """Once every process of the server's session is gone, the kernel may hand its leader's pid to a new
    process that leads a session of its own (pid reuse): stop() must leave that one alone. The server's
    leader start time is read with the session; here the recorded session is an unrelated live session
    whose leader started after the one recorded (before: stop() killed every process of that id)."""
    import subprocess

    server = _server()  # a real launcher and server, stopped first: then the session id is stale
    pids = _started(server)
    assert server.session() == pids[0]
    server.stop(grace=1)
    assert not any(_alive(p) for p in pids)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        # the kernel gave the server leader's pid to `victim` (simulated: the stale record names its pid)
        server._sid = victim.pid
        assert sp.processes_in_session(victim.pid) == [victim.pid]
        server.stop()
        server._kill_session()
        assert _alive(victim.pid) and server.pids() == [server.proc.pid], "stop() killed an unrelated session"
    finally:
        victim.kill()
        victim.wait(30)
