"""Faults: a scheduler killed mid-run emits no partial record and takes the launcher down non-zero;
a server killed outright leaves files that the next server on the same dump dir replaces."""
import os
import signal
import time

import pytest

from helpers import (Launcher, killed_mid_generation, leftover_server_processes, processes_in_session, server_session,
                     until_decoding)
from sglang_hs import HiddenStateReader
from sglang_hs.tools.server_process import scheduler_pid

pytestmark = pytest.mark.e2e


def test_scheduler_killed_mid_generation(tmp_path):
    dump = tmp_path / "hs"
    server = Launcher(["--hs-dump-dir", str(dump), "--hs-last"]).wait_ready()
    reader = HiddenStateReader(str(dump))
    server.generate(input_ids=list(range(5, 25)), rid="before", sampling_params={"max_new_tokens": 3})
    assert reader.take("before", timeout=30).num_tokens == 22
    victim = scheduler_pid(processes_in_session(server_session(server.output)))
    rc, errors = killed_mid_generation(server, "killed", 2000, until_decoding(server, str(dump), victim),
                                       lambda: os.kill(victim, signal.SIGKILL), 120, 60)
    assert rc != 0, server.tail()
    assert errors  # the client was not told a lie
    assert reader.poll() == 0  # nothing of the killed request, nothing torn
    assert "killed" not in reader._ready
    assert not leftover_server_processes(server.output)
    assert not list(dump.glob("store-*.bin")) and not list(dump.glob("overlay-*.json"))


def test_next_server_replaces_files_of_a_server_killed_outright(tmp_path):
    dump = tmp_path / "hs"
    first = Launcher(["--hs-dump-dir", str(dump), "--hs-last"]).wait_ready()
    first.generate(input_ids=list(range(5, 25)), rid="first", sampling_params={"max_new_tokens": 2})
    sid = server_session(first.output)
    first.proc.send_signal(signal.SIGKILL)  # the launcher dies without cleaning up ...
    os.killpg(sid, signal.SIGKILL)  # ... and so does the server it supervised
    first.wait_exit(timeout=60)
    deadline = time.monotonic() + 30
    while processes_in_session(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(dump.glob("store-*.bin")) and list(dump.glob("ring-*.bin"))  # stale files left behind
    second = Launcher(["--hs-dump-dir", str(dump), "--hs-last"]).wait_ready()
    try:
        assert "replacing stale" in second.output
        reader = HiddenStateReader(str(dump))
        second.generate(input_ids=list(range(5, 25)), rid="second", sampling_params={"max_new_tokens": 2})
        assert reader.take("second", timeout=30).num_tokens == 21
        assert "first" not in reader._ready  # the dead server's ring is gone, not mixed in
    finally:
        second.stop()
        assert not leftover_server_processes(second.output)


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
