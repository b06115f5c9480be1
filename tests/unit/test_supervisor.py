"""The supervisor stops a server that does not stop: SIGTERM waits `stop_grace` seconds for SGLang's
own shutdown, then kills every process of the server session; a second signal kills at once.
A start-up that stalls is reported with each process's CPU use and state, and whether it looks busy or blocked.
On the way out the multiprocessing semaphores the killed server's processes held are removed, no other one."""
import _multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from sglang_hs.tools.supervisor import EXIT_STALL, ProcSample, cpu_report

# A "server" that ignores SIGTERM, like SGLang stuck in its lifespan shutdown; it reports its pid.
STUCK = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(600)"
SUPERVISE = ("import sys; from sglang_hs.tools.supervisor import Supervisor; "
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


# A server whose output is more than a pipe holds (4 MB): it blocks writing once nobody reads its pipe.
CHATTY = ("import os, sys; print(os.getpid(), flush=True)\n"
          "for _ in range(4096): sys.stdout.write('x' * 1023 + '\\n')\nsys.stdout.flush()")


def test_the_relay_outlives_a_closed_stdout(tmp_path):
    """The parent stops reading the launcher's output (closes its pipe): the relay reads the server's on and
    drops it, so the server never blocks writing its log; the launcher ends with the server's own status."""
    with open(tmp_path / "err", "w+") as err:
        sup = subprocess.Popen([sys.executable, "-c", SUPERVISE, CHATTY, "300"], stdout=subprocess.PIPE,
                               stderr=err, text=True)
        try:
            child = int(sup.stdout.readline())
            sup.stdout.close()  # EPIPE from the launcher's next write on
            rc = sup.wait(timeout=120)  # (a hang guard: with a dead relay the server blocks for good)
        finally:
            sup.kill()
        err.seek(0)
        log = err.read()
    assert rc == 0, log
    assert "warning: the server's output cannot be relayed any more (BrokenPipeError" in log, log
    assert "Traceback" not in log, log
    assert not _alive(child)


# A py-spy that never answers (stuck in ptrace on a process in disk sleep), with a child of its own; it
# writes both pids to a file.
HUNG_PY_SPY = "#!/bin/sh\nsleep 600 &\necho $$ $! > {pids}\nwait\n"
SUPERVISE_STALL_SPY = ("import sys; from sglang_hs.tools import supervisor as s; s.PY_SPY_TIMEOUT_S = 5; "
                       "sys.exit(s.Supervisor([sys.executable, '-c', sys.argv[1]], 3, None).run())")


def test_a_hung_py_spy_is_killed_and_the_stall_still_reported(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    spy = bin_dir / "py-spy"
    spy.write_text(HUNG_PY_SPY.format(pids=tmp_path / "spy.pids"))
    spy.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE_STALL_SPY, SLEEP], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        child = int(sup.stdout.readline())
        _, err = sup.communicate(timeout=120)
    finally:
        sup.kill()
    assert sup.returncode == EXIT_STALL, err
    assert f"py-spy did not answer within 5s for pid {child}: killed it" in err, err
    assert "Traceback" not in err and "looks blocked" in err, err
    spy_pids = [int(p) for p in (tmp_path / "spy.pids").read_text().split()]
    assert len(spy_pids) == 2 and not any(_alive(p) for p in spy_pids), "py-spy (or its child) outlived the report"
    assert not _alive(child)


# -- busy or blocked: each process's CPU use in the stall report and the quiet start-up log --

BEFORE = (100.0, {10: ProcSample("sglang::scheduler_TP0", 5.0, "running", 20, 1),
                  11: ProcSample("sglang::detokenizer", 1.0, "sleeping", 3, 0)})


def _after(scheduler_cpu_s):
    return (110.0, {10: ProcSample("sglang::scheduler_TP0", scheduler_cpu_s, "running", 20, 1),
                    11: ProcSample("sglang::detokenizer", 1.0, "sleeping", 3, 0),
                    12: ProcSample("python", 0.5, "disk-sleep", 1, 0)})


def test_cpu_report_lists_each_process_and_says_busy():
    assert cpu_report(BEFORE, _after(14.0), stalled=True) == [
        "CPU use of the server's processes over the last 10s:",
        "  pid 10 sglang::scheduler_TP0: cpu 90%, main thread running, 1 of 20 threads running",
        "  pid 11 sglang::detokenizer: cpu 0%, main thread sleeping, 0 of 3 threads running",
        "  pid 12 python: cpu 5%, main thread disk-sleep, 0 of 1 threads running (started in the interval)",
        "looks busy (1 process using CPU: a loop that does not progress, e.g. a warm-up retrying)",
    ]


@pytest.mark.parametrize("scheduler_cpu_s, verdict", [
    (5.0, "looks blocked (no process uses CPU: waiting on a lock, a collective or a dead peer)"),
    (5.9, "looks blocked (no process uses CPU: waiting on a lock, a collective or a dead peer)"),  # 9%
    (6.0, "looks busy (1 process using CPU: a loop that does not progress, e.g. a warm-up retrying)"),  # 10%
])
def test_cpu_report_verdict_threshold(scheduler_cpu_s, verdict):
    assert cpu_report(BEFORE, _after(scheduler_cpu_s), stalled=True)[-1] == verdict


@pytest.mark.parametrize("scheduler_cpu_s, verdict", [(5.0, "looks blocked (no process uses CPU)"),
                                                      (14.0, "looks busy (1 process using CPU)")])
def test_quiet_start_up_report_suggests_no_cause(scheduler_cpu_s, verdict):
    """Before the timeout a busy process may be working without output (imports, a slow load)."""
    assert cpu_report(BEFORE, _after(scheduler_cpu_s))[-1] == verdict


def test_cpu_report_counts_busy_processes():
    after = _after(14.0)
    after[1][11] = ProcSample("sglang::detokenizer", 11.0, "running", 3, 1)
    assert cpu_report(BEFORE, after)[-1] == "looks busy (2 processes using CPU)"


# Planted start-up hangs: a "server" that prints its pid, then never prints again while it spins in
# its main thread, spins in a thread while its main thread waits, or sleeps.
SPIN = "import os; print(os.getpid(), flush=True)\nwhile True: pass"
SPIN_IN_THREAD = ("import os, threading; print(os.getpid(), flush=True)\n"
                  "t = threading.Thread(target=lambda: [None for _ in iter(int, 1)]); t.start(); t.join()")
SLEEP = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
STALL_WHY = {"busy": "1 process using CPU: a loop that does not progress, e.g. a warm-up retrying",
             "blocked": "no process uses CPU: waiting on a lock, a collective or a dead peer"}
SUPERVISE_STARTUP = ("import sys; from sglang_hs.tools.supervisor import Supervisor; "
                     "sys.exit(Supervisor([sys.executable, '-c', sys.argv[1]], 3, None).run())")


@pytest.mark.parametrize("server, verdict", [(SPIN, "busy"), (SPIN_IN_THREAD, "busy"), (SLEEP, "blocked")],
                         ids=["spin", "spin-in-thread", "sleep"])
def test_stall_report_says_busy_or_blocked(server, verdict):
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE_STARTUP, server], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    child = int(sup.stdout.readline())
    _, err = sup.communicate(timeout=120)
    assert sup.returncode == EXIT_STALL, err
    # A 3 s timeout logs the quiet start-up every 0.75 s: at least twice before the stall.
    assert re.search(r"\[sglang-hs\] start-up quiet for \d+s in phase 'starting the server process'", err), err
    report = err[err.index("start-up stalled in phase"):]
    assert re.search(rf"\n\[sglang-hs\]   pid {child} \S+: cpu \d+%, main thread [\w-]+, \d of \d threads running\n",
                     report), report
    assert f"\n[sglang-hs] looks {verdict} ({STALL_WHY[verdict]})\n" in report, report
    assert not _alive(child)


# -- Python multiprocessing's named semaphores (/dev/shm/sem.mp-*) that a killed server leaves --
# In the spawn context (SGLang's) their creator's finalizer or the resource tracker (a process of the same
# session) unlinks them, and neither runs when the session is killed.

def _sem_path(name):
    return "/dev/shm/sem." + name.lstrip("/")


def _sem_unlink(*names):
    for name in names:
        try:
            _multiprocessing.sem_unlink(name)
        except OSError:
            pass


# A stalled "server" holding a named semaphore that nothing unlinks once it is killed (no finalizer runs on
# SIGTERM's default action, and no resource tracker knows it).
STALL_HOLDING_SEMAPHORE = ("import _multiprocessing, os, time; s = _multiprocessing.SemLock(1, 1, 1, {name!r}, False); "
                           "print(os.getpid(), flush=True); time.sleep(600)")


@pytest.mark.parametrize("also_held, deaf", [(False, False), (True, False), (False, True)],
                         ids=["server-only", "also-held-by-another", "server-ignores-sigterm"])
def test_a_stalled_servers_semaphore_is_removed_and_no_other(also_held, deaf):
    """Only the server's own semaphore goes: one its processes mapped and no live process maps now (with
    `also_held`, this test's process opens it by name too, and it stays). A `deaf` server ignores SIGTERM,
    so only SIGKILL stops it and its main process is left unreaped (a zombie, which maps nothing) until
    the supervisor reaps it. Two made by another process
    while the server ran stay: one nobody maps (not the server's to remove) and one a live process holds.
    glibc's sem_open maps a new semaphore under a temporary name it then deletes, so its creator's
    /proc/PID/maps does not name it: a check by name would find neither mapped."""
    ours, closed, held_name = (f"/mp-hstest{uuid.uuid4().hex[:8]}" for _ in range(3))
    server = STALL_HOLDING_SEMAPHORE.format(name=ours)
    if deaf:
        server = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + server
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE_STARTUP, server],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child = int(sup.stdout.readline())  # the server's semaphore exists from here on
        _multiprocessing.SemLock(1, 1, 1, closed, False)  # closed again at once: mapped by no process
        held = _multiprocessing.SemLock(1, 1, 1, held_name, False)
        assert os.path.exists(_sem_path(ours)) and os.path.exists(_sem_path(closed))
        opened = _multiprocessing.SemLock._rebuild(0, 1, 1, ours) if also_held else None  # sem_open by name
        _, err = sup.communicate(timeout=120)
        assert sup.returncode == EXIT_STALL, err
        assert not _alive(child)
        if also_held:
            assert os.path.exists(_sem_path(ours)), "the server's semaphore was removed while another process maps it"
            del opened
        else:
            assert not os.path.exists(_sem_path(ours)), "the killed server's semaphore was left in /dev/shm"
        assert os.path.exists(_sem_path(closed)), "a semaphore of another process (mapped by none) was removed"
        assert os.path.exists(_sem_path(held_name)), "a semaphore another live process maps was removed"
        del held
    finally:
        sup.kill()
        _sem_unlink(ours, closed, held_name)


# A server that ignores SIGTERM and holds a lock of multiprocessing's spawn context (SGLang's start method):
# the resource tracker it starts (same session) would unlink the lock's semaphore, but is killed with it.
STUCK_WITH_SPAWN_LOCK = ("import multiprocessing as mp, os, signal, time; "
                         "signal.signal(signal.SIGTERM, lambda *a: print('TERM', flush=True)); "
                         "lock = mp.get_context('spawn').Lock(); "
                         "print(os.getpid(), lock._semlock.name, flush=True)\nwhile True: time.sleep(600)")


def test_a_killed_servers_multiprocessing_lock_leaves_no_semaphore():
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE, STUCK_WITH_SPAWN_LOCK, "300"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    name = None
    try:
        pid, name = sup.stdout.readline().split()
        assert os.path.exists(_sem_path(name))
        sup.send_signal(signal.SIGTERM)  # relayed to the server, which says so and carries on
        assert sup.stdout.readline().strip() == "TERM"
        sup.send_signal(signal.SIGTERM)  # the second kills the session at once, the resource tracker with it
        _, err = sup.communicate(timeout=120)
        assert "SIGTERM again: killing the server's processes now" in err, err
        assert not _alive(int(pid))
        assert not os.path.exists(_sem_path(name)), "the killed server's semaphore was left in /dev/shm"
    finally:
        sup.kill()
        if name:
            _sem_unlink(name)


def test_an_unreadable_process_started_since_the_server_keeps_every_semaphore(monkeypatch):
    """A process whose maps cannot be read (non-dumpable: even root may not read them) might map a server
    semaphore when it started after the server: then none is removed. One that started before (init and
    daemons) cannot have opened a semaphore made later, and does not stop the cleanup."""
    from sglang_hs.tools import supervisor as sv

    def fake_open(path, *args, **kwargs):
        if path == "/proc/999999/maps":
            raise PermissionError(path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(sv, "open", fake_open, raising=False)  # the module's global shadows the builtin
    monkeypatch.setattr(sv, "_start_ticks", lambda pid: 500 if pid == 999999 else None)
    assert sv.mapped_sem_inodes([999999], unknown_if_started_after=400) is None
    assert sv.mapped_sem_inodes([999999], unknown_if_started_after=600) == set()
    assert sv.mapped_sem_inodes([999999]) == set()


def test_a_signal_never_waits_for_a_hung_maps_read(monkeypatch):
    """Reading a process's /proc/PID/maps waits for its mmap lock, which a hung server may hold: the note
    taken before a signal runs on another thread, and the signal goes out while it still hangs."""
    from sglang_hs.tools import supervisor as sv

    release, started, caller, noted_on = threading.Event(), threading.Event(), threading.current_thread(), []
    sup = sv.Supervisor(["true"], 300, None)
    sup._pgid = 999999

    def hung_note():
        noted_on.append(threading.current_thread())
        started.set()
        if threading.current_thread() is not caller:  # (on the caller it would hang the test itself)
            release.wait(120)

    monkeypatch.setattr(sup, "_note_semaphores", hung_note)
    monkeypatch.setattr(sv, "NOTE_WAIT_S", 0.01)
    sent = []
    monkeypatch.setattr(sv.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    try:
        sup._signal_group(signal.SIGKILL)
        assert sent == [(999999, signal.SIGKILL)] and not release.is_set()
        assert started.wait(60) and noted_on[0] is not caller, "the note ran on the thread that sends the signal"
    finally:
        release.set()


def test_a_failed_cleanup_step_leaves_the_servers_exit_status(monkeypatch, capsys):
    from sglang_hs.tools import supervisor as sv

    sup = sv.Supervisor([sys.executable, "-c", "import sys; sys.exit(3)"], 300, None)

    def _cleanup_sglang_shm():  # a segment gone between its glob and its stat, as it could before
        raise FileNotFoundError("/dev/shm/sglang_loads_x.shm")

    monkeypatch.setattr(sup, "_cleanup_sglang_shm", _cleanup_sglang_shm)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # run() sets its own
    try:
        assert sup.run() == 3
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert "warning: cleanup_sglang_shm failed: FileNotFoundError" in capsys.readouterr().err


# -- a node of rank > 0 (SGLang --nnodes): stopped alone, and node 0 going away --

# SGLang 0.5.23's main process on a node of rank >= 1 once its schedulers are ready (entrypoints/engine.py): its
# launch-phase SIGQUIT handler kills its process tree (kill_process_tree: SIGKILL to the children, then to
# itself), SIGTERM only logs and waits for node 0's ShutdownReq broadcast; it waits on its scheduler, a child.
# argv[1]: what the "scheduler" does: sleep (SGLang not noticing anything), or node0 (it blocks on a connection
# to node 0 and fails when that closes, as a collective does: its main process then kills the tree), or stdin
# (it exits with status 1 at the end of its stdin, a failure of this node's own).
NODE = r"""
import os, signal, socket, subprocess, sys
what = sys.argv[1]
if what == "node0":
    host, port = [a for a in sys.argv if a.count(":") == 1][0].rsplit(":", 1)
    code = "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); sys.exit(s.recv(1) == b'')"
    child = subprocess.Popen([sys.executable, "-c", code, host, port])
elif what == "stdin":
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(1)"])
else:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def kill_tree(signum, frame):
    child.kill()
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGQUIT, kill_tree)
print(os.getpid(), child.pid, flush=True)
print("[sglang-hs] overlay ready", flush=True)
print("[sglang-hs] node 1 of 2: schedulers ready", flush=True)
signal.signal(signal.SIGTERM, lambda s, f: print("SIGTERM received on node_rank 1; waiting for the rank-0 "
                                                 "ShutdownReq broadcast", flush=True))
child.wait()
if child.returncode not in (0, None):
    kill_tree(None, None)
"""
SUPERVISE_NODE = ("import sys; from sglang_hs.tools import supervisor as s; "
                  "s.NODE0_PROBE_EVERY_S = float(sys.argv[3]); "
                  "s.NODE0_PROBE_TIMEOUT_S = 2; "
                  "sys.exit(s.Supervisor([sys.executable, '-c', sys.argv[1], sys.argv[2], '--nnodes', '2', "
                  "'--node-rank', '1', '--dist-init-addr', sys.argv[4]], 300, None, stop_grace=300).run())")


@pytest.fixture
def node0():
    """A listening socket standing for node 0's --dist-init-addr (its TCP store); accepted connections kept."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    yield server, accepted
    server.close()
    for conn in accepted:
        conn.close()


@pytest.fixture
def started():
    """What the test started: supervisors and the stand-ins' pids; any still alive when it ends (a failed test)
    is killed."""
    procs, pids = [], []
    yield procs, pids
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _node1(what, node0, probe_every, started, stdin=None):
    """The supervisor of a stand-in node 1 (NODE), once it reported the node ready; (process, stderr so far,
    the stand-in's pids)."""
    addr = "127.0.0.1:%d" % node0[0].getsockname()[1]
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE_NODE, NODE, what, str(probe_every), addr],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True)
    started[0].append(sup)
    pids = [int(p) for p in sup.stdout.readline().split()]
    started[1].extend(pids)
    err = ""
    while "server ready: node 1" not in err:
        line = sup.stderr.readline()
        assert line, err
        err += line
    return sup, err, pids


def test_node_1_stopped_alone_stops_at_once_and_leaves_nothing(node0, started):
    """SIGTERM to node 1's launcher: SGLang's node-1 main process ignores SIGTERM (it waits for node 0's
    ShutdownReq); the launcher sends it SIGQUIT, which it honours, instead of waiting out the 300 s grace."""
    sup, err, pids = _node1("sleep", node0, 600, started)
    sup.send_signal(signal.SIGTERM)
    _, rest = sup.communicate(timeout=120)  # a hang guard: without SIGQUIT it takes the 300 s grace
    err += rest
    assert sup.returncode == 128 + signal.SIGTERM, err
    assert "did not stop within" not in err and "stopped by SIGTERM; all server processes are gone" in err, err
    assert not any(_alive(p) for p in pids), err


def test_node_0_unreachable_while_node_1_serves_stops_node_1(node0, started):
    """SGLang on node 1 does not notice node 0 going away (nothing of it waits on node 0 then): the launcher
    finds node 0's --dist-init-addr unreachable 3 times in a row, says so in one line naming node 0, stops its
    server and exits with EXIT_NODE0_LOST."""
    from sglang_hs.tools.supervisor import EXIT_NODE0_LOST

    server, _ = node0
    port = server.getsockname()[1]
    sup, err, pids = _node1("sleep", node0, 0.2, started)
    server.close()  # node 0 goes away
    _, rest = sup.communicate(timeout=120)
    err += rest
    assert sup.returncode == EXIT_NODE0_LOST, err
    lines = [x for x in err.splitlines() if "went away" in x]
    assert lines == [f"[sglang-hs] node 0 (--dist-init-addr 127.0.0.1:{port}) went away (unreachable 3 times in "
                     "a row, 0.2s apart): node 1 cannot serve without it; stopping (the records completed here "
                     "stay readable in its dump)"], err
    assert not any(_alive(p) for p in pids), err


def test_node_1_server_failing_after_node_0_went_away_names_node_0(node0, started):
    """SGLang's node-1 scheduler fails when node 0 goes away (its collective's connection closes), and its main
    process kills the tree (SIGKILL): the launcher, finding node 0 unreachable, names node 0 rather than the
    server's status alone."""
    from sglang_hs.tools.supervisor import EXIT_NODE0_LOST

    server, accepted = node0
    port = server.getsockname()[1]
    sup, err, pids = _node1("node0", node0, 600, started)
    accepted.append(server.accept()[0])  # the "scheduler"'s connection
    server.close()
    accepted.pop().close()  # node 0 goes away: the scheduler's connection closes
    _, rest = sup.communicate(timeout=120)
    err += rest
    assert sup.returncode == EXIT_NODE0_LOST, err
    assert (f"[sglang-hs] node 0 (--dist-init-addr 127.0.0.1:{port}) went away (unreachable as this node's server "
            f"exited with status -{signal.SIGKILL}): node 1 cannot serve") in err, err
    assert "[sglang-hs] server exited with status" not in err
    assert not any(_alive(p) for p in pids), err


def test_node_1_failing_with_node_0_there_is_its_own_failure(node0, started):
    """Node 0 answers every probe (the watcher connects; the fixture accepts them): no node-0 report; node 1's
    server failing by itself is reported as the server's exit."""
    server, accepted = node0
    sup, err, pids = _node1("stdin", node0, 0.1, started, stdin=subprocess.PIPE)
    while len(accepted) < 5:  # more probes than make node 0 gone, all answered
        accepted.append(server.accept()[0])
    sup.stdin.close()  # the "scheduler" exits with status 1; the stand-in then kills its tree
    sup.wait(timeout=120)
    err += sup.stderr.read()
    assert "went away" not in err and f"server exited with status -{signal.SIGKILL} during 'serving'" in err, err
    assert sup.returncode == 128 + signal.SIGKILL, err
    assert not any(_alive(p) for p in pids), err
