"""Shared test helpers: run the real launcher, wait for it, talk to it, stop it."""
from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

import requests

from parts import STARTS_LEDGER

from sglang_hs.tools.server_process import (READY, STOP_GRACE_S, free_port,  # noqa: F401 (re-exported)
                                            kill_and_wait, processes_in_session, server_session, start_time,
                                            stop_launcher)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def processes_matching(marker: str) -> List[int]:
    """Pids (other than ours) whose command line contains `marker`."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(d))
        except OSError:
            pass
    return pids


def leftover_server_processes(output: str) -> List[int]:
    """Processes still alive in the server session a launcher reported in `output` ([] if none started)."""
    sid = server_session(output)
    return processes_in_session(sid) if sid else []


class Launcher:
    """`python -m sglang_hs.launch_server ARGS` as a child, its output collected in `self.output`."""

    def __init__(self, args: List[str], env: Optional[dict] = None, port: Optional[int] = None,
                 python: str = sys.executable) -> None:
        self.port = port or free_port()
        self.args = list(args) + ["--port", str(self.port)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: List[str] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a line read (the ready one?) or the end of the output
        self._ready = self._eof = False
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [python, "-m", "sglang_hs.launch_server", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, cwd=tempfile.gettempdir(),
        )
        self._launched = start_time(self.proc.pid)  # our child, not yet waited for: this very launcher
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                with self._changed:
                    self.lines.append(line)
                    if READY in line:
                        self._ready = True
                        self._changed.notify_all()
        finally:
            with self._changed:
                self._eof = True
                self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 600) -> "Launcher":
        """Returns as the launcher's ready line is read (woken by the reader thread, no polling interval); raises
        when the launcher exits first, or after `timeout` (the launcher stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._changed:
                self._changed.wait_for(lambda: self._ready or self._eof, timeout=max(0.0, deadline - time.monotonic()))
                ready, eof = self._ready, self._eof
            if ready:
                self._ledger()
                return self
            if eof:  # its output closed: it exits (or has)
                try:
                    self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.tail()}")
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.tail()}")

    def _ledger(self) -> None:
        ledger = os.environ.get(STARTS_LEDGER)
        if ledger:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            with open(ledger, "a") as f:
                f.write(f"{test}\t{time.monotonic() - self._t0:.1f}\t{' '.join(self.args)}\n")

    def wait_exit(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self._reader.join(timeout=5)
        return rc

    def tail(self, n: int = 60) -> str:
        with self._lock:
            return "\n".join(self.lines[-n:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_GRACE_S) -> int:
        """Send `sig` and wait up to `timeout` for the launcher (by default longer than its own stop path: SGLang's
        grace, then its escalation to SIGKILL); past it, as server_process.ServerProcess.stop: kill every process of
        its server session, give the launcher its clean-up of the dump dir, then kill it. A server stuck in its
        shutdown (e.g. requests held for a reader) never outlives the test."""
        if stop_launcher(self.proc, self._kill_session, timeout, sig):
            self._kill_session()  # what the killed launcher left (after an exit in time, tests check there is none)
        self._reader.join(timeout=5)
        return self.proc.returncode

    def _kill_session(self) -> List[int]:
        """SIGKILL the live processes of the server session this launcher reported (those started after it) and
        wait up to server_process.KILL_WAIT_S for them to be gone; the pids killed."""
        sid = server_session(self.output)
        return kill_and_wait(lambda: processes_in_session(sid, since=self._launched) if sid else [])

    # -- HTTP --
    def generate(self, **payload) -> dict:
        r = requests.post(f"{self.url}/generate", json=payload, timeout=300)
        r.raise_for_status()
        return r.json()

    def chat(self, messages, **kw) -> dict:
        body = {"model": "default", "messages": messages, **kw}
        r = requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()


def serving(dump, args: List[str]):
    """A fixture body: a capturing server on `dump` (as `.dump`) for the fixture's scope, then stopped by
    SIGTERM with nothing left running."""
    server = Launcher(["--hs-dump-dir", str(dump), *args])
    server.dump = dump
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 128 + 15, f"launcher exit {server.proc.returncode}:\n{server.tail()}"
        assert not leftover_server_processes(server.output)


def run_launcher(args: List[str], env: Optional[dict] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sglang_hs.launch_server", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=tempfile.gettempdir(),
    )


def error_lines(text: str) -> List[str]:
    return [l for l in text.splitlines() if re.match(r"^sglang-hs: error: ", l)]


def settled(server, since_ns: Optional[int] = None, until=None, timeout: float = 60) -> dict:
    """The server's aggregated status (sglang_hs.status.settled on `server.dump`, or a dump dir) once every
    process wrote after `since_ns` (default: now) with nothing unaccounted and `until(snapshot)` true: every
    request answered before `since_ns` has its outcome counted and its record or marker in the ring. Raises
    (showing the last snapshot) after `timeout`."""
    from sglang_hs import status

    return status.settled(str(getattr(server, "dump", server)), since_ns, until, timeout)


def status_when(server, until, since_ns: Optional[int] = None, timeout: float = 60) -> dict:
    """The first aggregated status newer than `since_ns` (default: now) for which `until(snapshot)` holds,
    pending requests or not (requests held right now, a ring that fills); raises after `timeout`."""
    from sglang_hs import status

    return status.wait(str(getattr(server, "dump", server)), until, since_ns, timeout)


def metrics_of(server, snapshot: dict, by: tuple = ()) -> dict:
    """The server's sglang_hs:* metrics once /metrics shows `snapshot`'s figures (its status seq) or later
    (summed over labels but those in `by`: sglang_hs.status.metrics)."""
    from sglang_hs import status

    return status.metrics_after(server.url, snapshot, by=by)


def decode_steps(dump, pid: int) -> int:
    """Decode forwards the scheduler `pid` has run, from its status file in the dump dir (0 before the first)."""
    from sglang_hs import status

    return next((s["forwards"].get("DECODE", 0) for s in status.files(str(dump)) if s["pid"] == pid), 0)


def until_decoding(server, dump, pid: int, steps: int = 8, timeout: float = 300):
    """A `decoding` for killed_mid_generation: returns once scheduler `pid`'s status file, written after the
    call, shows `steps` more decode forwards than one written after it was made, i.e. it decodes the long
    request; fails if the request's thread ends first or `timeout` passes."""
    from sglang_hs import status

    def forwards(since_ns):
        return status.wait(str(dump), lambda s: pid in s["pids"], since_ns, timeout)

    before = forwards(None)
    start = before["files"][before["pids"].index(pid)]["forwards"].get("DECODE", 0)

    def decoding(thread):
        deadline = time.monotonic() + timeout
        while decode_steps(dump, pid) < start + steps:
            assert time.monotonic() < deadline and thread.is_alive(), server.tail()
            time.sleep(0.05)

    return decoding


def killed_mid_generation(server, rid: str, max_new_tokens: int, decoding, kill, exit_timeout: float,
                          join_timeout: float):
    """One long request `rid` (`max_new_tokens`, ignore_eos) sent in a thread; `decoding(thread)` returns
    once the server decodes it, then `kill()` (a SIGKILL to one of the server's processes). Returns the
    launcher's exit status (waited up to `exit_timeout`) and the exceptions the client got (its thread
    joined up to `join_timeout`)."""
    errors = []

    def long_request():
        try:
            server.generate(input_ids=list(range(5, 45)), rid=rid,
                            sampling_params={"max_new_tokens": max_new_tokens, "ignore_eos": True})
        except Exception as e:  # the server dies under it
            errors.append(e)

    t = threading.Thread(target=long_request)
    t.start()
    decoding(t)
    kill()
    rc = server.wait_exit(timeout=exit_timeout)
    t.join(join_timeout)
    return rc, errors


def assert_connection_lost(errors) -> None:
    """A client whose server died under it was told so by the connection itself (refused, reset or cut off
    mid-answer), not by an answer that looks like a result."""
    lost = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)
    assert errors and all(isinstance(e, lost) for e in errors), f"not a lost connection: {errors!r}"


def _installed(variable: str, record: str) -> Optional[str]:
    """The folder set-up installed something into: the `variable` environment setting, else the one
    scripts/ensure_env.sh recorded in .venv/`record`; None when neither names an existing folder."""
    path = os.environ.get(variable)
    if not path and os.path.exists(os.path.join(REPO, ".venv", record)):
        path = open(os.path.join(REPO, ".venv", record)).read().strip()
    return path if path and os.path.isdir(path) else None


def readers_path() -> Optional[str]:
    """Where requirements/readers.txt (the trainers: SpecForge, speculators) is installed, or None."""
    return _installed("SGLANG_HS_READERS", ".readers")


def mooncake_path() -> Optional[str]:
    """Where requirements/mooncake.txt (Mooncake's wheel and the libraries it links) is installed, or None."""
    return _installed("SGLANG_HS_MOONCAKE", ".mooncake")


def trainer_env(**extra) -> dict:
    """The environment of a subprocess that runs a trainer's own code on the CPU: the readers' folder (the
    trainers) and tests/ (specforge_train) on its path, Triton interpreted (SpecForge's Triton loss; read
    at import, hence a process of its own), TorchDynamo off; `extra` on top."""
    path = (os.environ.get("PYTHONPATH"), readers_path(), os.path.join(REPO, "tests"))
    return dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1",
                PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)


# SpecForge 0.2.0's own offline EAGLE-3 training (tests/specforge_train.py) for `epochs` epochs over the files
# its offline reader finds where the run config says; prints the summed loss of each epoch
SPECFORGE_STEPS = """
import json, sys
from specforge.data.preprocessing import build_offline_eagle3_dataset
from specforge_train import Eagle3Training
t = Eagle3Training(sys.argv[1])
ds = build_offline_eagle3_dataset(t.cfg.data.hidden_states_path, max_len=t.cfg.data.max_length)
print("LOSSES", json.dumps(t.epochs(int(sys.argv[2]), lambda epoch: (ds[j] for j in range(len(ds))))))
"""


def specforge_losses(run_config, epochs: int = 3) -> list:
    """The loss of each of `epochs` epochs of SpecForge's own training step on the files of `run_config` (the
    run config the extraction CLI writes), in a process of its own (trainer_env: CPU by configuration)."""
    proc = subprocess.run([sys.executable, "-c", SPECFORGE_STEPS, str(run_config), str(epochs)], env=trainer_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("LOSSES", 1)[1])


def speculators_losses(model, batch: dict, train_kwargs: dict, steps: int = 6) -> list:
    """The loss of each of `steps` of speculators' own training step (its Eagle3DraftModel forward, AdamW at 1e-3,
    clipped gradients, bf16 autocast on the CPU) on one collated `batch`, seeded."""
    import torch

    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, _ = model(**batch, **train_kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


class ProgressLines:
    """A stand-in for the extraction's progress bar (tqdm's write and update): keeps the lines written."""

    def __init__(self):
        self.lines = []

    def write(self, line, file=None):
        self.lines.append(line)

    def update(self, n):
        pass


# What a stand-in server's /generate answers: one token, finished by length.
ONE_TOKEN_REPLY = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}}


def json_server(post, get: bool = False):
    """A stand-in HTTP server on 127.0.0.1, in a thread of this process: each POST's JSON body goes to
    post(path, body), whose dict is the JSON reply; with `get`, a GET is answered 200 with no body (a health
    check), else 501. Returns (the server, its URL)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(post(self.path, body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        if get:
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def mapped_pages(reader, w: int = 0) -> set:
    """Indices of the pages of a HiddenStateReader's mapping of ring `w` that this process has mapped now
    (/proc/self/pagemap's present bit: the test process also maps the writer's side of the same file, so its RSS
    would not tell)."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    buf = reader._rings[w].r.buf
    base, n = buf.data_ptr(), buf.numel() // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(base // page * 8)
        entries = f.read(n * 8)
    return {i for i in range(n) if struct.unpack_from("<Q", entries, 8 * i)[0] >> 63}


def mapping_of(t) -> str:
    """The /proc/self/maps line of the mapping tensor `t`'s data lies in ("" if none)."""
    p = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= p < hi:
                return line.strip()
    return ""


def verify_case(T=12, V=50, H=16, seed=0):
    """For sglang_hs.extract.verify.check: a head [V, H], T final states and T + 1 tokens (the last: the token after
    the last row), with the server's logprob of each token from those states (None at 0), as the extraction passes
    them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    head = torch.randn(V, H, generator=g)
    last = torch.randn(T, H, generator=g) * 3
    tokens = torch.randint(0, V, (T + 1,), generator=g).tolist()
    logp = torch.log_softmax(last @ head.T, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return head, last, tokens, [None] + logp.tolist()


def drain_outcomes(reader, rids, outcomes: int, timeout: float = 120):
    """Poll `reader` until `outcomes` of `rids` have one (a record, popped, or a marker), or `timeout` s pass:
    ({rid: record}, {rids whose marker came}). The caller asserts the counts."""
    got, marked, deadline = {}, set(), time.monotonic() + timeout
    while len(got) + len(marked) < outcomes and time.monotonic() < deadline:
        reader.poll()
        for rid in rids:
            if rid not in got and rid not in marked:
                if reader.not_captured(rid):
                    marked.add(rid)
                else:
                    rec = reader.pop_ready(rid)
                    if rec is not None:
                        got[rid] = rec
        time.sleep(0.02)
    return got, marked
