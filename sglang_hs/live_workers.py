"""LiveHiddenStates under a DataLoader with several workers: one HiddenStateReader of the dump dir for all of
them, held by a thread of worker 0 (the router) that hands each record to the worker whose request it is.

Why this shape: the dump dir has one reader (a flock on its ring), and the DataLoader starts its workers
itself (fork or spawn), so they share nothing made after the dataset was built. They meet at a Unix socket
in a private folder the dataset made when it was built (rendezvous_dir: 0700, this user's, a random name),
named after the iteration, so every worker finds it unasked; records travel pickled by torch's
ForkingPickler, as DataLoader batches do: their tensors go through shared memory, only handles through the
socket. A long record (more than the dataset's part_bytes of rows: the router's reader acknowledges and hands
it as views of the ring) goes as a spill file instead (sglang_hs/spill.py): the router writes its states into
an unlinked file a chunk at a time, acks it and sends the file's descriptor, which the worker maps.

Security (issue 31, item 1; docs/security.md#live-dataset-workers): another local user must not reach the
trainer through this socket. Four layers, each enough against another uid: (1) the socket lies in the private
folder, so other users can neither connect to it nor bind its name first (an abstract-namespace name, as
before, was visible in /proc/net/unix, repeated across iterations and could be bound by anyone); (2) each end
checks the other's uid (SO_PEERCRED): the router accepts only this user's workers, a worker only this user's
router; (3) the handshake proves to each side that the other holds the dataset's key (32 random bytes only the
dataset's copies hold) and cannot be reflected or relayed: each side's MAC binds its role, both nonces, the
worker id and both pids as the kernel reports them (SO_PEERCRED), so a MAC made for one connection proves
nothing on another; (4) nothing a peer sends is unpickled before both MACs are checked (the hello and the MACs
are plain bytes of fixed length).

Messages after the handshake (tuples): worker -> router `("ask", rid)` (a reply came and its record did
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

Each handshake runs in its own thread, its reads and writes bounded by HANDSHAKE_TIMEOUT_S
(SO_RCVTIMEO/SO_SNDTIMEO), on the worker's side too: one that connects and says nothing must not keep the
workers out, and a router that says nothing must not hang a worker.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import io
import os
import queue
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from multiprocessing.util import Finalize
from typing import Dict, Optional

import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors on ForkingPickler


class LiveDatasetError(RuntimeError):
    """A one-line error: the server, its dump dir or a request did not do what the dataset needs (raised by
    LiveHiddenStates, sglang_hs/live.py, and by its workers here; importable from either)."""


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


def make_rendezvous_dir(owner) -> str:
    """The private folder (0700, a random name under the temp dir) where the workers of `owner` (a
    LiveHiddenStates, in the process that built it) meet; removed with `owner` by that process only (a
    forked worker's copy of the dataset going away leaves it)."""
    import weakref

    base = tempfile.gettempdir()
    if len(base) > 60:  # a socket's path holds at most 107 bytes
        base = "/tmp"
    path = os.path.join(base, f"sglang-hs-live-{secrets.token_hex(8)}")
    os.mkdir(path, 0o700)
    weakref.finalize(owner, _remove_dir, path, os.getpid())
    return path


def _remove_dir(path: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def rendezvous_address(rendezvous: str, key: str, create: bool = False) -> str:
    """The router's socket path for iteration `key` in the private folder `rendezvous`, once the folder is
    checked: a folder (not a symlink) of this user that nobody else may enter. `create`: made again if it went
    (the process that built the dataset has exited); then it is left behind, empty, when the workers end."""
    if create:
        try:
            os.mkdir(rendezvous, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(rendezvous)
    except FileNotFoundError:
        raise LiveDatasetError(f"LiveHiddenStates: the workers' meeting folder {rendezvous} is gone") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise LiveDatasetError(f"LiveHiddenStates: the workers' meeting folder {rendezvous} is not a private folder "
                               f"of this user (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): refusing it")
    return os.path.join(rendezvous, f"{key}.sock")


HANDSHAKE_TIMEOUT_S = 5.0  # for each read and write of one connection's handshake
BYE_TIMEOUT_S = 60.0  # a worker's wait for the router's answer to its done (the router answers at once)


def rid_prefix(nonce: str, worker: int) -> str:
    return f"hsl-{nonce}-{worker}-"


def _io_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking read and write of `sock` (0: no bound); the fd stays blocking, as Connection needs."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _peer_cred(sock: socket.socket) -> tuple:
    """(pid, uid) of the process at the other end, as the kernel saw it connect (or listen)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


# The handshake, plain bytes of fixed length (nothing unpickled before it ends): the worker sends HELLO +
# its id + its nonce; the router answers its nonce + its MAC; the worker answers its MAC.
HELLO = b"sglang-hs-live/2 hello"
NONCE_BYTES = 32
_ID = struct.Struct("!I")


def handshake_mac(key: bytes, role: bytes, worker_nonce: bytes, router_nonce: bytes, worker: int, router_pid: int,
                  worker_pid: int) -> bytes:
    """What `role` (b"router" or b"worker") proves: it holds `key`, on this connection (both nonces, the pids
    at its two ends) to this worker. A MAC of one role is never one of the other, so neither side can be made
    to answer for the other (reflection); one made on a relayed connection names the relay's pid (relay)."""
    msg = role + worker_nonce + router_nonce + struct.pack("!Iqq", worker, router_pid, worker_pid)
    return hmac.new(key, msg, hashlib.sha256).digest()


class HandshakeError(ConnectionError):
    """The peer did not prove it holds the dataset's key on this connection."""


def _send(conn: Connection, msg) -> None:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(msg)
    conn.send_bytes(buf.getbuffer())


def _recv(conn: Connection):
    return ForkingPickler.loads(conn.recv_bytes())


def open_live_reader(dump_dir: Optional[str], reader_wait: float, owner, publisher: Optional[str] = None,
                     part_bytes: Optional[int] = None):
    """The live dataset's one reader: the dump dir's ring (following a restarted server), or with `publisher`
    (HOST:PORT) the records of a server on another host through its Mooncake publisher, each confirmed as it
    arrives as the local reader drains them (sglang_hs/extract/transport/mooncake.py). `part_bytes`: the ring's
    reader acknowledges, and hands a record of more row bytes as views of the ring (live.spill_sample writes
    it to a file a chunk at a time, then acks it)."""
    if publisher is not None:
        from sglang_hs.extract.transport.mooncake import MooncakeTransport

        return MooncakeTransport(publisher, ack=False, wait=reader_wait)
    from sglang_hs.reader import HiddenStateReader

    if part_bytes is not None:
        return HiddenStateReader(dump_dir, wait=reader_wait, owner=owner, reattach=True, ack=True, part_bytes=part_bytes)
    return HiddenStateReader(dump_dir, wait=reader_wait, owner=owner, reattach=True)


class RecordRouter:
    """Worker 0's: opens the dump dir's reader (errors raise here, in worker 0's __iter__), listens for the
    workers, and routes records in a thread until all `num_workers` are done, then closes the reader.
    Worker 0's iteration does not wait for it (module docstring)."""

    def __init__(self, address: str, authkey: bytes, num_workers: int, dump_dir: str, reader_wait: float,
                 owner, publisher: Optional[str] = None, part_bytes: Optional[int] = None,
                 spill_dir: Optional[str] = None) -> None:
        self.address, self.num_workers = address, num_workers
        self.nonce = os.urandom(6).hex()
        self.reader = open_live_reader(dump_dir, reader_wait, owner, publisher,
                                       part_bytes if publisher is None else None)
        self.spill_dir = spill_dir
        self._authkey = authkey
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._bound_ino = None
        try:
            self._bind(address)
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

    def _bind(self, address: str) -> None:
        """Bind `address`; a socket file a killed router left there (nobody listens) is replaced: only this
        user can have put it in the private folder."""
        try:
            self._listener.bind(address)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or address.startswith("\0"):
                raise
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(address)
            except ConnectionRefusedError:
                os.unlink(address)
                self._listener.bind(address)
            else:
                raise OSError(errno.EADDRINUSE, f"{address}: another iteration of this dataset is running") from None
            finally:
                probe.close()
        if not address.startswith("\0"):
            self._bound_ino = os.lstat(address).st_ino

    def _unlink(self) -> None:
        """Remove our socket file (not one a later router bound there since)."""
        try:
            if self._bound_ino is not None and os.lstat(self.address).st_ino == self._bound_ino:
                os.unlink(self.address)
        except OSError:
            pass

    def _accept(self) -> None:
        """Takes connections until the router ends; this user's only, each handshake in its own thread."""
        me = os.geteuid()
        while True:
            try:
                sock = self._listener.accept()[0]
            except OSError:  # shut down at _route's end
                return
            try:
                if _peer_cred(sock)[1] != me:
                    raise PermissionError("another user")
                _io_timeout(sock, HANDSHAKE_TIMEOUT_S)
            except OSError:
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                             name="sglang-hs-live-handshake").start()

    def _handshake(self, sock: socket.socket) -> None:
        peer_pid = _peer_cred(sock)[0]
        conn = Connection(sock.detach())
        try:
            hello = conn.recv_bytes(len(HELLO) + _ID.size + NONCE_BYTES)
            if len(hello) != len(HELLO) + _ID.size + NONCE_BYTES or not hello.startswith(HELLO):
                raise HandshakeError("not a worker's hello")
            worker = _ID.unpack_from(hello, len(HELLO))[0]
            worker_nonce = hello[len(HELLO) + _ID.size:]
            if not 0 <= worker < self.num_workers:
                raise HandshakeError(f"a hello of worker {worker}")
            nonce = secrets.token_bytes(NONCE_BYTES)
            ids = (worker_nonce, nonce, worker, os.getpid(), peer_pid)
            conn.send_bytes(nonce + handshake_mac(self._authkey, b"router", *ids))
            if not hmac.compare_digest(conn.recv_bytes(64), handshake_mac(self._authkey, b"worker", *ids)):
                raise HandshakeError("no proof of the key")
            _send(conn, ("manifest", self.reader.manifest, self.nonce))  # the first pickle: both sides proven
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
                        self.reader.discard(rid)
                        continue
                    worker = rid[len(ours):].split("-", 1)[0]
                    worker = int(worker) if worker.isdigit() else -1
                    if worker in by_worker:
                        asked.pop(rid, None)
                        self._hand_over(by_worker[worker], self.reader.pop_ready(rid))
                    elif worker in ended or not 0 <= worker < self.num_workers:  # nobody to take it
                        self.reader.discard(rid)
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
            self._unlink()
            self.reader.close()
            last = ("bye",) if self.error is None else ("error", f"{type(self.error).__name__}: {self.error}")
            for conn in [*leaving, *clients]:
                _bye(conn, last if conn in leaving else ("error", "stopped" if self.error is None else last[1]))
            while not self._joined.empty():  # joined as it stopped: never routed to
                _bye(self._joined.get()[0], ("error", "stopped"))
            self._exit_hook.cancel()

    def _hand_over(self, conn: Connection, rec) -> None:
        """Send `rec` to its worker, then (an acknowledging reader: part_bytes) acknowledge it. A long record (views
        of the ring) goes as one spill file in spill_dir (spill.spill_record: written a chunk at a time, the worker
        maps the same file), a copied one through shared memory."""
        from sglang_hs.spill import spill_folder, spill_record

        try:
            sent = rec
            if rec.views:
                sent = spill_record(self.reader, rec, spill_folder(self.spill_dir))
                if not self.reader.intact(rec):  # its ring bytes were taken back meanwhile: the spill is torn
                    raise LiveDatasetError(f"the record of {rec.rid} was given back to the server while it was "
                                           "spilled (someone else wrote this reader's read offset)")
            _send(conn, ("record", sent))
        finally:
            if getattr(self.reader, "ack_mode", False):
                self.reader.ack(rec)

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

    def __init__(self, address: str, authkey: bytes, worker: int, wait_s: float, poll_interval: float = 0.002,
                 part_bytes: Optional[int] = None) -> None:
        self.part_bytes = part_bytes  # the router's: a record of more row bytes comes as a spill file (spill_record)
        deadline = time.monotonic() + wait_s
        while True:  # worker 0 may not listen yet
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(address)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if time.monotonic() > deadline:
                    raise LiveDatasetError(f"LiveHiddenStates: DataLoader worker {worker}: no record router "
                                           f"(worker 0) after {wait_s:.0f}s") from None
                time.sleep(0.05)
            except BaseException:
                sock.close()
                raise
        try:
            router_pid, uid = _peer_cred(sock)
            if uid != os.geteuid():
                raise LiveDatasetError(f"LiveHiddenStates: DataLoader worker {worker}: the record router's socket "
                                       f"{address.lstrip(chr(0))} is held by uid {uid}, not this user: refusing it")
            _io_timeout(sock, HANDSHAKE_TIMEOUT_S)
        except BaseException:
            sock.close()
            raise
        self._conn = Connection(sock.detach())
        try:
            worker_nonce = secrets.token_bytes(NONCE_BYTES)
            self._conn.send_bytes(HELLO + _ID.pack(worker) + worker_nonce)
            answer = self._conn.recv_bytes(NONCE_BYTES + 32)
            ids = (worker_nonce, answer[:NONCE_BYTES], worker, router_pid, os.getpid())
            if len(answer) != NONCE_BYTES + 32 or not hmac.compare_digest(
                    answer[NONCE_BYTES:], handshake_mac(authkey, b"router", *ids)):
                raise HandshakeError("it did not prove it holds the dataset's key")
            self._conn.send_bytes(handshake_mac(authkey, b"worker", *ids))
            kind, self.manifest, nonce = _recv(self._conn)  # the first pickle: both sides proven
            with socket.socket(fileno=os.dup(self._conn.fileno())) as s:  # unbound from here on
                _io_timeout(s, 0)
        except BaseException:
            self._conn.close()
            raise
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

    def intact(self, rec) -> bool:
        """Always: a record here is a copy or a spill file of its own (the router checked the ring's bytes)."""
        return True

    def chunks(self, rec, max_bytes: Optional[int] = None):
        """`rec`'s rows a chunk of at most `max_bytes` (default part_bytes) row bytes at a time, as
        HiddenStateReader.chunks: slices (a long record is a spill file here, no ring)."""
        from sglang_hs.envs import DEFAULT_PART_BYTES
        from sglang_hs.spill import slice_chunks

        return slice_chunks(rec, max_bytes or self.part_bytes or DEFAULT_PART_BYTES)

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
