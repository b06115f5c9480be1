"""LiveHiddenStates with several DataLoader workers against a fake server: /generate publishes a record of the
request's input ids through the real CaptureWriter and ring, so the router (sglang_hs/live_workers.py) and the
workers run for real, without SGLang. Each scenario runs in its own process group, killed if it does not end
within LIMIT_S: a hang fails the test instead of stalling the suite.

Run as a script (`python test_live_workers.py SCENARIO DIR`), it runs one scenario and prints its outcome as
JSON on the last line."""
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

import scenario_process
from helpers import ONE_TOKEN_REPLY, json_server, mapping_of

LIMIT_S = 120  # a generous bound on a scenario of a few seconds: only a hang reaches it

# Another local user (uid 65534) against the router (issue 31, item 1). Run as `python -c ATTACKER MARKER` by
# root, it drops to that uid first, then answers the trainer's commands on stdin, one JSON line each:
#   scan    the router names /proc/net/unix shows (anyone may read it), and what connecting to them gives
#   squat   bind those names first, then serve whoever connects: answer the workers' multiprocessing HMAC
#           challenges by reflecting one worker's challenge off another, then send a pickle that makes
#           MARKER (a folder, as the uid it runs as) when unpickled
#   report  what it got; `report-after-workers` waits (at most LIMIT_S) until a worker got its pickle
ATTACKER = r"""
import json, os, pickle, queue, socket, struct, sys, threading
marker = sys.argv[1]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)

class Evil:
    def __reduce__(self):
        return (os.mkdir, (marker,))

EVIL = pickle.dumps(Evil())
log = {"uid": os.getuid(), "seen": [], "connect": [], "bound": [], "bind_errors": [], "workers": 0, "reflected": 0,
       "injected": 0}
cond = threading.Condition()

def readn(s, n):
    buf = b""
    while len(buf) < n:
        c = s.recv(n - len(buf))
        if not c:
            raise EOFError
        buf += c
    return buf

def send(s, b):
    s.sendall(struct.pack("!i", len(b)) + b)

def recv(s):
    return readn(s, struct.unpack("!i", readn(s, 4))[0])

def names():
    with open("/proc/net/unix") as f:
        return sorted({p[7] for p in (line.split() for line in f.readlines()[1:]) if len(p) >= 8 and "sglang-hs-live" in p[7]})

def addr(name):
    return "\0" + name[1:] if name.startswith("@") else name

def scan():
    for name in names():
        log["seen"].append(name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(addr(name))
            send(s, EVIL)
            got = s.recv(100)
            log["connect"].append(f"{name}: connected, got {got[:40]!r}")
        except Exception as e:
            log["connect"].append(f"{name}: {type(e).__name__} {e}")
        s.close()

def reflect(workers):
    # each worker (multiprocessing's Client) first answers our challenge, then sends its own: the next worker
    # answers that one for us
    w = workers.get()
    send(w, b"#CHALLENGE#" + os.urandom(20)); recv(w); send(w, b"#WELCOME#")
    challenge = recv(w)
    while True:
        v = workers.get()
        send(v, challenge); digest = recv(v)
        send(w, digest)
        if recv(w) == b"#WELCOME#":
            with cond:
                log["reflected"] += 1
            try:
                recv(w)  # its hello
                send(w, EVIL)  # ForkingPickler.loads runs it
                with cond:
                    log["injected"] += 1
                    cond.notify_all()
            except Exception:
                pass
        send(v, b"#WELCOME#")
        w, challenge = v, recv(v)

def squat():
    workers = queue.Queue()
    for name in log["seen"]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(addr(name))
            s.listen(8)
        except OSError as e:
            log["bind_errors"].append(f"{name}: {type(e).__name__} {e}")
            continue
        log["bound"].append(name)

        def serve(s=s):
            while True:
                c = s.accept()[0]
                with cond:
                    log["workers"] += 1
                workers.put(c)
        threading.Thread(target=serve, daemon=True).start()
    threading.Thread(target=lambda: reflect(workers), daemon=True).start()

for line in sys.stdin:
    cmd = line.strip()
    if cmd == "scan":
        scan()
    elif cmd == "squat":
        squat()
    elif cmd == "report-after-workers":
        with cond:
            cond.wait_for(lambda: log["injected"], timeout=LIMIT_S // 2)
    with cond:
        print(json.dumps(log), flush=True)
""".replace("LIMIT_S", str(LIMIT_S))


class Preparer:
    """Record i -> the sample of ids [i+1, i+2, i+3]; the indices in `skip` are skipped as too long."""

    def __init__(self, skip=()):
        self.skip = set(skip)

    def __call__(self, index, record):
        from sglang_hs.extract.dataset import Sample, SkipSample

        if index in self.skip:
            raise SkipSample("too-long")
        return Sample(index, [index + 1, index + 2, index + 3], [0, 1, 1])


def fake_server(dump: str, node=None, routes=None, distinct_rows=False):
    """A capturing server's /generate and /abort_request; returns its URL and the rids it was sent. `node`:
    the writer's node (one node of a multi-node server, its one DP rank); `routes`: rid -> routed_dp_rank.
    `distinct_rows`: the store holds random rows and a record's are those of its token ids' slots (else the
    zeros of slots 0, 1, 2)."""
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    os.mkdir(dump, 0o700)
    writer = CaptureWriter(dump, CaptureSpec.resolve([1, 2], True, 4, 8), 64, torch.float32, 1 << 20,
                           writer_id=node["dp_ranks"][0] if node else 0, node=node)
    if distinct_rows:
        writer.store.copy_(torch.randn(writer.store.shape, generator=torch.Generator().manual_seed(5)))
    lock, rids = threading.Lock(), []

    def post(path, body):
        if path != "/generate":
            return {}
        ids = body["input_ids"]
        with lock:
            rids.append(body["rid"])
            if routes is not None:
                routes[body["rid"]] = body.get("routed_dp_rank")
            writer.publish_gathered(body["rid"], torch.tensor(ids, dtype=torch.int32),
                                    torch.tensor(ids) if distinct_rows else torch.arange(len(ids)))
        return ONE_TOKEN_REPLY

    return json_server(post)[1], rids


def scenario(name: str, tmp: str) -> dict:
    from torch.utils.data import DataLoader

    from sglang_hs import HiddenStateReader
    from sglang_hs.live import LiveHiddenStates

    dump = os.path.join(tmp, "dump")
    # node-workers: one node of a multi-node server, its writer serving DP rank 1 of 2
    url, rids = fake_server(dump, node={"dp_ranks": [1], "dp_size": 2, "nnodes": 2, "node_rank": 1}
                            if name == "node-workers" else None, distinct_rows=name.startswith("spilled-"))
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
    elif name == "node-workers":
        ds._preparer = Preparer()
        epoch(DataLoader(ds, batch_size=None, num_workers=2))
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

        def init_then_stall(self, address, *args, **kwargs):
            init(self, address, *args, **kwargs)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(address)
            stallers.append(sock)

        live_workers.RecordRouter.__init__ = init_then_stall
        epoch(DataLoader(ds, batch_size=None, num_workers=2))
    elif name == "attacked":
        # another user watches the router's socket during one iteration, then binds its name before the next
        # iteration (alike: the generator seeded alike) and serves the workers that connect (ATTACKER)
        ds._preparer = Preparer()
        gen = torch.Generator()
        loader = DataLoader(ds, batch_size=None, num_workers=3, generator=gen)
        marker = os.path.join(tmp, "ran-as-the-trainer")
        att = subprocess.Popen([sys.executable, "-c", ATTACKER, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd="/")

        def ask(cmd):
            att.stdin.write(cmd + "\n")
            att.stdin.flush()
            return json.loads(att.stdout.readline())

        gen.manual_seed(0)
        samples = []
        for i, s in enumerate(loader):
            if i == 0:
                ask("scan")  # while the router listens
            samples.append(int(s["input_ids"][0]) - 1)
        out["epochs"].append(samples)
        ask("squat")
        gen.manual_seed(0)
        it = iter(loader)
        try:
            out["epochs"].append([int(s["input_ids"][0]) - 1 for s in it])
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - what the trainer sees
            out["error"] = f"{type(e).__name__}: {e}"
        out["attacker"] = ask("report-after-workers" if out["error"] else "report")
        del it
        att.kill()  # its stdin is the DataLoader workers' too (forked after it): no EOF to wait for
        att.wait()
        out["marker"] = os.path.exists(marker) and os.stat(marker).st_uid
    elif name.startswith("spilled-"):  # spilled-<workers>-<context>[-batched|-edited]: every record a long one
        _, workers, context, *how = name.split("-")  # (issue 47, leftover 3)
        spill = os.path.join(tmp, "spill")
        os.mkdir(spill)
        ds = LiveHiddenStates(list(range(8)), server=url, dump_dir=dump, concurrency=4, reader_wait=5,
                              part_bytes=SPILL_PART_BYTES, spill_dir=spill)
        ds._preparer = Preparer()
        if how == ["batched"]:  # default_collate in the worker: batches of one, stacked into new storage
            samples = [{k: v[0] for k, v in b.items()} for b in DataLoader(
                ds, batch_size=1, num_workers=int(workers), multiprocessing_context=context)]
        else:  # "edited": a wrapper changes the states in place in the worker
            samples = list(DataLoader(Doubled(ds) if how == ["edited"] else ds, batch_size=None,
                                      num_workers=int(workers), multiprocessing_context=context))
        HiddenStateReader(dump, wait=0).close()
        copied = LiveHiddenStates(list(range(8)), server=url, dump_dir=dump, concurrency=4, reader_wait=5,
                                  part_bytes=None)  # the reference: every record copied, in this process
        copied._preparer = Preparer()
        want = {int(s["input_ids"][0]) - 1: s for s in (Doubled(copied) if how == ["edited"] else copied)}
        HiddenStateReader(dump, wait=0).close()
        out["epochs"].append([int(s["input_ids"][0]) - 1 for s in samples])
        out["differ"] = [f"{i} {k}" for i, s in zip(out["epochs"][0], samples) for k in want[i]
                         if list(s) != list(want[i]) or s[k].dtype != want[i][k].dtype
                         or s[k].shape != want[i][k].shape or not torch.equal(s[k], want[i][k])]
        out["nonzero"] = all(bool(s["hidden_state"].abs().sum()) for s in samples)
        out["mappings"] = sorted({_mapping_kind(s[k]) for s in samples for k in ("hidden_state", "aux_hidden_state")})
        out["left_in_spill"] = os.listdir(spill)
    else:
        raise ValueError(name)
    return out


SPILL_PART_BYTES = 100  # the fake server's rows are 96 bytes a token (3 float32 rows of 8): every record is long


class Doubled(torch.utils.data.IterableDataset):
    """A user's wrapper that changes a sample's states in place (x2) where it runs: in the DataLoader worker."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __iter__(self):
        for s in self.ds:
            s["hidden_state"].mul_(2)
            s["aux_hidden_state"][0, 1:].mul_(2)  # a slice of it: another view of the same storage
            s["aux_hidden_state"][0, :1].mul_(2)
            yield s


def _mapping_kind(t) -> str:
    """What the memory under tensor `t` is, from /proc/self/maps: 'spill file (deleted)', 'shared memory' (torch's
    IPC copy) or 'other'."""
    line = mapping_of(t)
    if ".sglang-hs-spill-" in line:
        return "spill file" + (" (deleted)" if line.endswith("(deleted)") else "")
    return "shared memory" if "/dev/shm" in line or "torch_" in line else "other"


def run(name: str, tmp_path) -> dict:
    return scenario_process.run_scenario(__file__, name, tmp_path, LIMIT_S)


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
    # an abstract name, which anyone may connect to: this tests the router's own check of who connects (the
    # private folder the dataset uses keeps other users from connecting at all)
    router = live_workers.RecordRouter("\0sglang-hs-test-" + os.urandom(8).hex(), b"k" * 32, 1, dump, 5, None)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the other user: say what the router sent (b"" once it hangs up)
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(router.address)
            os.write(w, b"got:" + sock.recv(100))
            os._exit(0)
        os.close(w)
        got = os.read(r, 200)
        os.waitpid(pid, 0)
        assert got == b"got:", got
    finally:
        router.stop()
        router.join()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the attacker as another user")
def test_another_user_can_neither_squat_nor_inject(tmp_path):
    """Issue 31, item 1: uid 65534 reads the router's socket name in /proc/net/unix during one iteration,
    binds it before the next (the generator seeded alike), and serves the workers that connect: reflects one
    worker's HMAC challenge off another and sends a pickle that makes a folder when unpickled. Nothing of it
    may run in the trainer, and the trainer carries on: both iterations whole."""
    out = run("attacked", tmp_path)
    att = out["attacker"]
    assert att["uid"] == 65534 and att["seen"], att  # it saw the socket (its name is no secret)
    assert out["marker"] is False, f"the attacker's pickle ran in the trainer as uid {out['marker']}: {att}"
    assert att["bound"] == [] and att["injected"] == 0, att
    assert out["error"] is None, out["error"]
    assert out["epochs"] == [list(range(16))] * 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_a_worker_refuses_a_router_of_another_user():
    """Layer 2 alone (an abstract name, which anyone may bind): a worker whose router socket is held by another
    uid hangs up before it sends a byte, with one line naming the uid."""
    from sglang_hs import live_workers
    from sglang_hs.live import LiveDatasetError

    address = "\0sglang-hs-test-" + os.urandom(8).hex()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: listen, then say what the worker sent (b"" once it hangs up)
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lst.bind(address)
            lst.listen(1)
            os.write(w, b"listening")
            os.write(w, b"got:" + lst.accept()[0].recv(100))
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 9) == b"listening"
        with pytest.raises(LiveDatasetError, match=r"router's socket sglang-hs-test-\w+ is held by uid 65534"):
            live_workers.RoutedRecords(address, b"k" * 32, 1, 5)
        assert os.read(r, 200) == b"got:"
    finally:
        os.waitpid(pid, 0)


def test_the_handshake_cannot_be_relayed_or_replayed(tmp_path):
    """Layer 3 alone: a process of this very user (past the uid checks) sits between two workers and the real
    router: it relays worker 0's hello to the router and the router's answer back, and replays that answer to
    worker 1, then sends each worker a pickle that makes a folder. Neither worker takes the answer (it names
    the relay's pid, and the other worker's nonce), so neither sends its MAC, the router routes to nobody,
    and nothing is unpickled."""
    from multiprocessing.connection import Connection

    from sglang_hs import live_workers

    dump = str(tmp_path / "dump")
    fake_server(dump)
    key = os.urandom(32)
    router = live_workers.RecordRouter("\0sglang-hs-test-" + os.urandom(8).hex(), key, 2, dump, 5, None)
    relay, marker = "\0sglang-hs-test-" + os.urandom(8).hex(), str(tmp_path / "unpickled")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import pickle

            class Evil:
                def __reduce__(self):
                    return (os.mkdir, (marker,))

            def send_evil(conn):
                try:
                    conn.send_bytes(pickle.dumps(Evil()))
                except OSError:
                    pass

            os.close(r)
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lst.bind(relay)
            lst.listen(2)
            os.write(w, b"listening\n")
            got = []
            a, b = (Connection(lst.accept()[0].detach()) for _ in range(2))
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(router.address)
            up = Connection(up.detach())
            up.send_bytes(a.recv_bytes())  # relay a's hello
            answer = up.recv_bytes()
            a.send_bytes(answer)
            b.recv_bytes()
            b.send_bytes(answer)  # replay
            for name, conn in (("a", a), ("b", b)):
                try:
                    mac = conn.recv_bytes()
                    got.append(f"{name} sent its MAC")
                    up.send_bytes(mac)
                    up.recv_bytes()
                    got.append("the router accepted")
                except (EOFError, OSError):
                    pass
                send_evil(conn)
            os.write(w, (",".join(got) or "nothing").encode())
        finally:
            os._exit(0)
    os.close(w)
    errors = []

    def worker(i):
        try:
            live_workers.RoutedRecords(relay, key, i, 5)
            errors.append(None)
        except (OSError, EOFError) as e:
            errors.append(type(e).__name__)

    try:
        assert os.read(r, 10) == b"listening\n"
        threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        said = os.read(r, 200)
    finally:
        os.waitpid(pid, 0)
        router.stop()
        router.join()
    assert said == b"nothing", said
    assert errors == ["HandshakeError"] * 2, errors
    assert not os.path.exists(marker)


def test_the_meeting_folder_is_private_and_goes_with_the_dataset():
    """Layer 1: the workers' folder is 0700, this user's; a forked copy of the dataset going away leaves it
    (the workers of the next iteration meet there), the dataset going away in its process removes it."""
    import gc
    import stat

    from sglang_hs.live import LiveHiddenStates

    ds = LiveHiddenStates([], server="http://127.0.0.1:9", dump_dir="/nonexistent")
    d = ds._rendezvous
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    pid = os.fork()
    if pid == 0:
        del ds
        gc.collect()
        os._exit(0 if os.path.isdir(d) else 1)
    assert os.waitpid(pid, 0)[1] == 0 and os.path.isdir(d)
    del ds
    gc.collect()
    assert not os.path.exists(d)


def test_a_meeting_folder_others_may_enter_is_refused(tmp_path):
    from sglang_hs.live import LiveDatasetError
    from sglang_hs.live_workers import rendezvous_address

    d = tmp_path / "m"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(LiveDatasetError, match=r"meeting folder .*/m is not a private folder of this user .*mode 0755"):
        rendezvous_address(str(d), "k", create=True)
    os.chmod(d, 0o700)
    os.symlink(d, tmp_path / "link")
    with pytest.raises(LiveDatasetError, match="is not a private folder"):
        rendezvous_address(str(tmp_path / "link"), "k", create=True)
    assert rendezvous_address(str(d), "k") == f"{d}/k.sock"


if __name__ == "__main__":
    print(json.dumps(scenario(sys.argv[1], sys.argv[2])))


@pytest.mark.parametrize("name", ["spilled-1-fork", "spilled-2-fork", "spilled-1-spawn", "spilled-3-spawn",
                                  "spilled-1-fork-batched", "spilled-2-spawn-batched", "spilled-1-fork-edited",
                                  "spilled-2-spawn-edited"])
def test_long_records_cross_from_workers_as_their_spill_files(tmp_path, name):
    """With DataLoader workers (issue 47, leftover 3), every record a long one (part_bytes below one token's rows):
    one worker spills its sample's states and they reach the main process as the spill files, mapped there, not as
    a shared-memory copy (nor lost: torch cannot share a from_file storage); with several, the router spills each
    record to a file the worker maps, and the worker's sample crosses the same way. The samples are those of every
    record copied in one process (the reference), every one once, in dataset order, and no spill file is left.
    batched: default_collate stacks each batch in the worker (new storage: it crosses through shared memory, as any
    batch does; the sample was lost before, review); edited: a wrapper doubles the states in place in the worker,
    and the main process sees them doubled (it saw the file's first bytes before, review)."""
    out = run(name, tmp_path)
    assert sorted(out["epochs"][0]) == list(range(8)), out["epochs"]
    assert out["differ"] == [] and out["nonzero"], out
    kind = "shared memory" if name.endswith("batched") else "spill file (deleted)"
    assert out["mappings"] == [kind], out["mappings"]
    assert out["left_in_spill"] == [], out["left_in_spill"]


@pytest.mark.parametrize("dtype", ["default", None, torch.float16])
def test_samples_come_in_the_files_dtype(tmp_path, dtype):
    """A float32 server's records become bf16 samples by default, as `--format specforge` writes them (SpecForge's
    TargetHead reads bf16 only), the values those of the record cast; `dtype=None` keeps the server's."""
    from sglang_hs import HiddenStateReader
    from sglang_hs.live import LiveHiddenStates

    dump = str(tmp_path / "dump")
    url, _ = fake_server(dump)
    kw = {} if dtype == "default" else {"dtype": dtype}
    ds = LiveHiddenStates(list(range(3)), server=url, dump_dir=dump, concurrency=2, reader_wait=5, **kw)
    ds._preparer = Preparer()
    samples = list(ds)
    HiddenStateReader(dump, wait=0).close()
    want = torch.bfloat16 if dtype == "default" else (torch.float32 if dtype is None else dtype)
    assert [int(s["input_ids"][0]) - 1 for s in samples] == [0, 1, 2]
    for s in samples:
        assert s["hidden_state"].dtype == want and s["aux_hidden_state"].dtype == want, s["hidden_state"].dtype
        assert s["input_ids"].dtype == torch.int64


def test_a_dtype_that_is_not_floating_point_is_refused():
    from sglang_hs.live import LiveHiddenStates

    with pytest.raises(ValueError, match="dtype: a floating-point torch.dtype"):
        LiveHiddenStates([], server="http://127.0.0.1:9", dump_dir="/nonexistent", dtype=torch.int32)


@pytest.mark.parametrize("node_rank", [0, 1])
def test_one_node_of_a_multi_node_server_takes_its_share_routed_to_its_rank(tmp_path, node_rank):
    """Against one node's dump (SGLang --nnodes with DP attention: this node's writer serves DP rank
    `node_rank` of 2), the live dataset sends the samples whose index modulo 2 is that rank, each routed there
    (routed_dp_rank), so every record lands in the dump it reads; the two nodes' shares cover the data once."""
    from sglang_hs import HiddenStateReader
    from sglang_hs.live import LiveHiddenStates

    dump, routes = str(tmp_path / "dump"), {}
    url, rids = fake_server(dump, node={"dp_ranks": [node_rank], "dp_size": 2, "nnodes": 2, "node_rank": node_rank},
                            routes=routes)
    ds = LiveHiddenStates(list(range(7)), server=url, dump_dir=dump, concurrency=2, reader_wait=5)
    ds._preparer = Preparer()
    got = [int(s["input_ids"][0]) - 1 for s in ds]
    HiddenStateReader(dump, wait=0).close()
    assert got == [i for i in range(7) if i % 2 == node_rank], got
    assert sorted(routes.values()) == [node_rank] * len(got) and len(rids) == len(got), routes


def test_a_dump_of_every_dp_rank_is_not_routed(tmp_path):
    from sglang_hs import HiddenStateReader
    from sglang_hs.live import LiveHiddenStates

    dump, routes = str(tmp_path / "dump"), {}
    url, _ = fake_server(dump, routes=routes)
    ds = LiveHiddenStates(list(range(4)), server=url, dump_dir=dump, concurrency=2, reader_wait=5)
    ds._preparer = Preparer()
    assert [int(s["input_ids"][0]) - 1 for s in ds] == [0, 1, 2, 3]
    HiddenStateReader(dump, wait=0).close()
    assert set(routes.values()) == {None}, routes


def test_two_workers_on_one_node_share_its_samples(tmp_path):
    """The node's share (the odd indices, DP rank 1 of 2) is split between the DataLoader workers by
    position within it: both workers send (a split by index first would give worker 0 only even indices,
    all another node's, and leave it idle), and every sample of the node comes once, in order."""
    out = run("node-workers", tmp_path)
    assert out["epochs"] == [list(range(1, 16, 2))], out["epochs"]
    workers = {r.rsplit("-", 2)[-2] for r in out["rids"][0]}
    assert workers == {"0", "1"}, out["rids"]


def test_a_spill_dir_that_is_no_writable_folder_is_refused_up_front(tmp_path):
    """A long record spills into spill_dir: one that is missing (or a file) is refused when the dataset is made, in
    one line naming spill_dir, not by mkstemp's error at the first long record, inside a worker (review)."""
    from sglang_hs.live import LiveHiddenStates

    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(ValueError, match=r"spill_dir: expected a writable directory .*got '.*(missing|file)'"):
            LiveHiddenStates([], server="http://127.0.0.1:9", dump_dir="/nonexistent", spill_dir=bad)
