"""python -m sglang_hs.extract --from-dump DIR --output OUT: training files from a harvesting server.

A server harvesting live traffic (--hs-capture opt-in, --hs-capture-sample P; docs/harvest.md) publishes
one record per captured request: its prompt and the tokens it generated, with their rows, and where the
prompt ends. This attaches to its dump dir as the acknowledging reader
(HiddenStateReader(ack=True)) and turns each record into one training file with the extraction CLI's
sinks (--format specforge or safetensors, --save-dtype with its FP8), loss mask 1 on the generated rows
(rows >= the record's prompt_len), without running the model again.

Nothing lost, nothing twice: a record is acknowledged (its ring bytes go back to the server) only once
its file is renamed into place (sinks.py) and journaled, so a harvester killed at any point and started
again gets every record it had not acknowledged again. A record's file index is fixed by the record:
the number of its ring (its manifest ring_id, numbered in the journal in the order rings were first
seen) shifted left 32 bits, plus its sequence number in that ring; a record whose file or journal line is
already there is only acknowledged. The journal (harvest.jsonl in --output, one fsynced line per file)
is held under an exclusive lock for the harvester's life (a second harvester into the same --output, e.g.
of another server, would number its ring 0 too and overwrite the first one's files: it is refused); a line
of it says what the files are (--format, --save-dtype, the model and its captured layers: a harvester
started again against another setup is refused), and it says which request each file holds: rid, ring,
sequence number, prompt length and the last generated token (no row of its own, so not in the file:
input_ids[prompt_len:] + [next_token] is what the server sent back).

A restarted server (a new ring) is followed once the old ring's records are harvested: its records are
numbered as another ring's, so no file is written over (HiddenStateReader(reattach=True)).

Skipped and counted: marker records (requests served without capture) and records with no generated row
(prompt_len >= T: a request that generated at most one token; its loss mask would be all zero, and a
file that trains nothing only costs disk). A record whose rows hold inf or NaN under an FP8 --save-dtype
(no FP8 scale stores them) is skipped, counted (non_finite_rows), reported with its rid and acknowledged,
so the queue moves on: acknowledged never, it would stop every restart at the same record. Not kept in
bf16 instead: a NaN row makes NaN loss and gradients in training (neither trainer masks it out), and a
bf16 file among FP8 ones is refused by the finalize step (files of one dtype) and by FP8 training. Runs until SIGINT or SIGTERM (the file in hand is finished),
--max-samples files written, or --idle-timeout seconds without a record while the server has no captured
request in flight (its status files, sglang_hs/status.py; a server gone counts as idle); then writes the manifest and,
with --format safetensors and the final state, speculators' dataset over every hs_*.safetensors in
--output, as a completed extraction run does (so `--finalize` applies as well).
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from typing import Optional

import torch

from sglang_hs.extract.fp8 import NonFiniteRows

JOURNAL = "harvest.jsonl"
RING_SHIFT = 32  # file index = ring number << RING_SHIFT | sequence number
POLL_S = 0.2  # how often a harvester waiting for records looks at its stop conditions


# what the files in one --output must share (manifest.json's names): a harvester started again checks them
SETUP_KEYS = ("format", "save_dtype", "model_path", "architecture", "dtype", "hidden_size", "num_hidden_layers",
              "layer_ids", "last_hidden_state")


class Journal:
    """harvest.jsonl: a line with the setup ({"setup": {...}}), a line per ring first seen ({"ring",
    "number"}) and per file ({"index", "rid", ...}), each appended and fsynced. Opening it takes an
    exclusive lock (flock, dropped by the kernel when the process dies, so a SIGKILLed harvester leaves
    none behind) or refuses; a line a crash cut short is dropped."""

    def __init__(self, out_dir: str, share_gid: Optional[int] = None) -> None:
        import stat

        from sglang_hs.extract.errors import ExtractError

        self.path = os.path.join(out_dir, JOURNAL)
        self.rings: dict = {}  # ring_id -> number
        self.files: dict = {}  # file index -> its line
        self.setup: Optional[dict] = None
        try:  # 0600 (0640 of --output-group), never through a symlink, never a special file
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                               | os.O_NONBLOCK, 0o600)
        except OSError as e:
            why = "a symlink: refusing to follow it" if os.path.islink(self.path) else e.strerror
            raise ExtractError(f"{self.path}: cannot open the harvest journal ({why})") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(self._fd)
            raise ExtractError(f"{self.path}: not a regular file of this user (uid {st.st_uid}): refusing it")
        from sglang_hs.fsutil import _set_mode

        _set_mode(self._fd, 0o600, 0o640, share_gid)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ExtractError(f"--output {out_dir} is being harvested into by another harvester (it holds the lock "
                               f"on {JOURNAL}): give each harvester its own --output") from None
        try:
            self._load(ExtractError)
        except BaseException:
            os.close(self._fd)
            raise

    def _load(self, ExtractError) -> None:
        with os.fdopen(os.dup(self._fd), "rb") as f:  # the file opened, not whatever the name is now
            f.seek(0)
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            os.ftruncate(self._fd, end)
        for n, line in enumerate(data[:end].splitlines(), 1):
            try:
                entry = json.loads(line)
                if "index" in entry:
                    self.files[int(entry["index"])] = entry
                elif "setup" in entry:
                    self.setup = dict(entry["setup"])
                else:
                    self.rings[str(entry["ring"])] = int(entry["number"])
            except (ValueError, KeyError, TypeError):
                raise ExtractError(f"{self.path}: line {n} is not a journal entry ({line[:80]!r})") from None

    def check_setup(self, setup: dict, out_dir: str) -> None:
        """The files already in --output were made with `setup`, or there are none yet (then it is written):
        files of another --format, --save-dtype or model (its layers, hidden size, dtype) are not one set."""
        from sglang_hs.extract.errors import ExtractError

        before = self.setup
        if before is None:  # a journal of a version that wrote none: the last run's manifest says it
            try:
                with open(os.path.join(out_dir, "manifest.json")) as f:
                    before = {k: v for k, v in json.load(f).items() if k in SETUP_KEYS} or None
            except (OSError, ValueError):
                pass
        if before is not None:
            differ = [k for k in SETUP_KEYS if k in before and before[k] != setup[k]]
            if differ:
                said = "; ".join(f"{k} {before[k]!r} there, {setup[k]!r} now" for k in differ)
                raise ExtractError(f"--output {out_dir} holds files harvested with another setup ({said}): harvest "
                                   "into another --output")
        if self.setup is None:
            self.setup = dict(setup)
            self._append({"setup": self.setup})

    def _append(self, entry: dict) -> None:
        os.write(self._fd, (json.dumps(entry) + "\n").encode())
        os.fsync(self._fd)

    def ring_number(self, ring_id: str) -> int:
        if ring_id not in self.rings:
            self.rings[ring_id] = len(self.rings)
            self._append({"ring": ring_id, "number": self.rings[ring_id]})
        return self.rings[ring_id]

    def add_file(self, entry: dict) -> None:
        self._append(entry)
        self.files[entry["index"]] = entry

    def close(self) -> None:
        """Unlocks; a journal left empty (a run refused before its setup line) is removed, so the folder
        does not look like a harvest's."""
        if os.fstat(self._fd).st_size == 0:
            os.unlink(self.path)
        os.close(self._fd)


def loss_mask(rec) -> torch.Tensor:
    """1 on the generated rows (rows >= prompt_len), 0 on the prompt's."""
    return (torch.arange(rec.num_tokens) >= rec.prompt_len).long()


class Harvester:
    def __init__(self, reader, sink, journal: Journal, stats) -> None:
        self.reader, self.sink, self.journal, self.stats = reader, sink, journal, stats

    def handle(self, rec) -> None:
        """One record: its file (unless there already), its journal line, then the acknowledgement."""
        T = rec.num_tokens
        if rec.prompt_len >= T:
            self.stats.skipped["no_generated_rows"] += 1
            self.reader.ack(rec)
            return
        ring_id = rec.ring_id  # of the server run that published it: a restarted server's is a new ring
        index = self.journal.ring_number(ring_id) << RING_SHIFT | rec.seq
        if index in self.journal.files:  # written and journaled by a harvester killed before it acknowledged
            self.stats.resumed += 1
        else:
            if self.sink.done(index):  # renamed into place, killed before its journal line
                self.stats.resumed += 1
            else:
                try:
                    self.stats.bytes += self.sink.write(index, rec.input_ids, loss_mask(rec), rec.aux_hidden_states,
                                                        self.sink.final_of(rec))
                except NonFiniteRows:  # never stored: skipped, counted and acknowledged (module docstring)
                    self._skip(rec, ring_id, "non_finite_rows", f"its hidden states hold inf or NaN, which "
                               f"--save-dtype {self.sink.save_dtype} cannot store")
                    return
                self.stats.done += 1
                self.stats.tokens += T
            self.journal.add_file({"index": index, "rid": rec.rid, "ring": ring_id, "seq": rec.seq, "tokens": T,
                                   "prompt_len": rec.prompt_len, "next_token": rec.next_token})
        self.reader.ack(rec)


    def _skip(self, rec, ring_id: str, reason: str, detail: str) -> None:
        line = self.stats.skip(reason, detail, f"record {rec.rid} (ring {ring_id}, sequence number {rec.seq})",
                               rid=rec.rid, ring=ring_id, seq=rec.seq)
        if line:
            print(line, file=sys.stderr, flush=True)
        self.reader.ack(rec)


def setup_of(ns, manifest: dict) -> dict:
    """What the files of this run are (SETUP_KEYS), from the flags and the server's manifest."""
    return {"format": ns.format, "save_dtype": ns.save_dtype, "model_path": manifest["model_path"],
            "architecture": manifest["architecture"], "dtype": manifest["dtype"],
            "hidden_size": manifest["hidden_size"], "num_hidden_layers": manifest["num_hidden_layers"],
            "layer_ids": list(manifest["layer_ids"]), "last_hidden_state": manifest["last"]}


def _open_reader(ns):
    from sglang_hs.extract.errors import ExtractError
    from sglang_hs.reader import MANIFEST, HiddenStateReader, no_writer_here

    dump = os.path.abspath(ns.from_dump)
    if not os.path.isdir(dump):
        raise ExtractError(f"--from-dump: {dump} is not a folder")
    why = no_writer_here(dump)  # a node of a multi-node server hosting no writer: nothing to harvest here
    if why is not None:
        raise ExtractError(f"--from-dump: {why}")
    if not os.path.exists(os.path.join(dump, MANIFEST)):
        raise ExtractError(f"--from-dump: {dump} holds no {MANIFEST} (is a server running with --hs-dump-dir {dump}?)")
    try:
        return HiddenStateReader(dump, wait=5, ack=True, recycle_memory=True, owner=ns.hs_owner, reattach=True)
    except (RuntimeError, ValueError, OSError) as e:  # another reader, another format, permissions
        raise ExtractError(f"--from-dump: {e}") from None


def _idle(dump_dir: str, reader) -> bool:
    """--idle-timeout ran out without a record: the run ends only if the server is idle too, i.e. a status
    snapshot written now (sglang_hs.status) holds no request whose record or marker is still to come, and
    the ring holds no record published before it; or no server process is there any more."""
    from sglang_hs import status

    n = status.in_flight(dump_dir)
    if n:
        print(f"[extract] --idle-timeout: no record, but the server has {n} request(s) in flight: waiting for "
              "their records", file=sys.stderr, flush=True)
        return False
    return reader.poll() == 0


def run(ns, sink, out_dir: str) -> int:
    """The --from-dump run (module docstring); returns the exit status."""
    from sglang_hs.extract.errors import PROG, ExtractError
    from sglang_hs.extract.output import (Stats, check_final_state, check_streams, model_vocab_size, prepare_output,
                                          print_summary, print_training_command, write_manifest)
    from sglang_hs.extract.sinks import SinkError
    from sglang_hs.reader import ServerRestarted
    from sglang_hs.server.store.ring import TornRecord

    stop = []

    def on_signal(signum, frame):
        stop.append(signal.Signals(signum).name)

    reader = journal = harvester = manifest = dataset = None
    status, rc = "failed", 1
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    torch.set_num_threads(ns.torch_threads)
    try:
        prepare_output(out_dir, getattr(ns, "output_gid", None))
        have = sink.existing()
        if have and not os.path.lexists(os.path.join(out_dir, JOURNAL)):
            raise ExtractError(f"--output {out_dir} already holds {have} {ns.format} sample files of another run "
                               "(no harvest journal): choose another folder")
        journal = Journal(out_dir, getattr(ns, "output_gid", None))  # locked: the partial files removed below are no other harvester's
        sink.remove_partial()
        reader = _open_reader(ns)
        manifest = reader.manifest
        check_final_state(ns.format, sink, manifest, f"the server of {ns.from_dump}")
        check_streams(ns.format, manifest, f"the server of {ns.from_dump}")
        journal.check_setup(setup_of(ns, manifest), out_dir)
        sink.layer_ids = list(manifest["layer_ids"])
        sink.rows_per_layer = int(manifest.get("rows_per_layer", 1))
        harvester = Harvester(reader, sink, journal, Stats())
        print(f"[extract] harvesting {ns.from_dump} into {out_dir} (--format {ns.format}); stop with Ctrl-C or "
              "SIGTERM", file=sys.stderr, flush=True)
        last_record = time.monotonic()
        torn = None
        restarts = 0
        while not stop and (ns.max_samples is None or harvester.stats.done < ns.max_samples):
            try:
                rec = reader.next(timeout=POLL_S)
            except TimeoutError:
                if ns.idle_timeout is not None and time.monotonic() - last_record > ns.idle_timeout:
                    if _idle(ns.from_dump, reader):  # the server has nothing in flight either
                        break
                    last_record = time.monotonic()  # requests in flight: their records are coming
                continue
            except (TornRecord, ServerRestarted) as e:  # the ring's bytes are not what the server wrote, or a
                torn = e  # restarted server this harvester cannot follow: nothing after it is read
                break
            finally:
                if reader.restarts != restarts:  # followed a restarted server to its new ring
                    restarts = reader.restarts
                    print(f"[extract] the server of {ns.from_dump} was restarted: harvesting its new ring", file=sys.stderr,
                          flush=True)
            last_record = time.monotonic()
            harvester.handle(rec)
        status, rc = ("stopped by " + stop[0] if stop else "complete"), 0
        if torn is not None:  # the files written so far are whole: they are finalized as a stopped run's
            status = "stopped by a torn record" if isinstance(torn, TornRecord) else "stopped: the server was restarted"
            rc = 1
            print(f"{PROG}: error: --from-dump: {torn} (the files written before it are kept)", file=sys.stderr)
        if manifest["last"]:
            try:
                dataset = sink.finalize()
            except SinkError as e:
                status, rc = ("complete" if torn is None else status) + " without the training set", 1
                print(f"{PROG}: error: {e}", file=sys.stderr)
    except (ExtractError, OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        rc = 2 if harvester is None else 1
    except BaseException:  # dying (a bug, KeyboardInterrupt outside the loop): no manifest, the lock goes
        if journal is not None:
            journal.close()
        raise
    finally:
        torch.set_num_threads(threads)
        for s, h in old.items():
            signal.signal(s, h)
        if reader is not None:
            reader.close()  # records not acknowledged stay in the ring for the next harvester
    try:
        if harvester is not None:
            stats = harvester.stats
            stats.skipped["served_without_capture"] += reader.markers
            stats.t1, stats.cpu1 = time.monotonic(), time.process_time()
            print_summary(stats, out_dir)
            write_manifest(out_dir, manifest, ns, stats, sink, status, dataset)
            if rc == 0:  # as a --data run does: the trainer's command on these files (SpecForge: its run config)
                print_training_command(out_dir, dict(manifest, vocab_size=model_vocab_size(manifest["model_path"])),
                                       sink.name, ns.save_dtype, getattr(ns, "output_gid", None))
    finally:
        if journal is not None:
            journal.close()  # after the manifest: no other harvester writes into --output before it is there
    return rc


def check_args(ns, launcher_args) -> Optional[str]:
    """Why these flags cannot go with --from-dump (one line), else None."""
    if launcher_args:
        return f"{launcher_args[0]}: --from-dump reads a running server's dump; it starts no server"
    for flag, given in (("--data", ns.data), ("--server", ns.server), ("--hs-dump-dir", ns.hs_dump_dir),
                        ("--regenerate", ns.regenerate), ("--verify", ns.verify), ("--shard", ns.shard != "0/1")):
        if given:
            return f"{flag} does not go with --from-dump: the records come from the server's live traffic"
    if ns.idle_timeout is not None and ns.idle_timeout <= 0:
        return f"--idle-timeout: seconds > 0, got {ns.idle_timeout}"
    if ns.max_samples is not None and ns.max_samples < 1:
        return f"--max-samples: must be >= 1 with --from-dump, got {ns.max_samples}"
    return None
