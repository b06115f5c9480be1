"""LiveHiddenStates under a DataLoader with several workers: one HiddenStateReader of the dump dir for all of
them, held by a thread of worker 0 (the router) that hands each record to the worker whose request it is.

Why this shape: the dump dir has one reader (a flock on its ring), and the DataLoader starts its workers
itself (fork or spawn), so they share nothing made after the dataset was built. They meet at a Unix socket in
the abstract namespace, named after the dataset and the iteration (no file to clean up; it goes with the
process that listens), and authenticate with a key only the dataset's copies hold (multiprocessing's HMAC
challenge). Records travel pickled by torch's ForkingPickler, as DataLoader batches do: their tensors go
through shared memory, only handles through the socket.

Messages (tuples): worker -> router `("hello", worker_id)`, `("ask", rid)` (a reply came and its record did
not: tell me if a marker says it never will), `("done",)`; router -> worker `("manifest", manifest, nonce)`,
`("record", HiddenStateRecord)`, `("marker", rid, reason)`, `("bye",)` (the answer to done), `("error", text)`.
The workers' rids start with `hsl-<nonce>-<worker>-`, the nonce fresh from the router each iteration: the
socket's name is all the workers can agree on unasked, and it repeats when the DataLoader's generator is
seeded alike each epoch; a rid that repeated could take a stale record of an aborted request of the run
before. The router drops records of rids outside this iteration (not ours to keep, as the one-process path
does) and ends, closing the reader, once every worker has said done or hung up.

Nobody waits for another worker: the DataLoader (in order) waits for one worker's next sample and hands out
no new work meanwhile, so a worker that waited for the others to finish would wait forever. Worker 0's
iteration ends with its share, the router thread going on routing to the others; the reader is closed
before the last worker's done is answered with bye, and a worker ends its iteration only after its bye, so
when the DataLoader's iteration ends the reader is closed.

The handshake: a connection from another user is refused (SO_PEERCRED) and each handshake runs in its own
thread, its reads and writes bounded by HANDSHAKE_TIMEOUT_S (SO_RCVTIMEO/SO_SNDTIMEO): the socket's name
is visible to all (/proc/net/unix), and one that connects and says nothing must not keep the workers out.
"""
from __future__ import annotations

import hashlib
import io
import os
import queue
import socket
import struct
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge, wait
from multiprocessing.reduction import ForkingPickler
from multiprocessing.util import Finalize
from typing import Dict, Optional

import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors on ForkingPickler

from sglang_hs.live import LiveDatasetError


def iteration_key(dataset_key: str, epoch: int) -> str:
    """The router socket's name, the same string in every worker of one DataLoader iteration: the workers'
    parent, the iterator's base seed (worker seed - worker id), and how often this dataset copy was iterated
    (persistent workers keep their seed across epochs). Two iterations may get the same one (a generator
    seeded alike each epoch); they come one after the other, so the name is free again, and the rids come
    from the router's nonce, not from this."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    raw = f"{dataset_key}-{os.getppid()}-{info.seed - info.id}-{epoch}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


HANDSHAKE_TIMEOUT_S = 5.0  # for each read and write of one connection's handshake
BYE_TIMEOUT_S = 60.0  # a worker's wait for the router's answer to its done (the router answers at once)


def rid_prefix(nonce: str, worker: int) -> str:
    return f"hsl-{nonce}-{worker}-"


def _io_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking read and write of `sock` (0: no bound); the fd stays blocking, as Connection needs."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _address(key: str) -> str:
    return f"\0sglang-hs-live-{key}"


def _send(conn: Connection, msg) -> None:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(msg)
    conn.send_bytes(buf.getbuffer())


def _recv(conn: Connection):
    return ForkingPickler.loads(conn.recv_bytes())


class RecordRouter:
    """Worker 0's: opens the dump dir's reader (errors raise here, in worker 0's __iter__), listens for the
    workers, and routes records in a thread until all `num_workers` are done, then closes the reader.
    Worker 0's iteration does not wait for it (module docstring)."""

    def __init__(self, key: str, authkey: bytes, num_workers: int, dump_dir: str, reader_wait: float, owner) -> None:
        from sglang_hs.reader import HiddenStateReader

        self.key, self.num_workers = key, num_workers
        self.nonce = os.urandom(6).hex()
        self.reader = HiddenStateReader(dump_dir, wait=reader_wait, owner=owner, reattach=True)
        self._authkey = authkey
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(_address(key))
            self._listener.listen(num_workers)
        except BaseException:
            self._listener.close()
            self.reader.close()
            raise
        self._joined: "queue.Queue[tuple]" = queue.Queue()
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._accept, daemon=True, name="sglang-hs-live-accept").start()
        self._thread = threading.Thread(target=self._route, daemon=True, name="sglang-hs-live-router")
        # The DataLoader tells worker 0 to exit once its share is done; its process must wait for the router
        # then, and before multiprocessing's exit hooks unlink the socket of its resource sharer, which hands
        # the tensors' shared-memory fds to the workers: an exit hook of a higher priority runs first.
        self._exit_hook = Finalize(None, self._thread.join, exitpriority=100)
        self._thread.start()

    def _accept(self) -> None:
        """Takes connections until the router ends; this user's only, each handshake in its own thread."""
        me = os.geteuid()
        while True:
            try:
                sock = self._listener.accept()[0]
            except OSError:  # shut down at _route's end
                return
            try:
                if _peer_uid(sock) != me:
                    raise PermissionError("another user")
                _io_timeout(sock, HANDSHAKE_TIMEOUT_S)
            except OSError:
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                             name="sglang-hs-live-handshake").start()

    def _handshake(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self._authkey)  # as multiprocessing's Listener does
            answer_challenge(conn, self._authkey)
            kind, worker = _recv(conn)
            if kind != "hello" or not 0 <= worker < self.num_workers:
                raise ValueError(f"a bad hello {(kind, worker)!r}")
            _send(conn, ("manifest", self.reader.manifest, self.nonce))
            with socket.socket(fileno=os.dup(conn.fileno())) as s:  # the same socket: unbound from here on
                _io_timeout(s, 0)
        except Exception:  # noqa: BLE001 - no key (AuthenticationError), a stall (timeout), or a worker that died
            conn.close()
            return
        self._joined.put((conn, worker))

    def _route(self) -> None:
        clients: Dict[Connection, int] = {}
        by_worker: Dict[int, Connection] = {}
        asked: Dict[str, Connection] = {}
        leaving = []  # connections of workers that said done, to answer with bye
        ours, ended = rid_prefix(self.nonce, 0)[:-2], set()  # "hsl-<nonce>-"; then "<worker>-<index>"
        try:
            while len(ended) < self.num_workers and not self._stop.is_set():
                while not self._joined.empty():
                    conn, worker = self._joined.get()
                    if worker in ended or worker in by_worker:
                        raise RuntimeError(f"DataLoader worker {worker} joined the record router twice")
                    clients[conn], by_worker[worker] = worker, conn
                for conn in wait(list(clients), timeout=self.reader.poll_interval) if clients else ():
                    try:
                        msg = _recv(conn)
                    except (EOFError, OSError):
                        msg = None  # a worker that died: nothing more to send it
                    if msg is not None and msg[0] == "ask":
                        asked[msg[1]] = conn
                        continue
                    worker = clients.pop(conn)
                    del by_worker[worker]
                    ended.add(worker)
                    if msg is None:
                        conn.close()
                    else:
                        leaving.append(conn)
                while leaving and len(ended) < self.num_workers:  # the last one's bye waits for the reader's close
                    conn = leaving.pop()
                    _bye(conn, ("bye",))
                if not clients:
                    time.sleep(self.reader.poll_interval)
                self.reader.poll()
                for rid in self.reader.ready_rids():
                    if not rid.startswith(ours):  # others' requests: not ours to keep
                        self.reader.pop_ready(rid)
                        continue
                    worker = rid[len(ours):].split("-", 1)[0]
                    worker = int(worker) if worker.isdigit() else -1
                    if worker in by_worker:
                        asked.pop(rid, None)
                        _send(by_worker[worker], ("record", self.reader.pop_ready(rid)))
                    elif worker in ended or not 0 <= worker < self.num_workers:  # nobody to take it
                        self.reader.pop_ready(rid)
                    # else: a worker that has not joined yet; it gets the record when it does
                for rid, conn in list(asked.items()):
                    reason = self.reader.not_captured(rid)
                    if conn not in clients:
                        del asked[rid]
                    elif reason is not None:
                        _send(conn, ("marker", rid, reason))
                        del asked[rid]
        except BaseException as e:  # noqa: BLE001 - told to every worker still routed to
            self.error = e
        finally:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            except OSError:
                pass
            self._listener.close()
            self.reader.close()
            last = ("bye",) if self.error is None else ("error", f"{type(self.error).__name__}: {self.error}")
            for conn in [*leaving, *clients]:
                _bye(conn, last if conn in leaving else ("error", "stopped" if self.error is None else last[1]))
            while not self._joined.empty():  # joined as it stopped: never routed to
                _bye(self._joined.get()[0], ("error", "stopped"))
            self._exit_hook.cancel()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        """Wait until the router has ended (the reader is closed then)."""
        self._thread.join()


def _bye(conn: Connection, msg) -> None:
    """The router's last word to a worker, then hang up; a worker already gone is no matter."""
    try:
        _send(conn, msg)
    except OSError:
        pass
    conn.close()


class RoutedRecords:
    """A worker's side: what the one-process iteration uses of a HiddenStateReader (manifest, poll,
    pop_ready, not_captured, poll_interval), fed by the router."""

    def __init__(self, key: str, authkey: bytes, worker: int, wait_s: float, poll_interval: float = 0.002) -> None:
        deadline = time.monotonic() + wait_s
        while True:  # worker 0 may not listen yet
            try:
                self._conn = Client(_address(key), family="AF_UNIX", authkey=authkey)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise LiveDatasetError(f"LiveHiddenStates: DataLoader worker {worker}: no record router "
                                           f"(worker 0) after {wait_s:.0f}s") from None
                time.sleep(0.05)
        _send(self._conn, ("hello", worker))
        kind, self.manifest, nonce = _recv(self._conn)
        self.rid_prefix = rid_prefix(nonce, worker)
        self.poll_interval = poll_interval
        self._ready: dict = {}
        self._markers: Dict[str, str] = {}
        self._asked: set = set()

    def poll(self) -> int:
        n = 0
        try:
            while self._conn.poll():
                msg = _recv(self._conn)
                if msg[0] == "record":
                    self._ready[msg[1].rid] = msg[1]
                elif msg[0] == "marker":
                    self._markers[msg[1]] = msg[2]
                else:
                    raise LiveDatasetError(f"LiveHiddenStates: the record router (DataLoader worker 0) stopped: "
                                           f"{msg[1] if msg[0] == 'error' else msg}")
                n += 1
        except (EOFError, OSError):
            raise LiveDatasetError("LiveHiddenStates: the record router (DataLoader worker 0) is gone") from None
        return n

    def pop_ready(self, rid: str):
        return self._ready.pop(rid, None)

    def ready_rids(self) -> list:
        return []  # the router sends only this worker's records

    def not_captured(self, rid: str) -> Optional[str]:
        if rid not in self._asked:
            self._asked.add(rid)
            _send(self._conn, ("ask", rid))
        return self._markers.get(rid)

    def close(self) -> None:
        """Say done (the router stops routing to this worker), wait for its answer and hang up. The answer
        to the last worker's done comes after the reader is closed, so the DataLoader's iteration, which
        ends after every worker's, ends with the dump dir free. Records still on their way are dropped."""
        try:
            _send(self._conn, ("done",))
            while self._conn.poll(BYE_TIMEOUT_S) and _recv(self._conn)[0] not in ("bye", "error"):
                pass
        except (EOFError, OSError):
            pass
        self._conn.close()
