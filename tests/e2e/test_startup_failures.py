"""Start-up never hangs silently and never falls back silently to SGLang's built-in class."""
import os
import re
import uuid

import pytest

from helpers import Launcher, leftover_server_processes
from sglang_hs.supervisor import EXIT_FATAL, EXIT_NO_OVERLAY, EXIT_STALL

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("hang,verdict", [
    ("load", "looks blocked (no process uses CPU: waiting on a lock, a collective or a dead peer)"),
    ("load-busy", "looks busy ("),  # the spinning scheduler, maybe more: "N processes using CPU: a loop ..."
])
def test_stall_names_phase_prints_stacks_and_cleans_up(tmp_path, hang, verdict):
    dump = tmp_path / f"hs-{uuid.uuid4().hex[:8]}"
    # The timeout must exceed the silent ~20-35 s of imports before the first log line on a loaded
    # 2-core machine, or the stall is (rightly) reported in an earlier phase.
    server = Launcher(["--hs-dump-dir", str(dump), "--hs-startup-timeout", "60"],
                      env={"SGLANG_HS_TEST_HANG_PHASE": hang})
    rc = server.wait_exit(timeout=400)
    out = server.output
    assert rc == EXIT_STALL, server.tail()
    assert "start-up stalled in phase 'loading weights': no progress for 60s" in out
    # Quiet start-up is reported every 15 s (a quarter of the timeout) with each process's CPU use.
    assert re.search(r"\[sglang-hs\] start-up quiet for \d+s in phase 'loading weights'", out)
    # The planted hang sleeps or spins: the stall report lists the server's processes and says which.
    report = out[out.index("start-up stalled in phase"):out.index("Python stacks of pid")]
    assert "[sglang-hs] CPU use of the server's processes over the last" in report
    assert re.search(r"\[sglang-hs\]   pid \d+ \S+: cpu \d+%, main thread [\w-]+, \d+ of \d+ threads running", report)
    assert f"[sglang-hs] {verdict}" in report, report
    # The stuck scheduler's Python stack shows where it hangs.
    assert "_maybe_hang" in out and "Python stacks of pid" in out
    assert not leftover_server_processes(server.output)
    assert os.listdir(dump) == []  # no status or shared-memory file left


def test_overlay_import_failure_is_fatal(tmp_path):
    """SGLang's registry only logs an import error of the overlay and serves its built-in class;
    the launcher must refuse to report such a server ready."""
    dump = tmp_path / f"hs-{uuid.uuid4().hex[:8]}"
    server = Launcher(["--hs-dump-dir", str(dump)], env={"SGLANG_HS_TEST_BREAK_OVERLAY": "1"})
    rc = server.wait_exit(timeout=400)
    assert rc == EXIT_NO_OVERLAY, server.tail()
    assert "SGLang fell back to its built-in model class" in server.output  # noticed right after loading
    assert "Ignore import error when loading sglang_hs.models.deepseek_v2" in server.output
    assert "[sglang-hs] server ready" not in server.output
    assert not leftover_server_processes(server.output)


def test_a_taken_port_fails_fast_naming_it(tmp_path):
    """uvicorn cannot bind: SGLang 0.5.23 alone would linger ~12 min (its lifespan joins a warm-up thread
    polling the dead port); the launcher stops at the error line and says which flag to change."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dump = tmp_path / f"hs-{uuid.uuid4().hex[:8]}"
        server = Launcher(["--hs-dump-dir", str(dump)], port=port)
        rc = server.wait_exit(timeout=300)
    assert rc == EXIT_FATAL, server.tail()
    assert f"error: the HTTP server cannot listen (error while attempting to bind on address ('127.0.0.1', " \
           f"{port}): address already in use); choose a free --port" in server.output, server.tail()
    assert "[sglang-hs] server ready" not in server.output
    assert not leftover_server_processes(server.output)
    assert os.listdir(dump) == []
