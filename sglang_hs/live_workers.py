"""LiveHiddenStates under a DataLoader with several workers: one HiddenStateReader of the dump dir for all of
them, held by a thread of worker 0 (the router) that hands each record to the worker whose request it is.

Why this shape: the dump dir has one reader (a flock on its ring), and the DataLoader starts its workers
itself (fork or spawn), so they share nothing made after the dataset was built. They meet at a Unix socket in
the abstract namespace, named after the dataset and the iteration (no file to clean up; it goes with the
process that listens), and authenticate with a key only the dataset's copies hold (multiprocessing's HMAC
challenge). Records travel pickled by torch's ForkingPickler, as DataLoader batches do: their tensors go
through shared memory, only handles through the socket.

Messages (tuples): worker -> router `("hello", worker_id)`, `("ask", rid)` (a reply came and its record did
not: tell me if a marker says it never will), `("done",)`; router -> worker `("manifest", manifest)`,
`("record", HiddenStateRecord)`, `("marker", rid, reason)`. The router drops records of rids outside this
iteration (not ours to keep, as the one-process path does) and ends, closing the reader, once every worker has
said done or hung up.
"""
from __future__ import annotations

import hashlib
import io
import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge, wait
from multiprocessing.reduction import ForkingPickler
from typing import Dict, Optional

import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors on ForkingPickler

from sglang_hs.live import LiveDatasetError


def iteration_key(dataset_key: str, epoch: int) -> str:
    """The same string in every worker of one DataLoader iteration and different in the next: the workers'
    parent, the iterator's base seed (worker seed - worker id), and how often this dataset copy was iterated
    (persistent workers keep their seed across epochs)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    raw = f"{dataset_key}-{os.getppid()}-{info.seed - info.id}-{epoch}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def rid_prefix(key: str, worker: int) -> str:
    return f"hsl-{key[:12]}-{worker}-"


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
    workers, and routes records in a daemon thread until all `num_workers` are done."""

    def __init__(self, key: str, authkey: bytes, num_workers: int, dump_dir: str, reader_wait: float, owner) -> None:
        from sglang_hs.reader import HiddenStateReader

        self.key, self.num_workers = key, num_workers
        self.reader = HiddenStateReader(dump_dir, wait=reader_wait, owner=owner)
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
        self._thread.start()

    def _accept(self) -> None:
        """Handshakes off the routing thread: a worker that connects and stalls holds up nobody else."""
        joined = 0
        while joined < self.num_workers:
            try:
                conn = Connection(self._listener.accept()[0].detach())
            except OSError:  # shut down at _route's end
                return
            try:
                deliver_challenge(conn, self._authkey)  # as multiprocessing's Listener does
                answer_challenge(conn, self._authkey)
                kind, worker = _recv(conn)
                if kind != "hello" or not 0 <= worker < self.num_workers:
                    raise ValueError(f"a bad hello {(kind, worker)!r}")
                _send(conn, ("manifest", self.reader.manifest))
            except Exception:  # noqa: BLE001 - no key (AuthenticationError), or a worker that died in the handshake
                conn.close()
                continue
            joined += 1
            self._joined.put((conn, worker))

    def _route(self) -> None:
        clients: Dict[Connection, int] = {}
        by_worker: Dict[int, Connection] = {}
        asked: Dict[str, Connection] = {}
        ours, ended = rid_prefix(self.key, 0)[:-2], set()  # "hsl-<key>-"; then "<worker>-<index>"
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
                        msg = ("done",)  # a worker that ended or died: nothing more to send it
                    if msg[0] == "ask":
                        asked[msg[1]] = conn
                        continue
                    worker = clients.pop(conn)
                    del by_worker[worker]
                    ended.add(worker)
                    conn.close()
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
        except BaseException as e:  # noqa: BLE001 - handed to worker 0's iteration, which raises it
            self.error = e
        finally:
            for conn in clients:
                conn.close()
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread if a worker never came
            except OSError:
                pass
            self._listener.close()
            self.reader.close()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        """Wait until every worker is done (the reader is closed then); raise what stopped the router."""
        self._thread.join()
        if self.error is not None:
            raise self.error


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
        kind, self.manifest = _recv(self._conn)
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
                else:
                    self._markers[msg[1]] = msg[2]
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
        """Say done (the router stops routing to this worker) and hang up."""
        try:
            _send(self._conn, ("done",))
        except OSError:
            pass
        self._conn.close()
