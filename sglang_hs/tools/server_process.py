"""Run `python -m sglang_hs.launch_server` as a child process: start, wait until ready, stop cleanly.

Used by the demo, the self-test and the extraction CLI. The launcher's output goes to a log file (its
last lines are shown when start-up fails); `stop()` sends SIGTERM, which the launcher turns into a
clean shutdown of every server process. Its default `grace` outlasts the launcher's own: SGLang's
stop_grace, then the launcher killing the server's session and cleaning up (supervisor.py,
LAUNCHER_EXIT_AFTER_STOP_S). Past `grace` it kills the server's session itself (every process SGLang
started is in it), gives the launcher a moment to clean the dump dir up, then kills the launcher; and
whatever way the launcher ended (killed from outside too), no process of the server's session outlives
stop(): one would hold the GPU's memory, the port and the dump dir, whose lock died with the launcher.
"""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

from sglang_hs.tools.supervisor import LAUNCHER_EXIT_AFTER_STOP_S

READY = "[sglang-hs] server ready"
SESSION = re.compile(r"\[sglang-hs\] server session (\d+)")
STOP_GRACE_S = LAUNCHER_EXIT_AFTER_STOP_S + 30.0  # stop()'s default wait for the launcher (+ a loaded machine)
CLEANUP_WAIT_S = 30.0  # after stop() killed the server's session: the launcher's clean-up of the dump dir
KILL_WAIT_S = 10.0  # how long stop() waits for SIGKILLed server processes to be gone
SESSION_LOG_HEAD = 1 << 20  # the launcher names the server's session among the first lines of its log


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
# free_port() draws from [PORTS_FROM, PORTS_TO), below the ephemeral range and below SGLang's own draw for
# the ports its server processes bind later (sglang.srt.utils.network.get_free_port_below_ephemeral: 22000-29999)
PORTS_FROM, PORTS_TO = 10000, 22000


def _ephemeral_start(path: str = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _family(host: str) -> int:
    """The address family `host` binds in (IPv6 for "::1", a name by its first address)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except OSError:
        return socket.AF_INET


def _bindable(port: int, host: str, family: int) -> bool:
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_port(port: int, proc: "subprocess.Popen", what: str, timeout: float = 60.0, host: str = "127.0.0.1") -> None:
    """Return once `port` on `host` accepts a connection; RuntimeError naming `what` if `proc` exits first or
    `timeout` seconds pass (polled every 50 ms: the port is the published state waited on)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not open port {port} (exit {proc.poll()})") from None
            time.sleep(0.05)


def free_port(host: str = "127.0.0.1", ephemeral_start: Optional[int] = None) -> int:
    """A TCP port free on `host` now, for a server that binds it only once it has started (seconds to
    minutes later). Drawn at random below the kernel's ephemeral range: the kernel also hands ports of
    that range to outgoing connections (the server's own, a client's), and one of them took a port picked
    there before the server bound it, which then failed with "address already in use". Outside it only
    another explicit bind can take the port. Falls back to a port of the kernel's choosing where the range
    leaves no room below it. (SGLang draws the ports of its own server processes the same way.)"""
    top = min(PORTS_TO, _ephemeral_start() if ephemeral_start is None else ephemeral_start)
    family = _family(host)
    if top - PORTS_FROM >= 1000:  # SystemRandom: processes seeded alike (a test, a trainer) still differ
        for port in random.SystemRandom().sample(range(PORTS_FROM, top), 200):
            if _bindable(port, host, family):
                return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_session(output: str) -> Optional[int]:
    """The session id a launcher reported in its output ("[sglang-hs] server session N"), if any."""
    m = SESSION.search(output)
    return int(m.group(1)) if m else None


def _stat(pid) -> Optional[Tuple[str, int, int]]:
    """(state, session id, start time in clock ticks since boot) of process `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[3]), int(fields[19])  # stat fields 3, 6 and 22
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> Optional[int]:
    st = _stat(pid)
    return None if st is None else st[2]


def processes_in_session(sid: int, since: Optional[int] = None) -> List[int]:
    """Live pids of session `sid` (started at or after `since`, a start time, when given): the launcher
    starts the server as a new session, and every process SGLang spawns stays in it (command lines and
    environments are no guide: schedulers rename themselves)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = _stat(d)
        if st is not None and st[1] == sid and st[0] != "Z" and (since is None or st[2] >= since):
            pids.append(int(d))
    return pids


def kill_and_wait(live: Callable[[], List[int]], wait: float = KILL_WAIT_S) -> List[int]:
    """SIGKILL the processes `live()` lists and wait (at most `wait` s) until it lists none; returns the pids
    killed."""
    pids = live()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait
    while pids and live() and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILLed: gone at their next scheduling (one in disk sleep, later)
    return pids


def stop_launcher(proc: "subprocess.Popen", kill_session: Callable[[], List[int]], grace: float,
                  sig: int = signal.SIGTERM) -> bool:
    """Send the launcher `proc` `sig` and wait `grace` s for it; past that, kill its server's session
    (`kill_session`, which returns the pids it killed), wait for the launcher's clean-up, kill the launcher.
    True when it came to that (the launcher did not exit within `grace`)."""
    if proc.poll() is not None:
        return False
    proc.send_signal(sig)
    try:
        proc.wait(grace)
        return False
    except subprocess.TimeoutExpired:
        killed = kill_session()  # the launcher sees its server gone and cleans up
        try:
            proc.wait(CLEANUP_WAIT_S if killed else 0)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        return True


def scheduler_pid(pids: List[int]) -> int:
    """The one of `pids` that is SGLang's scheduler (it renames itself sglang::scheduler...)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sglang::scheduler" in f.read():
                    return pid
        except OSError:
            pass
    raise RuntimeError(f"no SGLang scheduler among processes {sorted(pids)}")


def _child_env(extra: Optional[Dict[str, Optional[str]]]) -> Dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    def __init__(self, launcher_args: List[str], log_path: Optional[str] = None, host: str = "127.0.0.1",
                 launcher: Optional[List[str]] = None, env: Optional[Dict[str, Optional[str]]] = None) -> None:
        """`launcher`: the command that runs the launcher (default: this Python's -m sglang_hs.launch_server).
        `env`: variables the launcher gets on top of this process's environment (None: left out of it)."""
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang-hs-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self._sid: Optional[int] = None
        self._sid_start: Optional[int] = None  # the session leader's start time, read with the session
        self.cmd = [*(launcher or [sys.executable, "-m", "sglang_hs.launch_server"]), *launcher_args,
                    "--host", host, "--port", str(self.port)]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=_child_env(env))
        self._launched = start_time(self.proc.pid)  # our child, not yet waited for: this very launcher

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 1800) -> "ServerProcess":
        t0 = time.monotonic()
        while True:
            with open(self.log_path, errors="replace") as f:
                if READY in f.read():
                    return self
            if self.proc.poll() is not None:
                raise ServerStartError(f"the server exited with {self.proc.returncode} during start-up "
                                       f"(log {self.log_path}):\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerStartError(f"the server was not ready after {timeout:.0f}s (log {self.log_path})")
            time.sleep(0.3)

    def session(self) -> Optional[int]:
        """The server's session id, as the launcher reported it at the head of its log (None before). Its
        leader's start time is read with it: once the leader is gone its pid may be reused."""
        if self._sid is None:
            try:
                with open(self.log_path, "rb") as f:
                    self._sid = server_session(f.read(SESSION_LOG_HEAD).decode(errors="replace"))
            except OSError:
                pass
            if self._sid is not None:
                start = start_time(self._sid)
                if start is not None and (self._launched is None or start >= self._launched):
                    self._sid_start = start  # the leader the launcher started (not a later process of that pid)
        return self._sid

    def _server_processes(self) -> List[int]:
        """Live processes of the server's session; none once that session is gone and its leader's pid leads
        another. (The kernel reuses no pid while a process of its session lives: a leader pid with another
        start time means every process of ours is gone. Those started before our leader, or before the
        launcher when the leader was never seen, are not ours either.)"""
        sid = self.session()
        if not sid:
            return []
        if self._sid_start is not None:
            now = start_time(sid)
            if now is not None and now != self._sid_start:
                return []
        return processes_in_session(sid, since=self._sid_start if self._sid_start is not None else self._launched)

    def pids(self) -> List[int]:
        """The launcher and every process of the server session it reported."""
        return [self.proc.pid] + self._server_processes()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _kill_session(self) -> List[int]:
        """SIGKILL every live process of the server's session and wait (at most KILL_WAIT_S) until none is
        left; returns the pids killed. Only the server's: _server_processes tells them from a later session
        that got the same id after every process of the server's was gone."""
        return kill_and_wait(self._server_processes)

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        """SIGTERM the launcher and wait `grace` s for it; then kill the server's session, wait for the
        launcher's clean-up, kill the launcher. Either way, no process of the server's session survives."""
        self.session()  # read now: the log may be gone once the launcher is
        stop_launcher(self.proc, self._kill_session, grace)
        self._kill_session()  # what a launcher killed (here, or from outside) left running
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
