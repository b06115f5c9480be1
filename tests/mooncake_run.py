"""Mooncake for the tests (tests/unit/test_mooncake.py, tests/e2e/test_live.py): mooncake_master with its HTTP
metadata server on free ports of 127.0.0.1, and `python -m sglang_hs.publish` as a process of its own, each
waited for on what it publishes (an open port, a line of output), never on a sleep. Needs SGLANG_HS_MOONCAKE
(helpers.mooncake_path) in the environment."""
import contextlib
import os
import queue
import subprocess
import sys
import threading
import time

from helpers import REPO
from sglang_hs.extract.transport.mooncake import mooncake_binary, mooncake_env
from sglang_hs.tools.server_process import free_port, wait_port

DEADLINE = 60


@contextlib.contextmanager
def mooncake_master(log_path: str):
    """A running mooncake_master: {"master": HOST:PORT, "metadata": its HTTP metadata server's URL}."""
    rpc, http, metrics = free_port(), free_port(), free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([mooncake_binary("mooncake_master"), f"-rpc_port={rpc}",
                                 "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                                 f"-http_metadata_server_port={http}", f"-metrics_port={metrics}"],
                                env=mooncake_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(rpc, proc, "mooncake_master", DEADLINE)
            wait_port(http, proc, "mooncake_master's metadata server", DEADLINE)
            yield {"master": f"127.0.0.1:{rpc}", "metadata": f"http://127.0.0.1:{http}/metadata"}
        finally:
            proc.terminate()
            proc.wait(timeout=30)


class Publisher:
    """python -m sglang_hs.publish in a process of its own: the serving node. `address`: where it listens."""

    def __init__(self, master: dict, dump: str, window_mb: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_hs.publish", "--hs-dump-dir", str(dump), "--listen", "127.0.0.1:0",
             "--mooncake-master", master["master"], "--mooncake-metadata", master["metadata"],
             "--window-mb", repr(window_mb), "--wait", "10"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env=dict(os.environ, GLOG_minloglevel=os.environ.get("GLOG_minloglevel", "2")))
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.seen: list = []
        threading.Thread(target=self._read, daemon=True).start()
        first = self.line("[publish] ")
        self.address = first.split("consumers connect to ")[1].split(";")[0].strip()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def line(self, containing: str) -> str:
        """The first line of the publisher's output that holds `containing` (its published state)."""
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the publisher printed no {containing!r} in {DEADLINE}s: {self.seen}") from None
            self.seen.append(line)
            if containing in line:
                return line
            if line == "":
                raise AssertionError(f"the publisher exited ({self.proc.wait()}) without {containing!r}: {self.seen}")

    def stop(self) -> None:
        """Stop it; its output goes to the test's captured stdout (shown when the test fails)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)
        while True:
            try:
                line = self.lines.get(timeout=10)
            except queue.Empty:
                break
            if line == "":
                break
            self.seen.append(line)
        print("publisher:", "".join(line for line in self.seen if not line.startswith(("I1", "W1"))))
