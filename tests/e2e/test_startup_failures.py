"""Start-up never hangs silently and never falls back silently to SGLang's built-in class.

Each test's server fails in its own way, and each mostly waits (the stalls for their timeout, the others
for SGLang to get far enough to fail): the module starts the servers of all its selected tests at once
(`failed_starts`), then each test waits for its own and judges it."""
import os
import re
import socket
import uuid

import pytest

from helpers import Launcher, leftover_server_processes
from sglang_hs.tools.supervisor import EXIT_FATAL, EXIT_NO_OVERLAY, EXIT_STALL

pytestmark = [pytest.mark.e2e, pytest.mark.many_servers]
STALL_TIMEOUT = 30  # --hs-startup-timeout of the planted stalls (quiet start-up is reported every quarter of it)
HANG_VERDICTS = {
    "load": "looks blocked (no process uses CPU: waiting on a lock, a collective or a dead peer)",
    "load-busy": "looks busy (",  # the spinning scheduler, maybe more: "N processes using CPU: a loop ..."
}


@pytest.fixture(scope="module")
def failed_starts(request, tmp_path_factory):
    """The launchers of this module's selected tests, started together: {name: (launcher, its dump dir)}.
    The stalls' servers report every import as it completes (PYTHONPROFILEIMPORTTIME, to stderr, which the
    launcher relays): without it SGLang imports for 10-40 s without a line (longer while the other servers
    start alongside), and a timeout that short would (rightly) report the stall in an earlier phase; with it
    start-up is never quiet for more than ~5 s before the planted hang (one slow import, with all four servers
    starting on 2 busy cores; ~1 s alone)."""
    selected = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    started = {}

    def start(name, args=(), env=None, port=None):
        dump = tmp_path_factory.mktemp("hs-failed") / f"hs-{uuid.uuid4().hex[:8]}"
        started[name] = (Launcher(["--hs-dump-dir", str(dump), *args], env=env, port=port), dump)

    try:
        for hang in HANG_VERDICTS:
            if f"test_stall_names_phase_prints_stacks_and_cleans_up[{hang}]" in selected:
                start(f"stall-{hang}", ["--hs-startup-timeout", str(STALL_TIMEOUT)],
                      env={"SGLANG_HS_TEST_HANG_PHASE": hang, "SGLANG_HS_TESTING": "1", "PYTHONPROFILEIMPORTTIME": "1"})
        if "test_overlay_import_failure_is_fatal" in selected:
            start("broken-overlay", env={"SGLANG_HS_TEST_BREAK_OVERLAY": "1", "SGLANG_HS_TESTING": "1"})
        if "test_a_taken_port_fails_fast_naming_it" in selected:
            start("taken-port", port=taken.getsockname()[1])  # held open until every launcher is done
        yield started
    finally:
        for server, _ in started.values():  # only a failed test's server may still run
            server.stop()
        taken.close()


@pytest.mark.parametrize("hang", HANG_VERDICTS)
def test_stall_names_phase_prints_stacks_and_cleans_up(failed_starts, hang):
    server, dump = failed_starts[f"stall-{hang}"]
    rc = server.wait_exit(timeout=400)
    out = server.output
    assert rc == EXIT_STALL, server.tail()
    assert f"start-up stalled in phase 'loading weights': no progress for {STALL_TIMEOUT}s" in out
    # Quiet start-up is reported every quarter of the timeout with each process's CPU use.
    assert re.search(r"\[sglang-hs\] start-up quiet for \d+s in phase 'loading weights'", out)
    # The planted hang sleeps or spins: the stall report lists the server's processes and says which.
    report = out[out.index("start-up stalled in phase"):out.index("Python stacks of pid")]
    assert "[sglang-hs] CPU use of the server's processes over the last" in report
    assert re.search(r"\[sglang-hs\]   pid \d+ \S+: cpu \d+%, main thread [\w-]+, \d+ of \d+ threads running", report)
    assert f"[sglang-hs] {HANG_VERDICTS[hang]}" in report, report
    # The stuck scheduler's Python stack shows where it hangs.
    assert "_maybe_hang" in out and "Python stacks of pid" in out
    assert not leftover_server_processes(server.output)
    assert os.listdir(dump) == []  # no status or shared-memory file left


def test_overlay_import_failure_is_fatal(failed_starts):
    """SGLang's registry only logs an import error of the overlay and serves its built-in class;
    the launcher must refuse to report such a server ready."""
    server, _ = failed_starts["broken-overlay"]
    rc = server.wait_exit(timeout=400)
    assert rc == EXIT_NO_OVERLAY, server.tail()
    assert "SGLang fell back to its built-in model class" in server.output  # noticed right after loading
    assert "Ignore import error when loading sglang_hs.server.models.deepseek_v2" in server.output
    assert "[sglang-hs] server ready" not in server.output
    assert not leftover_server_processes(server.output)


def test_a_taken_port_fails_fast_naming_it(failed_starts):
    """uvicorn cannot bind: SGLang 0.5.23 alone would linger ~12 min (its lifespan joins a warm-up thread
    polling the dead port); the launcher stops at the error line and says which flag to change."""
    server, dump = failed_starts["taken-port"]
    rc = server.wait_exit(timeout=400)
    assert rc == EXIT_FATAL, server.tail()
    assert f"error: the HTTP server cannot listen (error while attempting to bind on address ('127.0.0.1', " \
           f"{server.port}): address already in use); choose a free --port" in server.output, server.tail()
    assert "[sglang-hs] server ready" not in server.output
    assert not leftover_server_processes(server.output)
    assert os.listdir(dump) == []
