"""python -m sglang_hs.publish --hs-dump-dir DIR --listen HOST:PORT --mooncake-master HOST:PORT --mooncake-metadata URL

The serving node's half of the cross-machine transport (docs/remote.md): an ordinary acknowledging reader of the
server's node-local ring that puts each finished record into Mooncake's store, in a segment this process hosts
(a put is a copy into local memory: the server never waits on the network, and nothing waits inside the
server at all: it only writes its ring), and announces it to the one consumer connected to --listen
(sglang_hs.extract.transport.mooncake.MooncakeTransport: LiveHiddenStates(transport="mooncake"),
`python -m sglang_hs.extract --transport mooncake`). A ring record is acked, and its store object removed,
only once that consumer confirms it:
- at most --window-mb of records are put and unconfirmed; past it the publisher stops reading, the ring fills
  and the server's admission control holds new requests, exactly as behind a slow local reader;
- a consumer that goes away (killed, closed) leaves its unconfirmed records here, and the next consumer gets
  them first, flagged redelivered; the publisher says how many in one line;
- markers (requests served without capture) are handed on; a restarted server is followed (same setup).
"""
from __future__ import annotations

import argparse
import collections
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Optional

PROG = "python -m sglang_hs.publish"
MIN_SEGMENT_MB = 32  # Mooncake refuses a segment under 16 MB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("--hs-dump-dir", required=True, metavar="DIR", help="the server's --hs-dump-dir (on this node)")
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where the consumer connects (port 0: any free one, printed at start)")
    p.add_argument("--mooncake-master", required=True, metavar="HOST:PORT", help="Mooncake's master (mooncake_master)")
    p.add_argument("--mooncake-metadata", required=True, metavar="URL",
                   help="Mooncake's metadata server: http://HOST:PORT/metadata (mooncake_master "
                        "--enable_http_metadata_server, or mooncake_http_metadata_server), or P2PHANDSHAKE")
    p.add_argument("--mooncake-host", default=None, metavar="HOST",
                   help="this host's address as the consumer reaches it (default: --listen's host, or the hostname)")
    p.add_argument("--mooncake-protocol", default="tcp", metavar="PROTO", help="tcp (default) or rdma")
    p.add_argument("--mooncake-device", default="", metavar="NAMES", help="RDMA devices (with --mooncake-protocol rdma)")
    p.add_argument("--window-mb", type=float, default=1024.0,
                   help="records put into Mooncake and not confirmed by the consumer, at most (MB; default 1024); "
                        "past it the ring fills and the server's admission holds new requests")
    p.add_argument("--segment-mb", type=float, default=None,
                   help=f"memory this process hosts for Mooncake's store (MB; default twice --window-mb, at least "
                        f"{MIN_SEGMENT_MB})")
    p.add_argument("--hs-owner", default=None, metavar="USER", help="the server's user when it is not you")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the server's manifest")
    return p


class PublishError(RuntimeError):
    """One line naming the flag and what was expected."""


def check_args(args) -> None:
    from sglang_hs.extract.transport.mooncake import PROTOCOLS, parse_address

    for flag, value in (("--listen", args.listen), ("--mooncake-master", args.mooncake_master)):
        try:
            parse_address(value, flag, any_port=flag == "--listen")
        except ValueError as e:
            raise PublishError(str(e)) from None
    if args.mooncake_protocol not in PROTOCOLS:
        raise PublishError(f"--mooncake-protocol: expected one of {', '.join(PROTOCOLS)}, got {args.mooncake_protocol!r}")
    if args.mooncake_protocol == "rdma" and not args.mooncake_device:
        raise PublishError("--mooncake-device: expected the RDMA devices to use with --mooncake-protocol rdma (e.g. mlx5_0)")
    if not (args.window_mb > 0):
        raise PublishError(f"--window-mb: expected a size in MB > 0, got {args.window_mb}")
    if args.segment_mb is not None and not (args.segment_mb >= max(args.window_mb, MIN_SEGMENT_MB)):
        raise PublishError(f"--segment-mb: expected at least --window-mb ({args.window_mb:g}) and {MIN_SEGMENT_MB} "
                           f"(Mooncake's least), got {args.segment_mb:g}")
    meta = args.mooncake_metadata
    if not (meta == "P2PHANDSHAKE" or meta.startswith(("http://", "https://", "etcd://", "redis://"))):
        raise PublishError(f"--mooncake-metadata: expected http://HOST:PORT/metadata or P2PHANDSHAKE, got {meta!r}")


def segment_warning(largest: int, segment: int, parts: bool = False) -> Optional[str]:
    """One line when a record the server may write (`largest` bytes: reader.largest_record_bytes) cannot fit this
    process's Mooncake segment: such a record stops the publisher when it comes (it stays in the ring, nothing is
    lost), so say so at start, with what would take it. `parts`: the server publishes long records in parts
    (--hs-record-part-size), so its records are bounded by its context, not its ring. None when every record fits."""
    if largest <= segment:
        return None
    mb = 1 << 20
    bound, cap = (("its context's, in parts", "a shorter --context-length") if parts else
                  ("half its ring", "--hs-max-record-tokens"))
    return (f"[publish] warning: the server admits records of up to {largest / mb:.0f} MB ({bound}), more than the "
            f"{segment / mb:g} MB Mooncake segment holds (--segment-mb): such a record would stop this publisher (it "
            f"stays in the ring); raise --segment-mb to at least {-(-largest // mb)} or cap the server's records "
            f"({cap})")


class Publisher:
    def __init__(self, reader, store, listener, master: str, metadata: str, protocol: str, window_bytes: int,
                 log=print) -> None:
        from sglang_hs.extract.transport.mooncake import Staging
        from sglang_hs.reader import MAX_MARKERS

        self.reader, self.store, self.listener = reader, store, listener
        self.mooncake = {"master": master, "metadata": metadata, "protocol": protocol}
        self.window, self.log = window_bytes, log
        self.ns = f"sglang-hs/{uuid.uuid4().hex[:16]}"  # this publisher's keys: another's never collide
        self.staging = Staging(store)
        from mooncake.store import ReplicateConfig  # loaded with the store (load_mooncake)

        # every record into this process's own segment (a local copy: the network is the consumer's to cross, and
        # never a dead publisher's segment the master still lists), hard-pinned: never evicted while unconfirmed
        self.put_config = ReplicateConfig()
        self.put_config.preferred_segment = store.get_hostname()
        self.put_config.with_hard_pin = True
        self.pending: "collections.deque" = collections.deque()  # read from the ring, not put yet (ring views)
        self.outstanding: "collections.OrderedDict[int, list]" = collections.OrderedDict()  # n -> [rec, header]
        self.outstanding_bytes = 0
        self.n, self.restarts = 0, reader.restarts
        self.conn, self.peer = None, None
        self.confirmed = 0
        self.syncs: list = []  # the consumer's sync requests of this step (MooncakeTransport.sync)
        # markers (requests served without capture) not handed on yet: kept for the next consumer, the oldest
        # dropped past MAX_MARKERS as the reader does
        self.markers: "collections.deque" = collections.deque(maxlen=MAX_MARKERS)
        self._incoming: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="sglang-hs-publish-accept").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self.listener.accept()
            except OSError:
                return
            self._incoming.put((conn, self.listener.last_accepted))

    # -- the consumer ---------------------------------------------------------------------------------------
    def _send(self, message: dict) -> bool:
        from sglang_hs.extract.transport.mooncake import send

        if self.conn is None:
            return False
        try:
            send(self.conn, message)
            return True
        except (OSError, EOFError):
            self._lost()
            return False

    def _lost(self) -> None:
        self.conn.close()
        self.conn = None
        self.log(f"[publish] consumer {self.peer} left: {len(self.outstanding)} records it did not confirm go to "
                 "the next consumer")

    def _admit(self) -> None:
        from sglang_hs.extract.transport.mooncake import WIRE_VERSION, send

        while True:
            try:
                conn, peer = self._incoming.get_nowait()
            except queue.Empty:
                return
            if self.conn is not None:
                try:
                    send(conn, {"error": f"already consumed by {self.peer}: one consumer at a time"})
                finally:
                    conn.close()
                continue
            self.conn, self.peer, self.syncs = conn, f"{peer[0]}:{peer[1]}", []
            again = sum(1 for _, header in self.outstanding.values() if header.get("redelivered"))
            self.log(f"[publish] consumer {self.peer} connected" + (f"; {again} records re-delivered (announced "
                     "to a consumer that left without confirming them)" if again else ""))
            if not self._send({"version": WIRE_VERSION, "manifest": self.reader.manifest, "restarts": self.restarts,
                               "mooncake": self.mooncake}):
                continue
            self._send_markers()
            for rec, header in list(self.outstanding.values()):
                if not self._send({"record": header, "ring_unread": self.reader.unread_bytes()}):
                    break
                header["redelivered"] = True

    def _receive(self, timeout: float) -> int:
        from sglang_hs.extract.transport.mooncake import receive

        if self.conn is None:
            return 0
        n = 0
        try:
            while self.conn.poll(timeout):
                timeout = 0
                message = receive(self.conn)
                if "sync" in message:  # answered once this step has read the ring and put what the window takes
                    self.syncs.append(message["sync"])
                for delivery in message.get("ack", ()):
                    entry = self.outstanding.pop(int(delivery), None)
                    if entry is None:
                        continue  # confirmed already (a duplicate)
                    rec, header = entry
                    self.reader.ack(rec)
                    self.store.remove(header["key"], True)
                    self.outstanding_bytes -= header["nbytes"]
                    self.confirmed += 1
                    n += 1
        except (OSError, EOFError, ValueError):
            self._lost()
        return n

    # -- the ring -------------------------------------------------------------------------------------------
    def _read(self) -> int:
        n = self.reader.poll()
        self.markers.extend(self.reader.take_markers())
        self._send_markers()
        while self.reader.ready_rids():
            self.pending.append(self.reader.next())
        if self.reader.restarts != self.restarts:
            self.restarts = self.reader.restarts
            self._send({"manifest": self.reader.manifest, "restarts": self.restarts})
        return n

    def _send_markers(self) -> None:
        while self.markers and self.conn is not None:
            rid, reason = self.markers[0]
            if self._send({"marker": rid, "reason": reason}):
                self.markers.popleft()

    def _put(self) -> int:
        """Put pending records while the window has room; returns how many."""
        import torch

        from sglang_hs.extract.transport.mooncake import payload_layout

        n = 0
        while self.pending:
            rec = self.pending[0]
            T, K, H = rec.aux_hidden_states.shape
            # the final states in the ring's row order (reader.finals), so the consumer's views are the reader's
            finals = [rec.last_hidden_state if f == "post-norm" else rec.last_pre_norm for f in self.reader.finals]
            P, dtype = K + len(finals), rec.aux_hidden_states.dtype
            rows_at, total = payload_layout(T, P, H, rec.aux_hidden_states.element_size())
            if self.outstanding and self.outstanding_bytes + total > self.window:
                break  # the window is full: the ring keeps the rest (and the server's admission sees it)
            buf = self.staging.get(total)
            buf[:4 * T].view(torch.int32).copy_(rec.input_ids)
            rows = buf[rows_at:total].view(dtype).view(T, P, H)
            rows[:, :K].copy_(rec.aux_hidden_states)
            for i, f in enumerate(finals):
                rows[:, K + i].copy_(f)
            if not self.reader.intact(rec):
                raise RuntimeError(f"{self.reader.dump_dir}: the record of {rec.rid!r} was given back to the server "
                                   "while being read (someone else wrote the ring's read offset: a member of the "
                                   "share group?)")
            key = f"{self.ns}/{self.n + 1}"
            rc = self.store.put_from(key, buf.data_ptr(), total, self.put_config)
            if rc != 0:
                if self.outstanding:
                    break  # the store is full for now: try again once records are confirmed
                raise RuntimeError(f"Mooncake put of {total} bytes failed (status {rc}): is --segment-mb large "
                                   "enough for one record?")
            self.n += 1
            self.pending.popleft()
            header = {"n": self.n, "key": key, "rid": rec.rid, "seq": rec.seq, "writer": rec.writer,
                      "ring_id": rec.ring_id, "generation": rec.generation, "dp_rank": rec.dp_rank,
                      "prompt_len": rec.prompt_len, "next_token": rec.next_token, "meta": rec.meta,
                      "tokens": T, "rows": P, "hidden": H, "dtype": str(dtype).removeprefix("torch."),
                      "nbytes": total}
            self.outstanding[self.n] = [rec, header]
            self.outstanding_bytes += total
            if self._send({"record": header, "ring_unread": self.reader.unread_bytes()}):
                header["redelivered"] = True  # any later announcement of it is a re-delivery
            n += 1
        return n

    def step(self, wait: float) -> int:
        self._admit()
        n = self._receive(0)
        n += self._read()
        n += self._put()
        while self.syncs and self.conn is not None:
            self._send({"sync": self.syncs.pop(0)})
        if not n:
            if self.conn is not None:
                self._receive(wait)  # wakes at the consumer's next confirmation
            else:
                time.sleep(wait)
        return n

    def run(self) -> None:
        while not self._stop.is_set():
            self.step(0.005)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        try:
            self.listener.close()
        except OSError:
            pass
        if self.conn is not None:
            self.conn.close()
        for _, header in self.outstanding.values():
            self.store.remove(header["key"], True)
        self.reader.close()  # the records not confirmed stay in the ring
        self.store.close()


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except PublishError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from multiprocessing.connection import Listener

    from sglang_hs.extract.transport.mooncake import MooncakeUnavailable, open_store, parse_address
    from sglang_hs.reader import HiddenStateReader, NoWriterHere

    host, port = parse_address(args.listen, "--listen", any_port=True)
    local = args.mooncake_host or (host if host not in ("0.0.0.0", "::", "") else socket.gethostname())
    window = int(args.window_mb * (1 << 20))
    segment = int((args.segment_mb or max(2 * args.window_mb, MIN_SEGMENT_MB)) * (1 << 20))
    try:
        # no part_bytes: a record that leaves the ring in parts comes here assembled, one copy of its whole rows
        # (each part released as it is copied), since Mooncake hands a record over whole anyway
        reader = HiddenStateReader(args.hs_dump_dir, wait=args.wait, ack=True, zero_copy=True, reattach=True,
                                   owner=args.hs_owner)
    except (RuntimeError, NoWriterHere, FileNotFoundError, ValueError, PermissionError) as e:
        print(f"{PROG}: error: --hs-dump-dir: {e}", file=sys.stderr)
        return 2
    try:
        store = open_store(local, args.mooncake_metadata, segment, args.mooncake_protocol, args.mooncake_device,
                           args.mooncake_master)
    except (MooncakeUnavailable, ConnectionError) as e:
        reader.close()
        print(f"{PROG}: error: --mooncake-master: {e}", file=sys.stderr)
        return 2
    try:
        listener = Listener((host, port), family="AF_INET")
    except OSError as e:
        reader.close()
        store.close()
        print(f"{PROG}: error: --listen: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 2
    pub = Publisher(reader, store, listener, args.mooncake_master, args.mooncake_metadata, args.mooncake_protocol,
                    window, log=lambda line: print(line, flush=True))

    def _on_term(signum, frame):
        pub.stop()

    signal.signal(signal.SIGTERM, _on_term)
    bound = listener.address
    print(f"[publish] {reader.dump_dir} -> Mooncake (master {args.mooncake_master}, {args.mooncake_protocol}, this "
          f"host {local}); consumers connect to {bound[0]}:{bound[1]}; window {args.window_mb:g} MB", flush=True)
    warning = segment_warning(reader.largest_record_bytes(), segment, bool(reader.manifest.get("record_part_bytes")))
    if warning:
        print(warning, flush=True)
    try:
        pub.run()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ConnectionError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    finally:
        pub.close()
        print(f"[publish] stopped: {pub.confirmed} records confirmed; {len(pub.outstanding)} put and not confirmed "
              "stay in the ring", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
