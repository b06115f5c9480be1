"""Across machines through Mooncake: the records of a server on another host, delivered by its publisher.

On the serving node, `python -m sglang_hs.publish` (sglang_hs/publish.py) is an ordinary acknowledging reader
of the node-local ring: it puts each finished record into Mooncake's store (a segment it hosts itself, so a put
is a local copy and the server never waits on the network) and announces it to the one consumer connected to
its control address. That consumer, MooncakeTransport here, fetches each announced record from the store (TCP,
or RDMA with --mooncake-protocol rdma), builds the very record the local reader would (same tensors, bytes,
shapes and strides: the rows travel as the ring holds them, [T, K + finals, H]) and confirms it; only then does
the publisher ack the ring record and remove the store object. So:
- a slow trainer fills the publisher's window (--window-mb of records put and unconfirmed), the publisher stops
  reading, the ring fills and the server's admission holds new requests, as with a local reader;
- a consumer that dies loses nothing: its unconfirmed records stay in the ring and the store, and the next
  consumer gets them first, each flagged `redelivered` (`MooncakeTransport.redelivered` counts them);
- one consumer at a time, as one reader per dump dir: a second is refused, naming the first.

The control channel is one TCP connection (length-framed JSON, never pickle). Neither it nor Mooncake
authenticates its peers: run both on a network you trust (docs/remote.md).

Importing this module needs no Mooncake; `load_mooncake()` loads it on first use: the folder
SGLANG_HS_MOONCAKE (scripts/ensure_env.sh installs requirements/mooncake.txt there: site/ the wheel, lib/ the
libibverbs and libnl it links, loaded here by absolute path), else an installed `mooncake` package.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:  # torch is imported where a record is built: the transports' registry costs no torch
    import torch

    from sglang_hs.reader import HiddenStateRecord  # RemoteRecord's base (_record_class)

PROTOCOLS = ("tcp", "rdma")
# the libraries the wheel's store.so links and a bare image lacks, in dependency order
PRELOAD = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
ALIGN = 64
MIN_LOCAL_BUFFER = 16 << 20
OBJECT_NOT_FOUND = -704
WIRE_VERSION = 1


class MooncakeUnavailable(ImportError):
    """Mooncake cannot be loaded here: one line saying why and how to install it."""


_store_class = None


def load_mooncake():
    """Mooncake's MooncakeDistributedStore class, loaded once (MooncakeUnavailable if it cannot be)."""
    global _store_class
    if _store_class is not None:
        return _store_class
    from sglang_hs import envs

    folder = envs.SGLANG_HS_MOONCAKE
    if folder:
        lib, site = os.path.join(folder, "lib"), os.path.join(folder, "site")
        if not os.path.isdir(site):
            raise MooncakeUnavailable(f"SGLANG_HS_MOONCAKE={folder}: no site/ folder there (scripts/ensure_env.sh "
                                      "installs requirements/mooncake.txt into such a folder)")
        for name in PRELOAD:
            path = os.path.join(lib, name)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError as e:
                    raise MooncakeUnavailable(f"SGLANG_HS_MOONCAKE={folder}: cannot load {path}: {e}") from None
        if site not in sys.path:
            sys.path.insert(0, site)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailable(
            f"Mooncake's store cannot be imported ({e}): pip install mooncake-transfer-engine-non-cuda (or the CUDA "
            "build) with libibverbs1 installed, or set SGLANG_HS_MOONCAKE to the folder scripts/ensure_env.sh "
            "installs it into (.venv/.mooncake names it)") from None
    _store_class = MooncakeDistributedStore
    return _store_class


def mooncake_binary(name: str) -> str:
    """The path of a program the Mooncake wheel ships (mooncake_master, mooncake_http_metadata_server)."""
    load_mooncake()
    import mooncake

    path = os.path.join(os.path.dirname(mooncake.__file__), name)
    if not os.access(path, os.X_OK):
        raise MooncakeUnavailable(f"{path}: not in this Mooncake install")
    return path


def mooncake_env() -> dict:
    """The environment a Mooncake program (mooncake_master) needs to find the libraries of SGLANG_HS_MOONCAKE."""
    from sglang_hs import envs

    env = dict(os.environ)
    if envs.SGLANG_HS_MOONCAKE:
        lib = os.path.join(envs.SGLANG_HS_MOONCAKE, "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


def open_store(local_host: str, metadata: str, segment_bytes: int, protocol: str, device: str, master: str):
    """A set-up MooncakeDistributedStore client; `segment_bytes` of memory it hosts for the store (0: none)."""
    store = load_mooncake()()
    rc = store.setup(local_host, metadata, int(segment_bytes), MIN_LOCAL_BUFFER, protocol, device, master)
    if rc != 0:
        raise ConnectionError(f"Mooncake setup failed (status {rc}): master {master}, metadata {metadata}, "
                              f"local host {local_host}, protocol {protocol}")
    return store


def parse_address(value: str, flag: str, any_port: bool = False):
    """HOST:PORT -> (host, port), or ValueError naming `flag`; `any_port`: port 0 (any free one) too."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536:
        raise ValueError(f"{flag}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def payload_layout(T: int, P: int, H: int, elem: int):
    """(offset of the rows, total bytes) of a record's payload: input_ids [T] int32, then rows [T, P, H]."""
    rows_at = _align(4 * T)
    return rows_at, rows_at + T * P * H * elem


def send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message, separators=(",", ":")).encode())


def receive(conn) -> dict:
    message = json.loads(conn.recv_bytes(1 << 26).decode())
    if not isinstance(message, dict):
        raise ValueError(f"not a control message: {message!r}")
    return message


_RECORD_CLASS = []


def _record_class():
    """RemoteRecord, made at first use: sglang_hs.reader (and torch) are imported then, not with the registry."""
    if not _RECORD_CLASS:
        from sglang_hs.reader import HiddenStateRecord

        @dataclass
        class RemoteRecord(HiddenStateRecord):
            """A record fetched through Mooncake: the local reader's record, plus which delivery it was."""
            delivery: int = 0  # the publisher's number of it (what the consumer confirms)
            redelivered: bool = False  # announced before to a consumer that left without confirming it

        _RECORD_CLASS.append(RemoteRecord)
    return _RECORD_CLASS[0]


def __getattr__(name: str):  # `from sglang_hs.extract.transport.mooncake import RemoteRecord` still works
    if name == "RemoteRecord":
        return _record_class()
    raise AttributeError(name)


class Staging:
    """A buffer registered with a store client, grown on demand."""

    def __init__(self, store) -> None:
        self.store, self.buf = store, None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            if self.buf is not None:
                self.store.unregister_buffer(self.buf.data_ptr())
            import torch

            self.buf = torch.empty(max(nbytes, 1 << 20) * 5 // 4, dtype=torch.uint8)
            rc = self.store.register_buffer(self.buf.data_ptr(), self.buf.numel())
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer of {self.buf.numel()} bytes failed (status {rc})")
        return self.buf[:nbytes]


class MooncakeTransport:
    """The consumer: records of a server on another host, from its `python -m sglang_hs.publish` at `address`
    (HOST:PORT). `ack`: confirm each record on ack() (a consumer killed before gets it again); False: confirm
    each as it arrives (the eager reader's way). `local_host`: this host's address for Mooncake (default the
    address the control connection leaves from, or SGLANG_HS_MOONCAKE_HOST); `device`: the RDMA devices when the
    publisher uses rdma (default SGLANG_HS_MOONCAKE_DEVICE)."""
    name = "mooncake"

    def __init__(self, address: str, ack: bool = True, wait: float = 30.0, local_host: Optional[str] = None,
                 device: Optional[str] = None, poll_interval: float = 0.002) -> None:
        from multiprocessing.connection import Client

        from sglang_hs import envs

        local_host = local_host or envs.SGLANG_HS_MOONCAKE_HOST
        device = envs.SGLANG_HS_MOONCAKE_DEVICE if device is None else device

        host, port = parse_address(address, "mooncake publisher address")
        load_mooncake()  # fails before connecting, with how to install it
        self.address, self.ack_mode, self.poll_interval = f"{host}:{port}", ack, poll_interval
        self.dump_dir = f"mooncake://{self.address}"  # no local dump dir: what errors name
        deadline = time.monotonic() + wait
        while True:
            try:
                self._conn = Client((host, port), family="AF_INET")
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{self.dump_dir}: no publisher answers after {wait}s ({e}); is "
                                          f"`python -m sglang_hs.publish --listen {self.address}` running?") from None
                time.sleep(0.05)
        if not self._conn.poll(wait):
            self._conn.close()
            raise ConnectionError(f"{self.dump_dir}: the publisher said nothing for {wait}s")
        hello = receive(self._conn)
        if "error" in hello:
            self._conn.close()
            raise RuntimeError(f"{self.dump_dir}: {hello['error']}")
        if hello.get("version") != WIRE_VERSION:
            self._conn.close()
            raise RuntimeError(f"{self.dump_dir}: wire version {hello.get('version')}, this consumer speaks "
                               f"{WIRE_VERSION} (the same sglang-hs on both hosts)")
        self._set_manifest(hello["manifest"])
        self.restarts, self.markers, self.redelivered = int(hello.get("restarts", 0)), 0, 0
        mc = hello["mooncake"]
        if mc["protocol"] == "rdma" and not device:
            self._conn.close()
            raise RuntimeError(f"{self.dump_dir}: the publisher uses RDMA: set SGLANG_HS_MOONCAKE_DEVICE to this "
                               "host's RDMA devices (e.g. mlx5_0)")
        if local_host is None:
            with socket.socket(fileno=os.dup(self._conn.fileno())) as s:
                local_host = s.getsockname()[0]
        self._store = open_store(local_host, mc["metadata"], 0, mc["protocol"], device, mc["master"])
        self._staging = Staging(self._store)
        self._ready: "collections.OrderedDict[str, collections.deque]" = collections.OrderedDict()
        self._skipped: "collections.OrderedDict[str, collections.deque]" = collections.OrderedDict()
        self._unconfirmed: "dict[int, HiddenStateRecord]" = {}
        self._confirm: List[int] = []
        self._ring_unread = 0
        self._syncs = self._synced = 0

    def _set_manifest(self, manifest: dict) -> None:
        from sglang_hs.server.capture_spec import final_states

        self.manifest = manifest
        self.num_aux = len(manifest["layer_ids"]) * int(manifest.get("rows_per_layer", 1))
        self.finals = final_states(manifest)
        self.dp_ranks = sorted(int(w.get("dp_rank", w["id"])) for w in manifest["writers"])

    # -- arrivals --------------------------------------------------------------------------------------------
    def _fetch(self, h: dict) -> HiddenStateRecord:
        T, P, H = int(h["tokens"]), int(h["rows"]), int(h["hidden"])
        import torch

        dtype = getattr(torch, h["dtype"])
        rows_at, total = payload_layout(T, P, H, torch.empty((), dtype=dtype).element_size())
        if total != int(h["nbytes"]):
            raise RuntimeError(f"{self.dump_dir}: record {h['rid']!r}: {h['nbytes']} bytes announced, its shape "
                               f"[{T}, {P}, {H}] {h['dtype']} takes {total}")
        buf = self._staging.get(total)
        got = self._store.get_into(h["key"], buf.data_ptr(), total)
        if got != total:
            raise RuntimeError(f"{self.dump_dir}: Mooncake get of {h['key']} returned {got}, expected {total} bytes "
                               "(the object is gone: was the store's master restarted?)")
        data = buf.clone()  # the staging buffer is the next record's
        ids = data[:4 * T].view(torch.int32)
        rows = data[rows_at:total].view(dtype).view(T, P, H)
        K = self.num_aux

        def final(which):
            return rows[:, K + self.finals.index(which)] if which in self.finals else None

        return _record_class()(rid=h["rid"], input_ids=ids, aux_hidden_states=rows[:, :K],
                            last_hidden_state=final("post-norm"), last_pre_norm=final("pre-norm"),
                            seq=int(h["seq"]), writer=int(h["writer"]), ring_id=str(h["ring_id"]),
                            generation=int(h["generation"]), dp_rank=int(h["dp_rank"]),
                            prompt_len=int(h["prompt_len"]), next_token=int(h["next_token"]), meta=h.get("meta") or {},
                            delivery=int(h["n"]), redelivered=bool(h.get("redelivered")))

    def poll(self) -> int:
        """Take what the publisher announced: each record fetched from the store (and, without ack, confirmed)."""
        if self._conn is None:
            raise RuntimeError(f"this MooncakeTransport of {self.dump_dir} is closed")
        n = 0
        try:
            while self._conn.poll(0):
                m = receive(self._conn)
                if "record" in m:
                    rec = self._fetch(m["record"])
                    self._ring_unread = int(m.get("ring_unread", self._ring_unread))
                    self.redelivered += rec.redelivered
                    self._ready.setdefault(rec.rid, collections.deque()).append(rec)
                    if self.ack_mode:
                        self._unconfirmed[rec.delivery] = rec
                    else:
                        self._confirm.append(rec.delivery)
                    n += 1
                elif "marker" in m:
                    self._skipped.setdefault(m["marker"], collections.deque()).append(m["reason"])
                    self.markers += 1
                    n += 1
                elif "manifest" in m:
                    self._set_manifest(m["manifest"])
                    self.restarts = int(m.get("restarts", self.restarts + 1))
                elif "sync" in m:
                    self._synced = max(self._synced, int(m["sync"]))
                elif "error" in m:
                    raise RuntimeError(f"{self.dump_dir}: the publisher stopped: {m['error']}")
            self._flush()
        except (EOFError, ConnectionError, OSError) as e:
            raise ConnectionError(f"{self.dump_dir}: the publisher went away ({type(e).__name__}: {e})") from None
        return n

    def sync(self, timeout: float = 30.0) -> int:
        """Wait until the publisher has handled everything sent so far (confirmations included), read its ring
        and announced what its window takes, and this transport has taken those announcements in: then
        ready_rids() holds every record the publisher would hand on now. Returns the records that arrived."""
        self._syncs += 1
        send(self._conn, {"sync": self._syncs, "ack": self._confirm})
        self._confirm = []
        deadline, n = time.monotonic() + timeout, 0
        while self._synced < self._syncs:
            got = self.poll()
            n += got
            if not got and self._synced < self._syncs:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.dump_dir}: the publisher did not answer a sync in {timeout}s")
                self._wait()
        return n

    def _flush(self) -> None:
        if self._confirm:
            send(self._conn, {"ack": self._confirm})
            self._confirm = []

    # -- the Transport interface ----------------------------------------------------------------------------
    def _pop(self, rid: str) -> HiddenStateRecord:
        q = self._ready[rid]
        rec = q.popleft()
        if not q:
            del self._ready[rid]
        return rec

    def pop_ready(self, rid: str):
        return self._pop(rid) if rid in self._ready else None

    def ready_rids(self) -> List[str]:
        return list(self._ready)

    def not_captured(self, rid: str) -> Optional[str]:
        q = self._skipped.get(rid)
        return q[0] if q and rid not in self._ready else None

    def discard(self, rid: str) -> int:
        n = 0
        while rid in self._ready:
            self.ack(self._pop(rid))
            n += 1
        self._skipped.pop(rid, None)
        return n

    def take(self, rid: str, timeout: Optional[float] = None) -> HiddenStateRecord:
        deadline = None if timeout is None else time.monotonic() + timeout
        while rid not in self._ready:
            if self.not_captured(rid):
                from sglang_hs.reader import NotCaptured

                reason = self._skipped[rid].popleft()
                if not self._skipped[rid]:
                    del self._skipped[rid]
                raise NotCaptured(rid, reason)
            if not self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no record for request {rid!r} after {timeout}s from {self.dump_dir}")
                self._wait()
        return self._pop(rid)

    def next(self, timeout: Optional[float] = None) -> HiddenStateRecord:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            if not self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no record after {timeout}s from {self.dump_dir}")
                self._wait()
        return self._pop(next(iter(self._ready)))

    def __iter__(self):
        while True:
            yield self.next()

    def _wait(self) -> None:
        try:
            self._conn.poll(self.poll_interval * 10)  # wakes as soon as the publisher says something
        except (EOFError, OSError):
            pass  # the next poll says so

    def ack(self, record: HiddenStateRecord) -> None:
        """Confirm `record` (with ack=True): the publisher gives its ring bytes back to the server."""
        if self.ack_mode and self._unconfirmed.pop(record.delivery, None) is not None:
            if self._conn is None:
                raise RuntimeError(f"this MooncakeTransport of {self.dump_dir} is closed: the record of "
                                   f"{record.rid!r} comes again to the next consumer")
            self._confirm.append(record.delivery)
            try:
                self._flush()
            except (EOFError, OSError) as e:
                raise ConnectionError(f"{self.dump_dir}: the publisher went away ({e}); {record.rid!r} and the "
                                      "records not confirmed come again to the next consumer") from None

    def intact(self, record) -> bool:
        return True  # a copy, this process's own

    def unacked(self) -> int:
        return len(self._unconfirmed)

    def unread_bytes(self) -> int:
        """How far the publisher's ring lagged its server at its last announcement."""
        return self._ring_unread

    def close(self) -> None:
        """Let go (the records not confirmed come again to the next consumer)."""
        if self._conn is not None:
            try:
                self._flush()
            except (EOFError, OSError):
                pass
            self._conn.close()
            self._conn = None
        store, self._store = getattr(self, "_store", None), None
        if store is not None:
            store.close()

    def __enter__(self) -> "MooncakeTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_conn", None) is not None:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- how the extraction opens it --------------------------------------------------------------------------
    @staticmethod
    def for_requests(address: str, owner: Optional[int], part_bytes: Optional[int] = None) -> "MooncakeTransport":
        """`part_bytes` (--part-mb): not used here (a record comes whole over Mooncake)."""
        from sglang_hs.extract.errors import ExtractError

        try:
            return MooncakeTransport(address, ack=True)
        except (ValueError, MooncakeUnavailable, ConnectionError, RuntimeError) as e:
            raise ExtractError(f"--mooncake: {e}") from None

    for_harvest = for_requests
