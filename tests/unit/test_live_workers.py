"""LiveHiddenStates with several DataLoader workers against a fake server: /generate publishes a record of the
request's input ids through the real CaptureWriter and ring, so the router (sglang_hs/live_workers.py) and the
workers run for real, without SGLang. Each scenario runs in its own process group, killed if it does not end
within LIMIT_S: a hang fails the test instead of stalling the suite.

Run as a script (`python test_live_workers.py SCENARIO DIR`), it runs one scenario and prints its outcome as
JSON on the last line."""
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

LIMIT_S = 120  # a generous bound on a scenario of a few seconds: only a hang reaches it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Preparer:
    """Record i -> the sample of ids [i+1, i+2, i+3]; the indices in `skip` are skipped as too long."""

    def __init__(self, skip=()):
        self.skip = set(skip)

    def __call__(self, index, record):
        from sglang_hs.extract.dataset import Sample, SkipSample

        if index in self.skip:
            raise SkipSample("too-long")
        return Sample(index, [index + 1, index + 2, index + 3], [0, 1, 1])


def fake_server(dump: str):
    """A capturing server's /generate and /abort_request; returns its URL and the rids it was sent."""
    from sglang_hs.capture_spec import CaptureSpec
    from sglang_hs.store.writer import CaptureWriter

    os.mkdir(dump, 0o700)
    writer = CaptureWriter(dump, CaptureSpec.resolve([1, 2], True, 4, 8), 64, torch.float32, 1 << 20)
    lock, rids = threading.Lock(), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = {}
            if self.path == "/generate":
                ids = body["input_ids"]
                with lock:
                    rids.append(body["rid"])
                    writer.publish_gathered(body["rid"], torch.tensor(ids, dtype=torch.int32), torch.arange(len(ids)))
                out = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_port}", rids


def scenario(name: str, tmp: str) -> dict:
    from torch.utils.data import DataLoader

    from sglang_hs import HiddenStateReader
    from sglang_hs.live import LiveHiddenStates

    dump = os.path.join(tmp, "dump")
    url, rids = fake_server(dump)
    ds = LiveHiddenStates(list(range(16)), server=url, dump_dir=dump, concurrency=4, reader_wait=5)
    out = {"epochs": [], "rids": []}

    def epoch(loader):
        before = len(rids)
        samples = [int(s["input_ids"][0]) - 1 for s in loader]
        HiddenStateReader(dump, wait=0).close()  # the iteration closed the reader: the dump dir is free at once
        out["epochs"].append(samples)
        out["rids"].append(rids[before:])

    if name in ("worker0-short", "worker0-short-persistent"):
        # worker 0's share (the even indices) is the shorter: four of its records are skipped
        ds._preparer = Preparer(skip={0, 2, 4, 6})
        persistent = name.endswith("persistent")
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
        for _ in range(2 if persistent else 1):
            epoch(loader)
    elif name == "reseeded":
        # the user seeds the DataLoader's generator alike each epoch: the same base seed in both
        ds._preparer = Preparer()
        gen = torch.Generator()
        loader = DataLoader(ds, batch_size=None, num_workers=2, generator=gen)
        for _ in range(2):
            gen.manual_seed(0)
            epoch(loader)
    elif name == "stalled-handshake":
        # someone connects to the router's socket first and says nothing
        from sglang_hs import live_workers

        ds._preparer = Preparer()
        init, stallers = live_workers.RecordRouter.__init__, []

        def init_then_stall(self, key, *args, **kwargs):
            init(self, key, *args, **kwargs)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(live_workers._address(key))
            stallers.append(sock)

        live_workers.RecordRouter.__init__ = init_then_stall
        epoch(DataLoader(ds, batch_size=None, num_workers=2))
    else:
        raise ValueError(name)
    return out


def run(name: str, tmp_path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), name, str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{name}: hung (no end after {LIMIT_S}s); stdout {stdout[-2000:]!r} stderr {stderr[-3000:]!r}")
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def in_turn(shares):
    """The DataLoader's order: one sample of each worker in turn, a worker whose share ran out left out."""
    out, shares = [], [list(s) for s in shares]
    while any(shares):
        out += [s.pop(0) for s in shares if s]
    return out


@pytest.mark.parametrize("name", ["worker0-short", "worker0-short-persistent"])
def test_worker0_with_the_shorter_share_does_not_hang(tmp_path, name):
    """Worker 0's share ends first; the other worker's samples still come, each once, in turn, and the
    reader is closed as the loop ends (each epoch, with persistent workers too)."""
    out = run(name, tmp_path)
    want = in_turn([[8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]])
    assert out["epochs"] == [want] * len(out["epochs"]), out["epochs"]


def test_reseeded_iterations_send_other_rids(tmp_path):
    """Two iterations alike (fresh workers, the same seed): the rids of the second are all new, so no
    record left by the first can pass for one of the second's."""
    out = run("reseeded", tmp_path)
    assert out["epochs"] == [list(range(16))] * 2
    first, second = out["rids"]
    assert len(first) == len(second) == 16 and not set(first) & set(second), (first, second)


def test_a_silent_connection_does_not_hold_up_the_workers(tmp_path):
    """The router's first connection says nothing; the workers' handshakes go ahead (not after its timeout:
    the scenario is bounded by LIMIT_S only, and the old serial handshake waited forever)."""
    out = run("stalled-handshake", tmp_path)
    assert out["epochs"] == [list(range(16))]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_refused_before_the_handshake(tmp_path):
    """A process of another user that connects to the router's socket gets no challenge: the router hangs up."""
    from sglang_hs import live_workers

    dump = str(tmp_path / "dump")
    fake_server(dump)
    router = live_workers.RecordRouter("test-key-" + os.urandom(4).hex(), b"k" * 32, 1, dump, 5, None)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the other user: say what the router sent (b"" once it hangs up)
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(live_workers._address(router.key))
            os.write(w, b"got:" + sock.recv(100))
            os._exit(0)
        os.close(w)
        got = os.read(r, 200)
        os.waitpid(pid, 0)
        assert got == b"got:", got
    finally:
        router.stop()
        router.join()


if __name__ == "__main__":
    print(json.dumps(scenario(sys.argv[1], sys.argv[2])))
