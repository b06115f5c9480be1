"""The sink stage of a --data run: each captured sample written by the sink on WRITERS threads (fsync waits on
the disk, not the CPU, so it overlaps serving), at most 2 x WRITERS records held while the disk catches up,
and each record given back to the transport (ack) once its file is in place, or failed. A verified sample's
file is read back and must hold the captured rows. A zero-copy record's file takes its name only if the
record's bytes were still its own once written (the transport's intact()).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
from typing import List, Optional, Tuple

from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.sinks.base import Sink, TrainingSample
from sglang_hs.extract.stats import Stats
from sglang_hs.extract.transport.base import Transport

WRITERS = 4  # threads writing and fsyncing files


class RecordGivenBack(ExtractError):
    """A zero-copy record's ring bytes went back to the server before its file was written: someone else
    wrote the reader's read offset (HiddenStateReader.intact); what was read of them may be torn."""

    def __init__(self, dump_dir: str) -> None:
        super().__init__(f"its record's bytes in the output ring were given back to the server while they were "
                         f"being read (someone else wrote the read offset of {dump_dir}: a member of the share "
                         "group?), so they may be torn: not written, --resume redoes it")


class SampleWriter:
    """`reader`: the transport the records came through (acked here); `sink`: where the files go."""

    def __init__(self, reader: Transport, sink: Sink) -> None:
        self.reader, self.sink = reader, sink
        self.stats = Stats()
        self.writes: List[tuple] = []  # (sample index, tokens, future of sink.write, record), oldest first
        self.write_pool = cf.ThreadPoolExecutor(WRITERS, thread_name_prefix="sglang-hs-write")
        self.verify_failure: Optional[str] = None  # a stored file that does not hold the captured rows
        self._stats_lock = threading.Lock()  # a streamed record's logprob verdict is counted on a writer thread

    def submit(self, index: int, mask, rec, verify: bool, logprobs=None) -> None:
        """Write the sample of record `rec` (its views, zero-copy) with loss mask `mask`, in the background.
        `logprobs`: a streamed record's --verify logprob check (verify.LogprobCheck), fed as the file is written."""
        unwritten = [w[2] for w in self.writes if not w[2].done()]
        if len(unwritten) >= 2 * WRITERS:  # bound the records held in memory while the disk catches up
            cf.wait(unwritten, return_when=cf.FIRST_COMPLETED)
        self.writes.append((index, rec.num_tokens, self.write_pool.submit(
            self._write, index, rec.input_ids, mask, rec.aux_hidden_states, self.sink.final_of(rec), verify,
            rec, sink_chunks(self.reader, self.sink, rec, logprobs), logprobs), rec))

    def _write(self, index, input_ids, mask, aux, last, verify: bool, rec=None, chunks=None, logprobs=None) -> int:
        """Write one sample; a verified sample's file is read back and must hold the captured rows (exactly,
        or within FP8's rounding bound; a long record's chunk by chunk, as `chunks` wrote it), else it is
        removed and VerificationError raised. `rec`: the reader's
        record the tensors are views of; its file takes its name only if the ring bytes were still the
        record's once written (HiddenStateReader.intact), else RecordGivenBack and no file. A streamed record
        (its parts read once, as `chunks` writes them): the read-back compares the file with what that pass kept
        (verify.StoredDigest), and `logprobs` (its logprob check, fed by that pass too) gives its verdict here."""
        from sglang_hs.extract.verify import StoredDigest, VerificationError, check_stored

        def still_the_records() -> None:
            if rec is not None and not self.reader.intact(rec):
                raise RecordGivenBack(self.reader.dump_dir)

        digest = None
        if verify and self.sink.name == "safetensors" and chunks is not None and getattr(rec, "streamed", False):
            digest = StoredDigest(self.sink.save_dtype)
            chunks = digest.tee(chunks)
        try:
            size = self.sink.write(TrainingSample(index, input_ids, mask, aux, last), before_commit=still_the_records,
                                   chunks=chunks)
        except RecordGivenBack:
            raise
        except Exception:  # e.g. FP8's non-finite rows: of torn bytes, say that instead (the sample is redone)
            still_the_records()
            raise
        try:
            if logprobs is not None:
                diff = logprobs.result()
                with self._stats_lock:
                    self.stats.verified += 1
                    self.stats.verify_max_diff = max(self.stats.verify_max_diff, diff)
            if verify and self.sink.name == "safetensors":
                if digest is not None:
                    digest.check(index, self.sink.path(index), (aux.shape[0], aux.shape[1] + (last is not None),
                                                                aux.shape[2]))
                else:
                    check_stored(index, self.sink.path(index), aux, last, self.sink.save_dtype,
                                 None if chunks is None else sink_chunks(self.reader, self.sink, rec))
        except VerificationError:
            os.unlink(self.sink.path(index))
            still_the_records()  # the rows changed under the read-back: torn, not the server's error
            raise
        return size

    def _collect_writes(self, bar) -> int:
        """Count the files written so far; a write that failed (disk full) raises OSError naming the
        file. Returns how many completed."""
        from sglang_hs.extract.fp8 import UnstorableRows, skip_detail

        failed, collected = None, 0
        for w in [w for w in self.writes if w[2].done()]:
            index, T, fut, rec = w
            self.reader.ack(rec)  # the file is in place (or failed): the record's ring bytes go back
            self.writes.remove(w)  # only once acked: an interrupt before leaves it to the next call
            collected += 1
            if fut.cancelled():  # an interrupted or failed run: not written, --resume does it
                continue
            err = fut.exception()
            if err is None:
                self.stats.bytes += fut.result()
                self.stats.done += 1
                self.stats.tokens += T
                bar.update(1)
            elif isinstance(err, UnstorableRows):  # e.g. no FP8 scale stores them: skipped, as the harvester does
                line = self.stats.skip(err.reason, skip_detail(err, self.sink.save_dtype), f"sample {index}",
                                       sample=index)
                if line:
                    bar.write(line, file=sys.stderr)
                bar.update(1)
            elif isinstance(err, OSError):
                failed = failed or OSError(f"cannot write {self.sink.path(index)}: {err.strerror or err}")
                self.stats.failed.append((index, f"cannot write: {err.strerror or err}"))
                bar.update(1)
            else:
                if type(err).__name__ == "VerificationError":
                    self.verify_failure = self.verify_failure or str(err)
                self._fail(index, err, bar)
        if failed is not None:
            raise failed
        return collected

    def drain(self, bar) -> Tuple[bool, Optional[str]]:
        """The end of a run: every started file finished (or removed) and every record acked before the
        transport may go (the writer threads read the records' views of it). A second Ctrl-C / SIGTERM
        meanwhile is taken after, not in the middle (it would leave threads reading bytes another reader
        frees). Returns (whether one came, why the run must fail: a file that could not be written)."""
        failed = None
        interrupted = _uninterrupted(lambda: self.write_pool.shutdown(wait=True, cancel_futures=True))
        try:
            interrupted |= _uninterrupted(lambda: self._collect_writes(bar))
        except OSError as e:
            failed = str(e)
        return interrupted, failed

    def _fail(self, index: int, err, bar) -> None:
        self.stats.failed.append((index, str(err)))
        bar.write(f"[extract] sample {index} failed: {err}")
        bar.update(1)


def record_chunks(reader, rec):
    """The reader's RecordChunks of `rec` when it is a long record held as views of the ring (each chunk's ring
    pages unmapped once the next is asked for); None for any other record (read whole)."""
    from sglang_hs.reader import is_long

    return reader.chunks(rec, reader.part_bytes) if getattr(rec, "views", False) and is_long(reader, rec) else None


def sink_chunks(reader, sink: Sink, rec, logprobs=None):
    """The Chunks of `rec` for sink.write (and --verify's read-back) when it is a long record, read with the
    reader's chunks(); None for any other record (written whole). `logprobs` (a verify.LogprobCheck): fed each
    chunk's final states as it goes by (a streamed record is read once)."""
    chunks = record_chunks(reader, rec)
    return None if chunks is None else _sink_chunks(chunks, sink, logprobs)


def _sink_chunks(chunks, sink: Sink, logprobs):
    from sglang_hs.extract.sinks.base import Chunk

    for c in chunks:
        if logprobs is not None:
            logprobs.feed(c.start, c.last_hidden_state)
        yield Chunk(c.start, c.stop, c.aux_hidden_states, sink.final_of(c))


def _uninterrupted(step) -> bool:
    """Run `step` to its end, again after each KeyboardInterrupt (SIGTERM is one here); True if one came."""
    interrupted = False
    while True:
        try:
            step()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True
