"""A running server as a source: each sample of --data sent to it as one request (`rid` = run id + sample
index, never reused) with up to --concurrency in flight, its record taken from the transport by rid as it
arrives (records are published before the reply leaves the server; one still missing is waited for only while
the server's status says it may come), checked (the tokens forwarded; --verify: the server's own logprobs),
and handed to the sink stage (writer.py). A request that fails fails its sample, and the run goes on, unless
the server is gone; records of other clients' requests are given back.
"""
from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time
import uuid
from typing import Dict, Optional

from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.samples import STATUS_CHECK_S, record_loss_mask, record_overdue, request_body
from sglang_hs.extract.sinks.base import ResumeState, Sink
from sglang_hs.extract.sources.dataset_file import DatasetSource
from sglang_hs.extract.transport.base import Transport
from sglang_hs.extract.writer import RecordGivenBack, SampleWriter, record_chunks


def _selected_for_verify(index: int, fraction: float) -> bool:
    return fraction > 0 and ((index * 2654435761) % 2**32) / 2**32 < fraction


class Extraction(SampleWriter):
    """The samples of a source sent to the server at `url` with up to `requests.concurrency` in flight
    (`requests`: config.RequestSettings), each record taken from the transport `reader` by its rid and handed
    to the sink stage (SampleWriter). `preparer`: record -> Sample for the server's model; `lm_head`: for
    --verify; `server`: the process this command started (None: --server's)."""

    def __init__(self, requests, url: str, reader: Transport, sink: Sink, preparer, lm_head, server=None,
                 progress: bool = True) -> None:
        super().__init__(reader, sink)
        self.requests, self.url, self.prep = requests, url, preparer
        self.lm_head, self.server, self.progress = lm_head, server, progress
        self.run_id = uuid.uuid4().hex[:12]
        self._local = threading.local()
        self.pending: Dict[str, tuple] = {}  # rid -> (sample, future, verify, reply-time)
        self._next_status_check = 0.0  # a missing record's server status is read at most every STATUS_CHECK_S

    # -- requests --
    def _session(self):
        """One keep-alive HTTP session per worker thread (no new connection per sample)."""
        import requests

        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _send(self, sample, verify: bool, rank: Optional[int] = None) -> dict:
        body = request_body(sample, self._rid(sample.index), self.requests)
        if rank is not None:  # its record lands in this node's dump (Selection.split_by_node)
            body["routed_dp_rank"] = rank
        if verify:
            body.update(return_logprob=True, logprob_start_len=0)
        r = self._session().post(f"{self.url}/generate", json=body, timeout=self.requests.request_timeout)
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
        from sglang_hs.extract.verify import LogprobCheck, VerificationError, check

        output = reply.get("output_ids", [])
        mask = record_loss_mask(sample, output, rec)
        deferred = None
        if verify:  # every row: the last one predicted the last generated token, output[-1]
            meta = reply["meta_info"]
            entries = list(meta["input_token_logprobs"]) + list(meta.get("output_token_logprobs", []))
            temperature = self.requests.temperature if sample.prompt_len is not None else 0.0
            args = (sample.index, sample.input_ids + output)
            more = dict(server_logprobs=[x[0] for x in entries], server_token_ids=[x[1] for x in entries],
                        temperature=temperature, sampled_from=len(sample.input_ids),
                        part_bytes=getattr(self.reader, "part_bytes", None))
            if getattr(rec, "streamed", False):  # its rows come once: checked as the sink writes them (SampleWriter)
                deferred = LogprobCheck(*args, rec.num_tokens, self.lm_head, **more)
            else:
                try:
                    diff = check(*args, rec.last_hidden_state, self.lm_head, chunks=record_chunks(self.reader, rec),
                                 **more)
                except VerificationError:
                    if not self.reader.intact(rec):  # rows changed under the check: torn, not the server's error
                        raise RecordGivenBack(self.reader.dump_dir) from None
                    raise
                self.stats.verified += 1
                self.stats.verify_max_diff = max(self.stats.verify_max_diff, diff)
        self.submit(sample.index, mask, rec, verify, deferred)

    def run(self, source: DatasetSource, resumed: ResumeState) -> None:
        """Every sample of `source` whose file `resumed` does not have yet; ExtractError when the run had to stop (the server died, a disk full, a failed --verify)."""
        from tqdm import tqdm

        from sglang_hs.extract.dataset import SkipSample

        concurrency = self.requests.concurrency
        bar = tqdm(total=source.total(), unit="sample", disable=not self.progress, dynamic_ncols=True, smoothing=0.1)
        pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="sglang-hs-extract")
        fatal = None
        self.stats.t0, self.stats.cpu0 = time.monotonic(), time.process_time()
        try:
            it = iter(source)
            exhausted = False
            while not exhausted or self.pending:
                while not exhausted and fatal is None and len(self.pending) < concurrency:
                    try:
                        index, record = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    if resumed.done(index):
                        self.stats.resumed += 1
                        bar.update(1)
                        continue
                    try:
                        sample = self.prep(index, record)
                    except SkipSample as e:
                        self._skip(source.place(index), e, bar)
                        continue
                    verify = _selected_for_verify(index, self.requests.verify)
                    self.pending[self._rid(index)] = (sample, pool.submit(self._send, sample, verify,
                                                                          source.selection.routed_rank(index)),
                                                      verify, None)
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
            interrupted, failed = self.drain(bar)  # before the transport may go (writer.py)
            fatal = fatal or failed or self.verify_failure
            self.stats.end()
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

    def _skip(self, place, e, bar) -> None:
        """A record the preparer skipped (`place`: the source's words for where it is, and its manifest entry)."""
        words, where = place
        line = self.stats.skip(e.reason, e.detail, words, **where)
        if line:
            bar.write(line, file=sys.stderr)
        bar.update(1)

    def _postfix(self, bar) -> None:
        wall = max(1e-6, time.monotonic() - self.stats.t0)
        bar.set_postfix_str(f"{self.stats.tokens / wall:,.0f} tok/s, {self.stats.bytes / wall / 1e6:,.1f} MB/s, "
                            f"lag {self.reader.unread_bytes() / 1e6:,.1f} MB, skipped {sum(self.stats.skipped.values())}"
                            f", failed {len(self.stats.failed)}", refresh=False)
