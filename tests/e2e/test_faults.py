"""Faults: a server killed outright leaves files that the next server on the same dump dir replaces; a
scheduler killed mid-run emits no partial record and takes the launcher down non-zero (one scenario, so
the second fault strikes the server that replaced the first one's files)."""
import os
import signal
import time

import pytest

from helpers import (Launcher, assert_connection_lost, killed_mid_generation, leftover_server_processes,
                     processes_in_session, server_session, until_decoding)
from sglang_hs import HiddenStateReader
from sglang_hs.tools.server_process import scheduler_pid

pytestmark = pytest.mark.e2e


@pytest.fixture
def launchers():
    """The launchers a test starts (`launchers.append(...)`): any still running when it ends, a test that
    failed midway, is stopped, so no server outlives its test."""
    started = []
    yield started
    for server in started:
        if server.proc.poll() is None:
            server.stop()
        assert not leftover_server_processes(server.output), server.tail()


def test_server_killed_outright_then_its_successors_scheduler_killed_mid_generation(tmp_path, launchers):
    """Two faults on one dump dir, one after the other (two server starts, not three): a server killed
    outright leaves its files, which the next server on the same dump dir replaces; then that server's
    scheduler is killed mid-generation, which emits no partial record and takes the launcher down
    non-zero, its files removed."""
    dump = tmp_path / "hs"
    first = Launcher(["--hs-dump-dir", str(dump), "--hs-last"])
    launchers.append(first)
    first.wait_ready()
    first.generate(input_ids=list(range(5, 25)), rid="first", sampling_params={"max_new_tokens": 2})
    sid = server_session(first.output)
    first.proc.send_signal(signal.SIGKILL)  # the launcher dies without cleaning up ...
    os.killpg(sid, signal.SIGKILL)  # ... and so does the server it supervised
    first.wait_exit(timeout=60)
    deadline = time.monotonic() + 30
    while processes_in_session(sid):
        assert time.monotonic() < deadline, processes_in_session(sid)
        time.sleep(0.2)
    assert list(dump.glob("store-*.bin")) and list(dump.glob("ring-*.bin"))  # stale files left behind

    server = Launcher(["--hs-dump-dir", str(dump), "--hs-last"])
    launchers.append(server)
    server.wait_ready()
    assert "replacing stale" in server.output
    with HiddenStateReader(str(dump)) as reader:
        # ignore_eos: a sampled token may be the EOS (id 1), which ended the request a token early (21 rows)
        server.generate(input_ids=list(range(5, 25)), rid="second",
                        sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert reader.take("second", timeout=30).num_tokens == 22
        assert "first" not in reader.ready_rids()  # the dead server's ring is gone, not mixed in

        victim = scheduler_pid(processes_in_session(server_session(server.output)))
        rc, errors = killed_mid_generation(server, "killed", 2000, until_decoding(server, str(dump), victim),
                                           lambda: os.kill(victim, signal.SIGKILL), 120, 60)
        assert rc != 0, server.tail()
        assert_connection_lost(errors)  # the client was not told a lie
        assert not leftover_server_processes(server.output)  # no writer is left: one poll sees all there is
        assert reader.poll() == 0  # nothing of the killed request, nothing torn
        assert "killed" not in reader.ready_rids()
    assert not list(dump.glob("store-*.bin")) and not list(dump.glob("overlay-*.json"))


def test_second_server_on_a_busy_dump_dir_is_refused(tmp_path):
    from helpers import error_lines, run_launcher

    dump = tmp_path / "hs"
    from sglang_hs import fsutil

    dump.mkdir(mode=0o700)
    fd = fsutil.lock_dump_dir(str(dump))  # as a live launcher holds it
    try:
        r = run_launcher(["--hs-dump-dir", str(dump)], timeout=120)
        assert r.returncode == 2 and len(error_lines(r.stderr)) == 1
        assert f"in use by another sglang-hs server (pid {os.getpid()})" in r.stderr
    finally:
        os.close(fd)
