"""Start-up that never hangs silently: run the server in its own process group and watch it.

The launcher starts `python -m sglang_hs.server.serve` as a new session, relays its output and reads start-up
phases from it. Start-up fails (non-zero exit, nothing left running) when:
  - the server process exits;
  - no output and no new phase for `startup_timeout` seconds: the stalled phase is named, then each
    process of the group with its CPU use and state and whether the group looks busy (some process burns
    CPU: a loop that does not progress) or blocked (none does: a lock, a collective, a dead peer), then
    the Python stacks of every process (py-spy, else faulthandler via SIGUSR1);
  - while start-up is quiet (no output for `report_every` seconds) the same CPU report, busy or blocked
    without a guess at the cause (a busy quiet start-up may just be working), is logged every
    `report_every` seconds, so a slow phase and a hang can be told apart before the timeout.
  - SGLang finished loading the model, or reports ready, but no process announced the sglang-hs
    overlay (SGLang silently serves its built-in class when the overlay fails to import).
  - the server says it cannot come up (FATAL below: e.g. its HTTP port is taken).
After start-up it relays output until the server exits; SIGINT/SIGTERM stop the whole group (after
`stop_grace` seconds, or at a second signal, by killing it).
A node of rank > 0 (SGLang --nnodes) is stopped with SIGQUIT once it serves: SGLang 0.5.23's main process there
(entrypoints/engine.py, node_rank >= 1) replaces SIGTERM's action with a handler that only logs and waits for
node 0's ShutdownReq broadcast, which never comes when node 1 is stopped alone; its launch-phase SIGQUIT
handler (the one its schedulers use to report a failure) kills its process tree.
Such a node also watches node 0 (--dist-init-addr: the TCP store of global rank 0, there while node 0
serves): unreachable NODE0_LOST_AFTER times in a row, or unreachable when the server exits by itself (SGLang's
schedulers there fail once their collectives lose node 0), the launcher stops with one line naming node 0
(EXIT_NODE0_LOST).
On the way out it kills what is left of the group and removes the files the server left in the dump dir,
and the `/dev/shm/sglang_loads_*.shm` segments SGLang 0.5.23 creates at start-up and never unlinks
(16 KB each; upstream sweeps them only in its own CI), when no live process maps them any more.
So do the named semaphores of Python's multiprocessing (`/dev/shm/sem.mp-*`, spawn context) that the server's
processes were seen to map (noted every second and before each signal, on another thread), once no live
process maps them: their creator's finalizer or the resource tracker (a process of the server session)
would unlink them, and neither runs when it is killed.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

from sglang_hs.fsutil import LOCK_NAME, NO_WRITER

# (pattern in SGLang 0.5.23's start-up log, phase entered). Any output also counts as progress.
PHASES = [
    (re.compile(rb"Init parallel begin"), "initialising parallel groups"),
    (re.compile(rb"Load weight begin"), "loading weights"),
    (re.compile(rb"\[sglang-hs\] overlay ready"), OVERLAY := "overlay constructed"),
    (re.compile(rb"Load weight end"), LOADED := "allocating the KV cache"),
    (re.compile(rb"KV Cache is allocated|Memory pool end"), "graph capture and scheduler start"),
    (re.compile(rb"Uvicorn running on"), "server warm-up"),
    (re.compile(rb"fired up and ready to roll"), "ready"),
    # a node of rank > 0 (--nnodes): no HTTP server; sglang_hs.server.serve.announce_node_ready says this instead
    (re.compile(rb"\[sglang-hs\] node \d+ of \d+: schedulers ready"), "ready"),
]

# Lines after which the server cannot come up. SGLang 0.5.23 would not exit by itself: when uvicorn
# cannot bind the port, its lifespan joins the warm-up thread, which polls the dead port for ~12 min.
FATAL = [
    (re.compile(rb"error while attempting to bind on address[^\n]*"),
     "the HTTP server cannot listen ({line}); choose a free --port, or another --host"),
]

EXIT_STALL = 3
EXIT_NO_OVERLAY = 4
EXIT_FATAL = 5
EXIT_NODE0_LOST = 6  # a node of rank > 0 whose node 0 went away
NODE0_PROBE_EVERY_S = 5.0  # a node of rank > 0 serving: how often it connects to node 0's --dist-init-addr
NODE0_PROBE_TIMEOUT_S = 5.0  # the wait for one such connection (a machine that is down answers nothing)
NODE0_LOST_AFTER = 3  # failed connections in a row that make node 0 gone
STOP_GRACE_S = 60.0  # after SIGTERM/SIGINT, how long SGLang may take to stop before its processes are killed
SHUTDOWN_GRACE_S = 15.0  # then: SIGTERM to the main process, then the group, each half of this, then SIGKILL
KILL_WAIT_S = 10.0  # how long the exit waits for the SIGKILLed group to be gone
RELAY_JOIN_S = 5.0  # and for the output relay to read what is left
REPORT_EVERY_MAX_S = 60.0  # a quiet start-up logs CPU use every min(this, startup_timeout / 4) seconds
BUSY_CPU_PCT = 10.0  # a process using at least this share of one core over the interval "uses CPU"
NOTE_EVERY_S = 1.0  # how often the server's semaphores are noted during start-up (off the main thread: _noter)
NOTE_EVERY_SERVING_S = 15.0  # and once it serves (each note takes every server process's mmap lock a moment)
NOTE_WAIT_S = 1.0  # how long a signal waits for one more note before it is sent anyway
PY_SPY_TIMEOUT_S = 30.0  # the stall report's wait for py-spy's dump of one process's stacks
SCAN_WAIT_S = 10.0  # how long the exit waits for the scan of every process's maps before keeping the semaphores
SEM_GLOB = "/dev/shm/sem.mp-*"  # Python multiprocessing's named semaphores (sem_open("/mp-..."))
# The longest the launcher takes from a stop signal to its exit: SGLang's grace, the escalation (a note of
# the semaphores before each of its four signals), the relay, the semaphore scan. A parent that stops the
# launcher (server_process.ServerProcess.stop) waits longer than this before it kills anything itself.
LAUNCHER_EXIT_AFTER_STOP_S = (STOP_GRACE_S + SHUTDOWN_GRACE_S + 4 * NOTE_WAIT_S + KILL_WAIT_S + RELAY_JOIN_S
                              + SCAN_WAIT_S)


def log(msg: str) -> None:
    try:
        print(f"[sglang-hs] {msg}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed by the parent: the launcher carries on without it
        _to_nowhere(sys.stderr)


def log_raw(text: str) -> None:
    """`text` as it is on stderr (a stack dump)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _to_nowhere(sys.stderr)


def _to_nowhere(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null (its reader is gone): what it still holds and whatever
    is written to it later, also Python's flush at exit, goes nowhere instead of failing."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def _py_spy() -> Optional[str]:
    found = shutil.which("py-spy")
    if found:
        return found
    for base in {sysconfig.get_paths()["scripts"], os.path.dirname(sys.executable)} | {
        os.path.normpath(os.path.join(p, "..", "..", "..", "bin")) for p in sys.path if p.endswith("site-packages")
    }:
        cand = os.path.join(base, "py-spy")
        if os.access(cand, os.X_OK):
            return cand
    return None


def _py_spy_dump(spy: str, pid: int) -> Tuple[Optional[str], bool]:
    """(py-spy's dump of `pid`'s Python stacks, or None when it failed; whether it hung). A py-spy still
    running after PY_SPY_TIMEOUT_S (a process it cannot stop, a ptrace that blocks) is killed with
    anything it started: it runs in its own session, killed as a group."""
    try:
        p = subprocess.Popen([spy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    except OSError as e:
        log(f"py-spy could not run ({e}); the stacks come from faulthandler instead")
        return None, False
    try:
        out, _ = p.communicate(timeout=PY_SPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # unkillable for now (disk sleep): not waited for
            pass
        return None, True
    return (out if p.returncode == 0 else None), False


class ProcSample(NamedTuple):
    name: str
    cpu_s: float  # user + system CPU seconds so far, all its threads together (a spinning thread counts)
    state: str  # of its main thread: running, sleeping, disk-sleep, zombie, ...
    threads: int
    running: int  # threads running or runnable (R) at the sample


Snapshot = Tuple[float, Dict[int, ProcSample]]  # (time.monotonic(), samples by pid)


def sample_processes(pids: List[int]) -> Snapshot:
    import psutil  # an SGLang dependency; imported here so importing this module stays light

    samples = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                t = p.cpu_times()
                samples[pid] = ProcSample(p.name(), t.user + t.system, p.status(), p.num_threads(),
                                          _running_threads(pid))
        except psutil.Error:  # gone meanwhile
            pass
    return time.monotonic(), samples


def _stat_fields(path: str) -> Optional[List[bytes]]:
    """The fields of a /proc/.../stat file after the command name (fields 3 on: state first), or None
    when the process or thread is gone."""
    try:
        with open(path, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _running_threads(pid: int) -> int:
    n = 0
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        fields = _stat_fields(stat)
        n += bool(fields) and fields[0] == b"R"
    return n


def cpu_report(prev: Snapshot, cur: Snapshot, stalled: bool = False) -> List[str]:
    """Each process's CPU use between two snapshots and a verdict: busy if any process used CPU, else
    blocked; what that suggests only for a stall (a quiet start-up that is busy may be working).
    A process absent from `prev` started in the interval: its CPU since then counts."""
    span = max(cur[0] - prev[0], 1e-3)
    lines, busy = [f"CPU use of the server's processes over the last {span:.0f}s:"], 0
    for pid, s in sorted(cur[1].items()):
        before = prev[1].get(pid)
        pct = 100.0 * (s.cpu_s - (before.cpu_s if before else 0.0)) / span
        busy += pct >= BUSY_CPU_PCT
        lines.append(f"  pid {pid} {s.name}: cpu {pct:.0f}%, main thread {s.state}, {s.running} of {s.threads} "
                     "threads running"
                     + ("" if before else " (started in the interval)"))
    if busy:
        why = ": a loop that does not progress, e.g. a warm-up retrying" if stalled else ""
        lines.append(f"looks busy ({busy} process{'es' if busy > 1 else ''} using CPU{why})")
    else:
        why = ": waiting on a lock, a collective or a dead peer" if stalled else ""
        lines.append(f"looks blocked (no process uses CPU{why})")
    return lines


class Supervisor:
    def __init__(self, cmd: List[str], startup_timeout: float, dump_dir: Optional[str],
                 stop_grace: float = STOP_GRACE_S, report_every: Optional[float] = None) -> None:
        self.cmd, self.startup_timeout, self.dump_dir, self.stop_grace = cmd, startup_timeout, dump_dir, stop_grace
        self.report_every = report_every or min(REPORT_EVERY_MAX_S, startup_timeout / 4)
        self._snapshots: List[Snapshot] = []  # the last two CPU samples of the group, every report_every s
        self.fatal: Optional[str] = None  # why start-up cannot succeed, from the server's output
        self.stop_at: Optional[float] = None  # when the first stop signal arrived
        self.phase = "starting the server process"
        self.phase_since = self.last_progress = time.monotonic()
        self.ready = False
        self.seen: set = set()  # phases whose log line has appeared, in any order
        self.stop_signal: Optional[int] = None
        self.started_at = time.time()
        self.proc: Optional[subprocess.Popen] = None
        self._pgid: Optional[int] = None
        self._sems_before: set = set()  # ((dev, ino), path) of the semaphores present before the server started
        self._server_sems: Dict[Tuple[int, int], str] = {}  # those the server's processes were seen to map
        self._sems_lock = threading.Lock()  # _server_sems: noted by the noter and at signals, read by cleanup
        self._stop_noting = threading.Event()
        self._wake = threading.Event()  # the main loop's nap ends early: the server is ready (the relay saw it)
        self._server_started_ticks: Optional[int] = None
        self.node0_lost: Optional[str] = None  # why node 0 is gone (a node of rank > 0 watching it), set by _watch_node0

    # -- output relay and phase tracking (reader thread) --
    def _relay(self) -> None:
        """Copy the server's output to ours and read phases from it. Ours may close under it (a parent
        that stopped reading): it then goes on reading, else the server would block writing its log."""
        out = sys.stdout.buffer
        pending = b""
        while True:
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                break
            if out is not None:
                try:
                    out.write(chunk)
                    out.flush()
                except (OSError, ValueError) as e:  # BrokenPipeError: nobody reads our output any more
                    out = None
                    _to_nowhere(sys.stdout)
                    log(f"warning: the server's output cannot be relayed any more ({type(e).__name__}: the "
                        "launcher's stdout was closed); it is read on and dropped")
            self.last_progress = time.monotonic()
            pending = (pending + chunk)[-4096:]
            for pattern, message in FATAL:
                m = pattern.search(pending)
                if m and self.fatal is None:
                    self.fatal = message.format(line=m.group(0).decode(errors="replace").strip())
            for pattern, phase in PHASES:
                if phase not in self.seen and pattern.search(pending):
                    self.seen.add(phase)
                    if not self.ready:
                        self._enter(phase)
            # keep only the tail after the last newline so one line is not matched twice
            nl = pending.rfind(b"\n")
            if nl >= 0:
                pending = pending[nl + 1 :]

    def _enter(self, phase: str) -> None:
        now = time.monotonic()
        log(f"start-up phase: {phase} (after {now - self.phase_since:.1f}s in {self.phase})")
        self.phase, self.phase_since = phase, now
        if phase == "ready":
            self.ready = True
            self._wake.set()  # say "server ready" now, not at the main loop's next look

    # -- signals --
    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is not None:  # a second signal: no more waiting
            log(f"{signal.Signals(signum).name} again: killing the server's processes now")
            self._signal_group(signal.SIGKILL)
            return
        self.stop_signal, self.stop_at = signum, time.monotonic()
        self._terminate_server()

    def _terminate_server(self) -> None:
        # The server's main process first: SGLang then stops its own children in order. On a serving node of
        # rank > 0 SGLang ignores SIGTERM (module docstring): SIGQUIT, which it honours there.
        self._note_semaphores_soon()
        try:
            self.proc.send_signal(signal.SIGQUIT if self.ready and self.node_rank() > 0 else signal.SIGTERM)
        except (ProcessLookupError, AttributeError):
            pass

    # -- node 0, seen from a node of rank > 0 --
    def node0_address(self) -> Optional[Tuple[str, int]]:
        """(host, port) of --dist-init-addr on a node of rank > 0, else None."""
        from sglang_hs.tools.argv import flag_value

        addr = flag_value(self.cmd, "--dist-init-addr")
        if self.node_rank() <= 0 or not addr or ":" not in addr:
            return None
        host, port = addr.rsplit(":", 1)
        try:
            return host.strip("[]"), int(port)
        except ValueError:
            return None

    def node0_reachable(self, address: Tuple[str, int]) -> bool:
        import socket

        try:
            socket.create_connection(address, timeout=NODE0_PROBE_TIMEOUT_S).close()
            return True
        except OSError:
            return False

    def _node0_gone(self, address: Tuple[str, int], how: str) -> str:
        return (f"node 0 (--dist-init-addr {address[0]}:{address[1]}) went away ({how}): node {self.node_rank()} "
                "cannot serve without it; stopping (the records completed here stay readable in its dump)")

    def _watch_node0(self, address: Tuple[str, int]) -> None:
        failed = 0
        while not self._stop_noting.wait(NODE0_PROBE_EVERY_S):
            failed = 0 if self.node0_reachable(address) else failed + 1
            if failed >= NODE0_LOST_AFTER:
                self.node0_lost = self._node0_gone(address, f"unreachable {failed} times in a row, "
                                                            f"{NODE0_PROBE_EVERY_S:g}s apart")
                return

    def _signal_group(self, sig: int) -> None:
        self._note_semaphores_soon()
        try:
            os.killpg(self._pgid, sig)
        except (ProcessLookupError, PermissionError, TypeError):
            pass

    def _group_pids(self) -> List[int]:
        pids = []
        for d in glob.glob("/proc/[0-9]*"):
            try:
                if os.getpgid(int(d[6:])) == self._pgid:
                    pids.append(int(d[6:]))
            except (OSError, ValueError):
                pass
        return sorted(pids)

    def _live_group_pids(self) -> List[int]:
        """The server's processes but the dead ones not yet reaped (zombies map nothing)."""
        return [p for p in self._group_pids() if not _zombie(p)]

    def _note_semaphores(self) -> None:
        """The multiprocessing semaphores the server's processes map now are theirs (to remove once it is
        killed). Reads their /proc/PID/maps, which waits for each one's mmap lock: a hung process may hold
        it, so this never runs on the main thread (_noter, _note_semaphores_soon)."""
        if self._pgid is None:
            return
        mapped = mapped_sem_inodes(self._group_pids())
        if mapped:
            found = {key: path for key, path in semaphores().items() if key in mapped}
            with self._sems_lock:
                self._server_sems.update(found)

    def _noter(self) -> None:
        while not self._stop_noting.wait(NOTE_EVERY_SERVING_S if self.ready else NOTE_EVERY_S):
            self._note_semaphores()

    def _note_semaphores_soon(self) -> None:
        """Before a signal: one more note, waited for at most NOTE_WAIT_S; the signal goes out regardless,
        also when no thread can be started (a server stalled at the process's thread limit)."""
        try:
            t = threading.Thread(target=self._note_semaphores, name="note-semaphores", daemon=True)
            t.start()
            t.join(NOTE_WAIT_S)
        except Exception as e:  # noqa: BLE001 - noting is housekeeping; stopping the server is not
            log(f"warning: could not note the server's semaphores before signalling it: {e!r}")

    def _sample(self) -> Snapshot:
        snap = sample_processes(self._group_pids())
        self._snapshots = self._snapshots[-1:] + [snap]
        return snap

    def _report_quiet_startup(self) -> None:
        prev, cur = self._snapshots[-1], self._sample()
        quiet = cur[0] - self.last_progress
        if quiet >= self.report_every:
            log(f"start-up quiet for {quiet:.0f}s in phase '{self.phase}'")
            for line in cpu_report(prev, cur):
                log(line)

    def report_stall(self) -> None:
        prev = self._snapshots[-1]
        if time.monotonic() - prev[0] < self.report_every / 2:  # too recent to say much: the one before
            prev = self._snapshots[0]
        for line in cpu_report(prev, self._sample(), stalled=True):
            log(line)

    def dump_stacks(self) -> None:
        spy = _py_spy()
        for pid in self._group_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                continue
            log(f"Python stacks of pid {pid} ({cmdline.strip()}):")
            stacks, hung = _py_spy_dump(spy, pid) if spy else (None, False)
            if hung:  # (one that hangs on this process would likely hang on the next: faulthandler for them)
                log(f"py-spy did not answer within {PY_SPY_TIMEOUT_S:.0f}s for pid {pid}: killed it; the stacks "
                    "come from faulthandler instead")
                spy = None
            if stacks is not None:
                log_raw(stacks)
            else:  # faulthandler (registered by sglang_hs.server.serve in every process) writes to our pipe
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)  # let the relay thread print what faulthandler wrote

    def _shutdown_group(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        if self._pgid is None:
            return
        self._terminate_server()
        deadline = time.monotonic() + grace / 2
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace / 2
        # live ones: a dead child of the server's main process (SGLang SIGKILLs its resource tracker as it exits)
        # stays a zombie until init reaps it, which holds nothing and may take init a while
        while self._live_group_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._signal_group(signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while self.proc.poll() is None or self._live_group_pids():
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)

    def _cleanup_dump_dir(self) -> None:
        """The stores and status files always go; the output rings and the manifest stay after a server
        that served, so a reader can drain what is left (the next server replaces them)."""
        if not self.dump_dir:
            return
        # (.overlay-*.tmp: a status rewrite its process was killed in the middle of)
        patterns = ["overlay-*.json", ".overlay-*.json.*.tmp", "store-*.bin", LOCK_NAME]  # LOCK_NAME: it exits next
        if not self.ready:
            # the offset file: its reader's (ring.py); NO_WRITER: a node without writers says so (launch_server)
            patterns += ["ring-*.bin", "ring-*.offset", "manifest.json", NO_WRITER]
        for path in (p for pat in patterns for p in glob.glob(os.path.join(self.dump_dir, pat))):
            try:
                os.unlink(path)
            except OSError:
                pass

    def _cleanup_sglang_shm(self) -> None:
        # sgl_shm_mq_*: the request broadcast queue of a server with more than one rank (SGLang leaves it)
        candidates = [p for pat in ("/dev/shm/sglang_loads_*.shm", "/dev/shm/sgl_shm_mq_*") for p in glob.glob(pat)
                      if _mtime(p) >= self.started_at - 1]
        if not candidates:
            return
        mapped = mapped_shm(("/dev/shm/sglang_loads_", "/dev/shm/sgl_shm_mq_"))
        for path in candidates:
            if path not in mapped:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _cleanup_semaphores(self) -> None:
        """The server's semaphores (its processes were seen to map them, they were made after it started, the
        same file still) that no live process maps any more: nothing can unlink them after a kill."""
        now = semaphores()
        with self._sems_lock:
            noted = list(self._server_sems.items())
        left = [(key, path) for key, path in noted if now.get(key) == path and (key, path) not in self._sems_before]
        if not left or self._live_group_pids():  # a server process outlived SIGKILL (D state): still maps them
            return
        # Every process's maps, read on a thread waited for at most SCAN_WAIT_S: a process hung with its
        # mmap lock held must not keep the launcher from exiting (an unfinished scan removes nothing).
        result: List[Optional[set]] = []

        def scan() -> None:
            pids = (int(d[6:]) for d in glob.glob("/proc/[0-9]*"))
            result.append(mapped_sem_inodes(pids, unknown_if_started_after=self._server_started_ticks or 0))

        scanner = threading.Thread(target=scan, name="scan-semaphores", daemon=True)
        scanner.start()
        scanner.join(SCAN_WAIT_S)
        mapped = result[0] if result else None
        if mapped is None:  # unfinished, or a process started since the server could not be read: it may hold one
            return
        for key, path in left:
            if key not in mapped:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def run(self) -> int:
        self._sems_before = set(semaphores().items())
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._pgid = self.proc.pid
        self._server_started_ticks = _start_ticks(self._pgid)
        log(f"server session {self._pgid}: every server process runs in it")
        try:
            threading.Thread(target=self._noter, name="note-semaphores", daemon=True).start()
        except Exception as e:  # noqa: BLE001 - no thread to be had: the server runs, its semaphores may stay
            log(f"warning: not noting the server's semaphores: {e!r}")
        self._sample()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        relay = threading.Thread(target=self._relay, name="relay", daemon=True)
        relay.start()
        code = 0
        try:
            while self.proc.poll() is None:
                self._wake.wait(0.2)
                self._wake.clear()
                if self.stop_signal is not None:
                    if time.monotonic() - self.stop_at > self.stop_grace:
                        log(f"the server did not stop within {self.stop_grace:.0f}s of "
                            f"{signal.Signals(self.stop_signal).name}; killing its processes")
                        break
                    continue
                if self.node0_lost is not None:
                    log(self.node0_lost)
                    code = EXIT_NODE0_LOST
                    break
                if self.fatal is not None:
                    log(f"error: {self.fatal}; stopping the server")
                    code = EXIT_FATAL
                    break
                if not self.ready and time.monotonic() - self.last_progress > self.startup_timeout:
                    log(
                        f"start-up stalled in phase '{self.phase}': no progress for {self.startup_timeout:.0f}s "
                        "(--hs-startup-timeout); CPU use and Python stacks follow, then the server is stopped"
                    )
                    self.report_stall()
                    self.dump_stacks()
                    code = EXIT_STALL
                    break
                if (LOADED in self.seen or self.ready) and OVERLAY not in self.seen:
                    log(
                        "error: SGLang loaded the model but the sglang-hs overlay never announced itself; SGLang "
                        "fell back to its built-in model class (look for 'Ignore import error' above)"
                    )
                    code = EXIT_NO_OVERLAY
                    break
                if not self.ready and time.monotonic() - self._snapshots[-1][0] >= self.report_every:
                    self._report_quiet_startup()
                if self.ready and self.phase == "ready":
                    log(f"server ready: {self.server_url()}" if not self.node_rank() else
                        f"server ready: node {self.node_rank()} (no HTTP server on this node: requests go to "
                        f"node 0's, {self.server_url()} there)")
                    self.phase = "serving"
                    node0 = self.node0_address()
                    if node0 is not None:
                        threading.Thread(target=self._watch_node0, args=(node0,), name="watch-node0",
                                         daemon=True).start()
        finally:
            self._shutdown_group()
            self._stop_noting.set()
            relay.join(timeout=RELAY_JOIN_S)
            for cleanup in (self._cleanup_dump_dir, self._cleanup_sglang_shm, self._cleanup_semaphores):
                try:  # each on its own: a failure here must not hide the server's own outcome
                    cleanup()
                except Exception as e:  # noqa: BLE001 - logged; the exit status below is the server's
                    log(f"warning: {cleanup.__name__.lstrip('_')} failed: {e!r}")
        if code:
            return code
        if self.stop_signal is not None:
            log(f"stopped by {signal.Signals(self.stop_signal).name}; all server processes are gone")
            return 128 + self.stop_signal
        rc = self.proc.returncode
        node0 = self.node0_address() if self.ready else None
        if node0 is not None and not self.node0_reachable(node0):  # SGLang's schedulers here lost node 0
            log(self._node0_gone(node0, f"unreachable as this node's server exited with status {rc}"))
            return EXIT_NODE0_LOST
        if rc != 0:
            log(f"server exited with status {rc} during '{self.phase}'")
            return rc if rc > 0 else 128 - rc  # negative: killed by signal -rc
        return 0

    def node_rank(self) -> int:
        from sglang_hs.tools.argv import flag_value

        return int(flag_value(self.cmd, "--node-rank") or 0)

    def server_url(self) -> str:
        from sglang_hs.tools.argv import flag_value

        args = self.cmd
        host = flag_value(args, "--host") or "127.0.0.1"
        port = flag_value(args, "--port") or "30000"
        return f"http://{host}:{port}"


def mapped_shm(prefixes) -> set:
    """Paths starting with one of `prefixes` that some live process maps (read from /proc/*/maps): a
    segment of a server still running, never one to remove."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if any(p in line for p in prefixes))
        except OSError:
            pass
    return mapped


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def semaphores() -> Dict[Tuple[int, int], str]:
    """The multiprocessing semaphores in /dev/shm by (device, inode)."""
    found = {}
    for path in glob.glob(SEM_GLOB):
        try:
            st = os.stat(path)
        except OSError:  # unlinked meanwhile
            continue
        found[(st.st_dev, st.st_ino)] = path
    return found


def _zombie(pid: int) -> bool:
    """Dead, not yet reaped by its parent (/proc/PID/stat state Z): it maps nothing any more."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return bool(fields) and fields[0] == b"Z"


def _start_ticks(pid: int) -> Optional[int]:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22, readable for any
    process); None when it is gone."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def mapped_sem_inodes(pids, unknown_if_started_after: Optional[int] = None) -> Optional[set]:
    """(device, inode) of the POSIX semaphores (`.../sem.*` files) the processes `pids` map. By inode, not
    by name: glibc's sem_open makes a semaphore under a temporary name, maps it, links it to its name and
    deletes the temporary one, so its creator's maps name a deleted file (`/dev/shm/sem.XXXXXX (deleted)`);
    and by `/sem.` in any folder, as a process in another mount namespace may see /dev/shm elsewhere.
    With `unknown_if_started_after` (clock ticks since boot), None when the maps of a live process that
    started since then could not be read: it may map any of them. (A process that cannot be read started
    before: init and other non-dumpable daemons, whose maps even root may not read without CAP_SYS_PTRACE;
    none of them opens a semaphore made later by a server's multiprocessing.)"""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    if b"/sem." not in line:
                        continue
                    try:
                        dev, ino = line.split(None, 5)[3:5]
                        major, minor = dev.split(b":")
                        found.add((os.makedev(int(major, 16), int(minor, 16)), int(ino)))
                    except ValueError:
                        continue
        except PermissionError:
            started = _start_ticks(pid)
            if unknown_if_started_after is not None and started is not None and started >= unknown_if_started_after:
                return None
        except OSError:  # gone meanwhile
            pass
    return found
