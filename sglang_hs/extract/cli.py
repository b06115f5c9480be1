"""python -m sglang_hs.extract --data FILE --output DIR [--server URL --hs-dump-dir DIR | <launcher flags>]
   python -m sglang_hs.extract --from-dump DIR --output DIR

A training dataset in, drafter-ready hidden-state files out. Without --server it starts
`python -m sglang_hs.launch_server` itself with the launcher flags given (default: the embedded tiny
model, on the CPU engine when there is no GPU), waits for it and stops it at the end, also on Ctrl-C.
Each sample is one request (`rid` = run id + sample index, never reused) sent with up to --concurrency
in flight; its record comes back through the reader (sglang_hs.HiddenStateReader) and is written to one
file per sample (sglang_hs/extract/sinks.py). `--resume` skips samples whose file exists (files are
renamed into place only when complete). A manifest.json beside the files says what they hold. With
--format safetensors a completed run then writes speculators' dataset over all the sample files in the folder
(`--finalize` does only that, e.g. for --shard outputs copied into one folder). `--save-dtype fp8` stores
--format safetensors rows in speculators' FP8 scheme (sglang_hs/extract/fp8.py), about half the disk.
`--from-dump DIR` sends nothing: it turns the records a harvesting server captures from its own traffic
into training files, loss mask on the generated tokens, until stopped (sglang_hs/extract/harvest.py).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

from sglang_hs.server.capture_spec import final_states
from sglang_hs.extract.errors import PROG, ExtractError
from sglang_hs.extract.output import (Stats, check_final_state, check_streams, model_vocab_size, prepare_output,
                                      print_summary, print_training_command, write_manifest)
from sglang_hs.extract.samples import STATUS_CHECK_S, make_preparer, record_loss_mask, record_overdue, request_body

WRITERS = 4  # threads writing and fsyncing files: fsync waits on the disk, not the CPU, so it overlaps serving


class RecordGivenBack(ExtractError):
    """A zero-copy record's ring bytes went back to the server before its file was written: someone else
    wrote the reader's read offset (HiddenStateReader.intact); what was read of them may be torn."""

    def __init__(self, dump_dir: str) -> None:
        super().__init__(f"its record's bytes in the output ring were given back to the server while they were "
                         f"being read (someone else wrote the read offset of {dump_dir}: a member of the share "
                         "group?), so they may be torn: not written, --resume redoes it")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1],
                                epilog="Any other flag goes to python -m sglang_hs.launch_server (without --server).")
    p.add_argument("--data", metavar="FILE",
                   help="JSON Lines (conversations/messages, or input_ids [+ loss_mask]), or a Hugging Face dataset")
    p.add_argument("--output", required=True, metavar="DIR", help="folder of the training files and manifest.json")
    p.add_argument("--output-group", default=None, metavar="GROUP",
                   help="let GROUP read the output files (folders 0750, files 0640 of GROUP, e.g. a trainer running "
                        "as another user); default: 0700/0600, this user only")
    p.add_argument("--format", choices=["specforge", "safetensors"], default="specforge",
                   help="specforge: rows_*/data_{i}.ckpt; safetensors: speculators' dataset (hs_{i}.safetensors per "
                        "sample, the datasets table and hidden_states/ written when the run completes); both need "
                        "the final state")
    p.add_argument("--save-dtype", default=None, metavar="DTYPE",
                   help="bf16, fp8 or fp8-per-layer (default: bf16 for --format specforge, whose TargetHead "
                        "reads bf16 only, whatever the server's dtype; else the dtype the server captured in, bf16 "
                        "for these models). fp8: --format safetensors only, speculators' FP8 scheme (e4m3, one float32 "
                        "scale per token over all layers; train with --hidden-states-backend fp8), about half "
                        "the disk of bf16; fp8-per-layer: a scale per token and layer (read by hs-connectors "
                        "0.9.0's FP8Transfer through broadcasting, not its documented scheme)")
    p.add_argument("--finalize", action="store_true",
                   help="--format safetensors: only (re)write speculators' dataset for the hs_*.safetensors files in "
                        "--output, e.g. after copying the outputs of several --shard runs into one folder")
    p.add_argument("--from-dump", default=None, metavar="DIR",
                   help="no --data: turn the records a running server captures from its live traffic (its "
                        "--hs-dump-dir, --hs-capture opt-in / --hs-capture-sample) into training files, loss mask "
                        "on the generated tokens, until SIGINT/SIGTERM, --max-samples or --idle-timeout; a "
                        "restarted run continues where the last stopped")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="--from-dump: stop (and finalize) after this long without a record, once the server has no "
                        "captured request in flight (its status files; default: never)")
    p.add_argument("--server", default=None, metavar="URL", help="a running sglang-hs server (with --hs-dump-dir)")
    p.add_argument("--hs-dump-dir", default=None, metavar="DIR",
                   help="the server's dump dir (required with --server; default without: a fresh one in /dev/shm)")
    p.add_argument("--hs-owner", default=None, metavar="USER",
                   help="with --server: the user the server runs as, when it is not you (it shares the dump with "
                        "--hs-share-group, of which you are a member); default: you")
    p.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help="only the first N records (--from-dump: stop after N files written)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="only records whose index is I modulo N (default 0/1; against one node of a multi-node "
                        "server: the records of the DP ranks on this node, index modulo the DP size)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N", help="requests in flight (default 8)")
    p.add_argument("--resume", action="store_true", help="skip samples whose file exists in --output")
    p.add_argument("--verify", type=float, default=0.0, metavar="FRACTION",
                   help="check this fraction of samples against the server's own logprobs (needs the final state)")
    p.add_argument("--regenerate", action="store_true",
                   help="send only the prompt of each conversation and capture the target's own reply")
    p.add_argument("--max-new-tokens", type=int, default=512, help="--regenerate: reply length limit")
    p.add_argument("--temperature", type=float, default=0.0, help="--regenerate: sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="--regenerate: nucleus sampling")
    p.add_argument("--request-timeout", type=float, default=3600.0, metavar="SECONDS")
    p.add_argument("--torch-threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads of this process (default 1: its work is copies and file writes, "
                        "and more threads spin on cores the server needs); raise it for --verify on a large model")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a line per 1000 samples instead)")
    return p


def parse_args(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    ns, launcher_args = build_parser().parse_known_args(argv)
    ns.output_gid = None
    if ns.output_group is not None:
        from sglang_hs.fsutil import resolve_share_group

        try:
            ns.output_gid = resolve_share_group(ns.output_group, "--output-group")
        except ValueError as e:
            raise ExtractError(str(e)) from None
    ns.shard_given = ns.shard not in (None, "0/1")  # 0/1 (all) is the default, also when written out
    ns.shard = ns.shard or "0/1"
    ns.route = None  # (this node's DP ranks, the DP size): set when the dump is one node's of several
    try:
        i, n = (int(x) for x in ns.shard.split("/"))
        assert n >= 1 and 0 <= i < n
    except (ValueError, AssertionError):
        raise ExtractError(f"--shard: {ns.shard!r} is not I/N with 0 <= I < N") from None
    ns.shard_index, ns.shard_count = i, n
    from sglang_hs.extract.fp8 import SAVE_DTYPES

    if ns.save_dtype is not None and ns.save_dtype not in SAVE_DTYPES:
        raise ExtractError(f"--save-dtype: {ns.save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
    if ns.save_dtype in ("fp8", "fp8-per-layer") and ns.format != "safetensors":
        raise ExtractError(f"--save-dtype {ns.save_dtype} needs --format safetensors: SpecForge 0.2.0 reads "
                           f"--format {ns.format} files with no FP8 scales (it would train on the unscaled values)")
    if ns.format == "specforge" and ns.save_dtype is None:
        # SpecForge 0.2.0's TargetHead is bf16 only (a float32 file fails its first step, "float != BFloat16")
        ns.save_dtype = "bf16"
    if ns.idle_timeout is not None and not ns.from_dump:
        raise ExtractError("--idle-timeout is for --from-dump")
    if ns.from_dump and ns.finalize:
        raise ExtractError("--finalize does not go with --from-dump (a --from-dump run finalizes when it stops)")
    if ns.from_dump:
        from sglang_hs.extract.harvest import check_args

        why = check_args(ns, launcher_args)
        if why:
            raise ExtractError(why)
        if ns.torch_threads < 1:
            raise ExtractError(f"--torch-threads: must be >= 1, got {ns.torch_threads}")
        _owner(ns)
        return ns, launcher_args
    if ns.finalize:
        if ns.format != "safetensors":
            raise ExtractError("--finalize is for --format safetensors (SpecForge reads rows_*/ as they are: merge "
                               "--shard outputs by copying their rows_* folders into one)")
        return ns, launcher_args
    if not ns.data:
        raise ExtractError("--data is required")
    if ns.concurrency < 1:
        raise ExtractError(f"--concurrency: must be >= 1, got {ns.concurrency}")
    if ns.torch_threads < 1:
        raise ExtractError(f"--torch-threads: must be >= 1, got {ns.torch_threads}")
    if not 0.0 <= ns.verify <= 1.0:
        raise ExtractError(f"--verify: a fraction in [0, 1], got {ns.verify}")
    if ns.max_samples is not None and ns.max_samples < 0:
        raise ExtractError(f"--max-samples: must be >= 0, got {ns.max_samples}")
    if ns.server and launcher_args:
        raise ExtractError(f"{launcher_args[0]}: launcher flags need no --server (the server is already running)")
    if ns.server and not ns.hs_dump_dir:
        raise ExtractError("--server needs --hs-dump-dir: the dump dir that server captures into")
    if ns.hs_owner is not None and not ns.server:
        raise ExtractError("--hs-owner needs --server or --from-dump: a server this command starts runs as you")
    _owner(ns)
    if not os.path.exists(ns.data) and os.path.sep in ns.data:
        raise ExtractError(f"--data: {ns.data} does not exist")
    return ns, launcher_args


def _owner(ns) -> None:
    """--hs-owner as a uid."""
    if ns.hs_owner is None:
        return
    from sglang_hs.fsutil import owner_uid

    try:
        ns.hs_owner = owner_uid(ns.hs_owner)
    except ValueError:
        raise ExtractError(f"--hs-owner: no such user {ns.hs_owner!r}") from None


def _selected_for_verify(index: int, fraction: float) -> bool:
    return fraction > 0 and ((index * 2654435761) % 2**32) / 2**32 < fraction


def count_records(path: str) -> Optional[int]:
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    return None


class Extraction:
    def __init__(self, ns, url: str, reader, sink, preparer, lm_head, server=None) -> None:
        self.ns, self.url, self.reader, self.sink, self.prep = ns, url, reader, sink, preparer
        self.lm_head, self.server = lm_head, server
        self.stats = Stats()
        self.run_id = uuid.uuid4().hex[:12]
        self._local = threading.local()
        self.pending: Dict[str, tuple] = {}  # rid -> (sample, future, reply-time)
        self._next_status_check = 0.0  # a missing record's server status is read at most every STATUS_CHECK_S
        self.writes: List[tuple] = []  # (sample index, tokens, future of sink.write, record), oldest first
        self.write_pool = cf.ThreadPoolExecutor(WRITERS, thread_name_prefix="sglang-hs-write")
        self.verify_failure: Optional[str] = None  # a stored file that does not hold the captured rows

    # -- requests --
    def _session(self):
        """One keep-alive HTTP session per worker thread (no new connection per sample)."""
        import requests

        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _send(self, sample, verify: bool) -> dict:
        body = request_body(sample, self._rid(sample.index), self.ns)
        rank = routed_dp_rank(self.ns, sample.index)
        if rank is not None:  # its record lands in this node's dump (node_route)
            body["routed_dp_rank"] = rank
        if verify:
            body.update(return_logprob=True, logprob_start_len=0)
        r = self._session().post(f"{self.url}/generate", json=body, timeout=self.ns.request_timeout)
        if r.status_code != 200:
            raise ExtractError(f"HTTP {r.status_code}: {r.text[:300]}")
        reply = r.json()
        reason = (reply.get("meta_info", {}).get("finish_reason") or {})
        if reason.get("type") == "abort":
            raise ExtractError(f"the server aborted the request: {reason.get('message', '')}")
        return reply

    def _rid(self, index: int) -> str:
        return f"hsx-{self.run_id}-{index}"

    def _server_dead(self) -> Optional[str]:
        import requests

        if self.server is not None and not self.server.alive():
            return f"the server exited with {self.server.proc.returncode} (log {self.server.log_path})"
        try:
            requests.get(f"{self.url}/health", timeout=10)
            return None
        except requests.RequestException as e:
            return f"the server at {self.url} does not answer ({type(e).__name__})"

    # -- records --
    def _complete(self, sample, reply: dict, rec, verify: bool) -> None:
        from sglang_hs.extract.verify import VerificationError, check

        output = reply.get("output_ids", [])
        mask = record_loss_mask(sample, output, rec)
        if verify:  # every row: the last one predicted the last generated token, output[-1]
            meta = reply["meta_info"]
            entries = list(meta["input_token_logprobs"]) + list(meta.get("output_token_logprobs", []))
            temperature = self.ns.temperature if sample.prompt_len is not None else 0.0
            try:
                diff = check(sample.index, sample.input_ids + output, rec.last_hidden_state, self.lm_head,
                             [x[0] for x in entries], [x[1] for x in entries], temperature=temperature,
                             sampled_from=len(sample.input_ids))
            except VerificationError:
                if not self.reader.intact(rec):  # rows changed under the check: torn, not the server's error
                    raise RecordGivenBack(self.reader.dump_dir) from None
                raise
            self.stats.verified += 1
            self.stats.verify_max_diff = max(self.stats.verify_max_diff, diff)
        unwritten = [w[2] for w in self.writes if not w[2].done()]
        if len(unwritten) >= 2 * WRITERS:  # bound the records held in memory while the disk catches up
            cf.wait(unwritten, return_when=cf.FIRST_COMPLETED)
        self.writes.append((sample.index, rec.num_tokens, self.write_pool.submit(
            self._write, sample.index, rec.input_ids, mask, rec.aux_hidden_states, self.sink.final_of(rec), verify,
            rec), rec))

    def _write(self, index, input_ids, mask, aux, last, verify: bool, rec=None) -> int:
        """Write one sample; a verified sample's file is read back and must hold the captured rows (exactly,
        or within FP8's rounding bound), else it is removed and VerificationError raised. `rec`: the reader's
        record the tensors are views of; its file takes its name only if the ring bytes were still the
        record's once written (HiddenStateReader.intact), else RecordGivenBack and no file."""
        def still_the_records() -> None:
            if rec is not None and not self.reader.intact(rec):
                raise RecordGivenBack(self.reader.dump_dir)

        try:
            size = self.sink.write(index, input_ids, mask, aux, last, before_commit=still_the_records)
        except RecordGivenBack:
            raise
        except Exception:  # e.g. FP8's non-finite rows: of torn bytes, say that instead (the sample is redone)
            still_the_records()
            raise
        if verify and self.sink.name == "safetensors":
            from sglang_hs.extract.verify import VerificationError, check_stored

            try:
                check_stored(index, self.sink.path(index), aux, last, self.sink.save_dtype)
            except VerificationError:
                os.unlink(self.sink.path(index))
                still_the_records()  # the rows changed under the read-back: torn, not the server's error
                raise
        return size

    def _collect_writes(self, bar) -> int:
        """Count the files written so far; a write that failed (disk full) raises OSError naming the
        file. Returns how many completed."""
        from sglang_hs.extract.fp8 import NonFiniteRows

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
            elif isinstance(err, NonFiniteRows):  # no FP8 scale stores them: skipped, as the harvester does
                line = self.stats.skip("non_finite_rows", f"its hidden states hold inf or NaN, which --save-dtype "
                                       f"{self.sink.save_dtype} cannot store", f"sample {index}", sample=index)
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

    def run(self, samples, total: Optional[int]) -> None:
        from tqdm import tqdm

        from sglang_hs.extract.dataset import SkipSample

        ns = self.ns
        bar = tqdm(total=total, unit="sample", disable=ns.no_progress, dynamic_ncols=True, smoothing=0.1)
        pool = cf.ThreadPoolExecutor(ns.concurrency, thread_name_prefix="sglang-hs-extract")
        fatal = None
        self.stats.t0, self.stats.cpu0 = time.monotonic(), time.process_time()
        try:
            it = iter(samples)
            exhausted = False
            while not exhausted or self.pending:
                while not exhausted and fatal is None and len(self.pending) < ns.concurrency:
                    try:
                        index, record = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    if self.sink.done(index):
                        self.stats.resumed += 1
                        bar.update(1)
                        continue
                    try:
                        sample = self.prep(index, record)
                    except SkipSample as e:
                        self._skip(index, e, bar)
                        continue
                    verify = _selected_for_verify(index, ns.verify)
                    self.pending[self._rid(index)] = (sample, pool.submit(self._send, sample, verify), verify, None)
                if not self.pending:
                    continue
                self.reader.poll()
                progressed = False
                for rid, (sample, fut, verify, t_reply) in list(self.pending.items()):
                    if not fut.done():
                        continue
                    err = fut.exception()
                    if err is not None:
                        del self.pending[rid]
                        self._drop(rid)
                        self._fail(sample.index, err, bar)
                        dead = self._server_dead()
                        if dead:
                            fatal = f"{dead}; stopped at sample {sample.index}"
                        progressed = True
                        continue
                    rec = self.reader.pop_ready(rid)
                    if rec is None and self.reader.not_captured(rid):  # --hs-when-behind skip left it out
                        del self.pending[rid]
                        self._fail(sample.index, f"served without capture ({self.reader.not_captured(rid)}): the "
                                   "server runs with --hs-when-behind skip; extract with hold (the default)", bar)
                        continue
                    if rec is None:
                        if t_reply is None:
                            self.pending[rid] = (sample, fut, verify, time.monotonic())
                        elif time.monotonic() >= self._next_status_check:
                            self._next_status_check = time.monotonic() + STATUS_CHECK_S
                            why = record_overdue(self.reader.dump_dir, t_reply)
                            if why is not None:  # one more read after that status: it is there, or never comes
                                self.reader.poll()
                                if rid not in self.reader.ready_rids() and not self.reader.not_captured(rid):
                                    del self.pending[rid]
                                    self._fail(sample.index, why, bar)
                                progressed = True
                        continue
                    del self.pending[rid]
                    try:
                        self._complete(sample, fut.result(), rec, verify)
                    except Exception as e:  # noqa: BLE001 - reported per sample, the run goes on
                        self.reader.ack(rec)
                        if type(e).__name__ == "VerificationError":
                            fatal = str(e)
                        self._fail(sample.index, e, bar)
                    progressed = True
                try:
                    progressed = self._collect_writes(bar) > 0 or progressed
                except OSError as e:
                    fatal = str(e)
                fatal = fatal or self.verify_failure
                ours = f"hsx-{self.run_id}-"
                for rid in self.reader.ready_rids():
                    if rid not in self.pending:  # another client's, or ours after its sample failed
                        self._drop(rid)
                        self.stats.foreign += not rid.startswith(ours)
                if fatal is not None and not any(f.done() is False for _, f, _, _ in self.pending.values()):
                    break
                if progressed:
                    self._postfix(bar)
                else:
                    self._idle()
            cf.wait([w[2] for w in self.writes])  # the last files
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            # a started file is finished (or removed) and every record acked before the reader may go: the
            # writer threads read the records' views of the ring. A second Ctrl-C / SIGTERM meanwhile is
            # taken after, not in the middle (it would leave threads reading bytes another reader frees).
            interrupted = _uninterrupted(lambda: self.write_pool.shutdown(wait=True, cancel_futures=True))
            try:
                interrupted |= _uninterrupted(lambda: self._collect_writes(bar))
            except OSError as e:
                fatal = fatal or str(e)
            fatal = fatal or self.verify_failure
            self.stats.t1, self.stats.cpu1 = time.monotonic(), time.process_time()
            bar.close()
            if interrupted:
                raise KeyboardInterrupt
        if fatal:
            raise ExtractError(fatal)

    def _drop(self, rid: str) -> None:
        """Forget every record (and marker) of `rid` that came, giving their ring bytes back."""
        self.reader.discard(rid)

    def _idle(self) -> None:
        """Nothing progressed: sleep until a reply arrives, or briefly while a replied sample's record is
        on its way (records are published before the reply leaves the server, so that wait is short)."""
        in_flight = [f for _, f, _, _ in self.pending.values() if not f.done()]
        if len(in_flight) < len(self.pending) or not in_flight:
            time.sleep(0.001)
        else:
            cf.wait(in_flight, timeout=0.05, return_when=cf.FIRST_COMPLETED)

    def abort_pending(self) -> None:
        import requests

        for rid in list(self.pending):
            try:
                requests.post(f"{self.url}/abort_request", json={"rid": rid}, timeout=5)
            except requests.RequestException:
                pass

    def _skip(self, index: int, e, bar) -> None:
        from sglang_hs.extract.dataset import record_place

        where = {"sample": index, **({"line": index + 1} if os.path.isfile(self.ns.data) else {})}
        line = self.stats.skip(e.reason, e.detail, f"sample {index} ({record_place(self.ns.data, index)})", **where)
        if line:
            bar.write(line, file=sys.stderr)
        bar.update(1)

    def _fail(self, index: int, err, bar) -> None:
        self.stats.failed.append((index, str(err)))
        bar.write(f"[extract] sample {index} failed: {err}")
        bar.update(1)

    def _postfix(self, bar) -> None:
        wall = max(1e-6, time.monotonic() - self.stats.t0)
        bar.set_postfix_str(f"{self.stats.tokens / wall:,.0f} tok/s, {self.stats.bytes / wall / 1e6:,.1f} MB/s, "
                            f"lag {self.reader.unread_bytes() / 1e6:,.1f} MB, skipped {sum(self.stats.skipped.values())}"
                            f", failed {len(self.stats.failed)}", refresh=False)


def _samples(ns):
    from sglang_hs.extract.dataset import read_records

    for index, record in read_records(ns.data):
        if ns.max_samples is not None and index >= ns.max_samples:
            break
        if selected(ns, index):
            yield index, record


def node_route(ns, reader) -> None:
    """Against one node of a multi-node server (SGLang --nnodes: each node's dump holds the records of the
    DP attention groups on that node), every request is routed (routed_dp_rank) to a DP rank this reader
    covers, and, unless --shard was given, the node takes the samples whose index modulo the DP size is
    one of its ranks: one run per node, the same command everywhere, the shards merge by sample index."""
    from sglang_hs.reader import coverage, node_share

    m = reader.manifest
    share = node_share(m)
    if share is None:
        return  # this dump covers every DP rank: SGLang's own balancing
    ns.route = share
    ranks, dp_size = share
    if not ns.shard_given:
        ns.shard = f"DP ranks {ranks} of {dp_size} (node {m.get('node_rank')} of {m.get('nnodes')})"
    print(f"{PROG}: {coverage(m)} captured on this node: requests go to those ranks (routed_dp_rank)"
          + ("" if ns.shard_given else ", and this run takes the samples whose index modulo "
             f"{dp_size} is one of them"), file=sys.stderr)


def selected(ns, index: int) -> bool:
    if index % ns.shard_count != ns.shard_index:
        return False
    return ns.route is None or ns.shard_given or index % ns.route[1] in ns.route[0]


def routed_dp_rank(ns, index: int) -> Optional[int]:
    """The DP rank sample `index` is sent to (None: SGLang chooses): with the node split its own rank,
    with --shard one of this node's ranks in turn."""
    if getattr(ns, "route", None) is None:
        return None
    ranks, dp_size = ns.route
    return index % dp_size if index % dp_size in ranks else ranks[(index // ns.shard_count) % len(ranks)]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns, launcher_args = parse_args(argv)
    except ExtractError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from sglang_hs.extract.sinks import SINKS, SinkError

    out_dir = os.path.abspath(ns.output)
    sink = SINKS[ns.format](out_dir, ns.save_dtype)
    sink.share_gid = ns.output_gid
    if ns.finalize:
        try:
            prepare_output(out_dir, ns.output_gid)
        except ExtractError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        return _finalize_only(sink)
    if ns.from_dump:
        from sglang_hs.extract.harvest import run

        return run(ns, sink, out_dir)
    try:
        prepare_output(out_dir, ns.output_gid)
        have = sink.existing()
        if have and not ns.resume:
            raise ExtractError(f"--output {out_dir} already holds {have} {ns.format} sample files; pass --resume "
                               "to continue that run, or choose another folder")
        if have:
            _check_resume_dtype(out_dir, ns.save_dtype)
        removed = sink.remove_partial()
        if removed:
            print(f"[extract] removed {removed} partial file(s) an interrupted run left", file=sys.stderr)
    except (OSError, ExtractError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    def _on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)
    import torch

    from sglang_hs.reader import ServerRestarted
    from sglang_hs.server.store.ring import TornRecord

    threads = torch.get_num_threads()
    torch.set_num_threads(ns.torch_threads)  # restored below: main() also runs inside other programs
    server = extraction = manifest = dataset = reader = None
    status, rc = "failed", 1
    try:
        if ns.server:
            url, dump_dir = ns.server.rstrip("/"), ns.hs_dump_dir
        else:
            server = _start_server(ns, launcher_args)  # assigned before the wait: Ctrl-C then stops it too
            url, dump_dir = server.url, server.dump_dir
            _wait_ready(server)
        from sglang_hs.reader import HiddenStateReader, NoWriterHere

        try:
            # zero-copy: a record goes from the ring straight into its file, acked once the file is in place
            reader = HiddenStateReader(dump_dir, wait=30, recycle_memory=True, owner=ns.hs_owner, ack=True,
                                       zero_copy=True)
        except (RuntimeError, NoWriterHere) as e:  # another reader holds the dump dir; a node without writers
            raise ExtractError(f"--hs-dump-dir: {e}") from None
        node_route(ns, reader)
        manifest = dict(reader.manifest, vocab_size=model_vocab_size(reader.manifest["model_path"]))
        check_final_state(ns.format, sink, manifest, f"the server at {url}")
        check_streams(ns.format, manifest, f"the server at {url}")
        sink.layer_ids = list(manifest["layer_ids"])
        sink.rows_per_layer = int(manifest.get("rows_per_layer", 1))
        if ns.verify and "post-norm" not in final_states(manifest):
            raise ExtractError("--verify needs the post-norm final state (it checks lm_head of it against the "
                               "server's logprobs): run the server with --hs-last both (or --hs-last for --format "
                               "specforge)")
        preparer, lm_head = _model_side(ns, manifest, url)
        extraction = Extraction(ns, url, reader, sink, preparer, lm_head, server)
        total = count_records(ns.data)
        if total is not None:
            total = min(total, ns.max_samples if ns.max_samples is not None else total)
            total = sum(selected(ns, i) for i in range(total))
        extraction.run(_samples(ns), total)
        status, rc = ("complete", 0) if not extraction.stats.failed else ("complete with failures", 1)
        if manifest["last"]:
            try:
                dataset = sink.finalize()
            except SinkError as e:
                status, rc = "complete without the training set", 1
                print(f"{PROG}: error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        status, rc = "interrupted", 130
        print(f"\n{PROG}: interrupted; completed files are kept, rerun with --resume", file=sys.stderr)
        if extraction is not None:
            extraction.abort_pending()
    except ServerRestarted as e:  # the records of the samples in flight went with the old server's ring
        status = "stopped: the server was restarted"
        print(f"{PROG}: error: {e}; the files written so far are kept: rerun with --resume to continue",
              file=sys.stderr)
    except (ExtractError, OSError, ValueError, TornRecord) as e:  # TornRecord: a corrupted ring, one line
        print(f"{PROG}: error: {e}", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if reader is not None:  # the dump dir is free for the next reader even if something still holds ours
            reader.close()
        if server is not None:
            server.stop()
            if not ns.hs_dump_dir:  # the dump dir we made: its ring and manifest outlive the server
                shutil.rmtree(os.path.dirname(server.dump_dir), ignore_errors=True)
    if extraction is not None:
        print_summary(extraction.stats, out_dir)
        write_manifest(out_dir, manifest, ns, extraction.stats, sink, status, dataset)
        if rc == 0:
            print_training_command(out_dir, manifest, sink.name, ns.save_dtype, ns.output_gid)
    return rc


def _uninterrupted(step) -> bool:
    """Run `step` to its end, again after each KeyboardInterrupt (SIGTERM is one here); True if one came."""
    interrupted = False
    while True:
        try:
            step()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True


def _check_resume_dtype(out_dir: str, save_dtype: Optional[str]) -> None:
    """--resume continues a run with the --save-dtype it had (manifest.json says which)."""
    try:
        with open(os.path.join(out_dir, "manifest.json")) as f:
            before = json.load(f).get("save_dtype")
    except (OSError, ValueError):
        return  # no manifest (a run killed before writing one): finalize still refuses mixed files
    if before is None and save_dtype == "bf16" and json_stored_bf16(out_dir):
        return  # a specforge run from before bf16 was its default, of a bf16 server: the same files
    if before != save_dtype:
        said = lambda d: f"--save-dtype {d}" if d else "no --save-dtype"  # noqa: E731
        raise ExtractError(f"--save-dtype: --output {out_dir} holds files of a run with {said(before)}; resume it "
                           f"with the same (this run has {said(save_dtype)})")


def json_stored_bf16(out_dir: str) -> bool:
    try:
        with open(os.path.join(out_dir, "manifest.json")) as f:
            return json.load(f).get("stored_dtype") == "bfloat16"
    except (OSError, ValueError):
        return False


def _finalize_only(sink) -> int:
    from sglang_hs.extract.sinks import SinkError

    try:
        n = len(sink.samples())
        rows = sink.finalize()["rows"]
    except (SinkError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"[extract] speculators dataset of {rows} rows (of {n} sample files) in {sink.out_dir}", file=sys.stderr)
    return 0


def _start_server(ns, launcher_args):
    """Start `python -m sglang_hs.launch_server` with the user's launcher flags (not yet waited for)."""
    from sglang_hs.tools.server_process import ServerProcess

    dump_dir = ns.hs_dump_dir or os.path.join(
        tempfile.mkdtemp(prefix="sglang-hs-extract-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None), "hs")
    args = ["--hs-dump-dir", dump_dir, *launcher_args]
    if not any(a == "--hs-last" or a.startswith("--hs-last=") for a in launcher_args):
        args += ["--hs-last", server_last(ns)]  # both formats train on the final state
    server = ServerProcess(args)
    server.dump_dir = dump_dir
    print(f"[extract] starting the server: {' '.join(server.cmd)} (log {server.log_path})", file=sys.stderr,
          flush=True)
    return server


def server_last(ns) -> str:
    """The --hs-last a server started for `ns` runs with: the final state its --format trains on (SpecForge:
    post-norm; speculators: pre-norm), both when --verify also needs the post-norm one."""
    from sglang_hs.extract.sinks import SINKS

    want = SINKS[ns.format].final_state
    return "both" if ns.verify and want != "post-norm" else want


def _wait_ready(server) -> None:
    from sglang_hs.tools.server_process import ServerStartError

    try:
        server.wait_ready()
    except ServerStartError as e:
        raise ExtractError(str(e)) from None


def _model_side(ns, manifest, url: Optional[str] = None):
    """The sample preparer (tokenizer, the server's limits) and, for --verify, the lm_head weight."""
    model_path = manifest["model_path"]
    preparer = make_preparer(manifest, regenerate=ns.regenerate, max_new_tokens=ns.max_new_tokens, url=url)
    lm_head = None
    if ns.verify:
        from sglang_hs.extract.verify import load_lm_head

        lm_head = load_lm_head(model_path)
    return preparer, lm_head
