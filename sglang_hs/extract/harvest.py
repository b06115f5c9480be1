"""python -m sglang_hs.extract --from-dump DIR --output OUT: training files from a harvesting server.

A server harvesting live traffic (--hs-capture opt-in, --hs-capture-sample P; docs/harvest.md) publishes
one record per captured request: its prompt and the tokens it generated, with their rows, and where the
prompt ends. This attaches to its dump dir as the acknowledging reader
(HiddenStateReader(ack=True)) and turns each record into one training file with the extraction CLI's
sinks (--format specforge or safetensors, --save-dtype with its FP8), loss mask 1 on the generated rows
(rows >= the record's prompt_len), without running the model again.

Nothing lost, nothing twice: a record is acknowledged (its ring bytes go back to the server) only once
its file is renamed into place (sinks/) and journaled, so a harvester killed at any point and started
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
(no FP8 scale stores them), or, with --format deepspec's unscaled FP8, a value beyond the dtype's range
(fp8_out_of_range), is skipped, counted, reported with its rid and acknowledged,
so the queue moves on: acknowledged never, it would stop every restart at the same record. Not kept in
bf16 instead: a NaN row makes NaN loss and gradients in training (neither trainer masks it out), and a
bf16 file among FP8 ones is refused by the finalize step (files of one dtype) and by FP8 training. Runs until SIGINT or SIGTERM (the file in hand is finished),
--max-samples files written, or --idle-timeout seconds without a record while the server has no captured
request in flight (its status files, sglang_hs/status.py; a server gone counts as idle); then writes the manifest and,
with --format safetensors and the final state, speculators' dataset over every hs_*.safetensors in
--output, as a completed extraction run does (so `--finalize` applies as well).

Here: the harvest traffic as a source (traffic: the records in arrival order until the run stops), and the
stage that turns each record into its file, journal line and acknowledgement (Harvester); the run itself is
pipeline.run_harvest, the journal journal.py.
"""
from __future__ import annotations

import sys
import time
from typing import Iterator, Optional

from sglang_hs.extract.journal import JOURNAL, SETUP_KEYS, Journal, setup_of  # noqa: F401 (the harvest's journal)
from sglang_hs.extract.sinks.base import Sink
from sglang_hs.extract.stats import Stats
from sglang_hs.extract.transport.base import Transport
from sglang_hs.extract.writer import RecordGivenBack, sink_chunks

RING_SHIFT = 32  # file index = ring number << RING_SHIFT | sequence number
POLL_S = 0.2  # how often a harvester waiting for records looks at its stop conditions


def loss_mask(rec):
    """1 on the generated rows (rows >= prompt_len), 0 on the prompt's."""
    import torch

    return (torch.arange(rec.num_tokens) >= rec.prompt_len).long()


class Harvester:
    def __init__(self, reader: Transport, sink: Sink, journal: Journal, stats: Stats) -> None:
        self.reader, self.sink, self.journal, self.stats = reader, sink, journal, stats

    def handle(self, rec) -> None:
        """One record: its file (unless there already), its journal line, then the acknowledgement."""
        from sglang_hs.extract.fp8 import UnstorableRows, skip_detail

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
                    self.stats.bytes += self.sink.write(self.sink.sample_of(index, rec, loss_mask(rec)),
                                                        chunks=sink_chunks(self.reader, self.sink, rec),
                                                        before_commit=lambda: self._still_the_records(rec))
                except UnstorableRows as e:  # never stored: skipped, counted and acknowledged (module docstring)
                    self._skip(rec, ring_id, e.reason, skip_detail(e, self.sink.save_dtype))
                    return
                self.stats.done += 1
                self.stats.tokens += T
            # a speculative server's per-step acceptance (the record's meta): a trainer weights or filters by it
            self.journal.add_file({"index": index, "rid": rec.rid, "ring": ring_id, "seq": rec.seq, "tokens": T,
                                   "prompt_len": rec.prompt_len, "next_token": rec.next_token,
                                   **({"speculative": rec.meta["speculative"]} if "speculative" in rec.meta else {})})
        self.reader.ack(rec)

    def _still_the_records(self, rec) -> None:
        """A long record's views (--part-mb) were its own bytes all along (HiddenStateReader.intact), else no file."""
        if not self.reader.intact(rec):
            raise RecordGivenBack(self.reader.dump_dir)

    def _skip(self, rec, ring_id: str, reason: str, detail: str) -> None:
        line = self.stats.skip(reason, detail, f"record {rec.rid} (ring {ring_id}, sequence number {rec.seq})",
                               rid=rec.rid, ring=ring_id, seq=rec.seq)
        if line:
            print(line, file=sys.stderr, flush=True)
        self.reader.ack(rec)


def traffic(reader: Transport, dump_dir: str, stop: list, idle_timeout: Optional[float]) -> Iterator:
    """The records `reader` gets from the harvesting server of `dump_dir` (--from-dump), in arrival order, until
    `stop` holds a signal's name, or --idle-timeout seconds pass without a record while the server is idle too
    (_idle). A torn record (TornRecord) or a restarted server this reader cannot follow (ServerRestarted) is
    raised: nothing after it is read."""
    last_record = time.monotonic()
    restarts = 0
    while not stop:
        try:
            rec = reader.next(timeout=POLL_S)
        except TimeoutError:
            if idle_timeout is not None and time.monotonic() - last_record > idle_timeout:
                if _idle(dump_dir, reader):  # the server has nothing in flight either
                    return
                last_record = time.monotonic()  # requests in flight: their records are coming
            continue
        finally:
            if reader.restarts != restarts:  # followed a restarted server to its new ring
                restarts = reader.restarts
                print(f"[extract] the server of {dump_dir} was restarted: harvesting its new ring", file=sys.stderr,
                      flush=True)
        last_record = time.monotonic()
        yield rec


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
