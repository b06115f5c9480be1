"""Hidden states straight from a running server into training, no disk: a torch IterableDataset.

    from torch.utils.data import DataLoader
    from sglang_hs.live import LiveHiddenStates

    ds = LiveHiddenStates("train.jsonl", server="http://127.0.0.1:30000", dump_dir="/dev/shm/hs")
    for sample in DataLoader(ds, batch_size=None):  # input_ids, loss_mask, hidden_state, aux_hidden_state
        ...

Each iteration reads the records of `data` (a JSON Lines path or Hugging Face dataset, as
`python -m sglang_hs.extract --data` takes, or any iterable of such records: conversations, or
`input_ids` [+ `loss_mask`]), prepares them with the extraction CLI's own code (tokenizer, chat template,
loss masks: sglang_hs/extract/dataset.py), sends each as one request with at most `concurrency` in
flight, and yields one dict per sample in SpecForge's offline sample layout, built by the very function
the CLI's `--format specforge` sink writes its files with (sinks.specforge_sample): `input_ids` [T] and
`loss_mask` [T] int64, `hidden_state` [1, T, H] (final state) and `aux_hidden_state` [1, T, K*H], in the
server's dtype. Samples come in dataset order (a sample waits for the ones before it), so a run over
the same data and server is reproducible. Records the extraction would skip (malformed, too long) are
skipped and counted in `self.skipped` (of the process iterating); a request that fails raises
LiveDatasetError.

The server must run with --hs-last (SpecForge trains on the final state) and nobody else may read its
dump dir while this iterates: the dataset holds the one HiddenStateReader of the dump dir from the start
of an iteration to its end (records are drained as they arrive, not acknowledged: a sample is in memory
only until it is yielded). An iteration that ends, is closed early (`break`, garbage collection) or
raises aborts its requests still in flight, closes the reader and its HTTP threads; a consumer killed
outright leaves the server serving: its flock on the dump dir dies with it, and a later reader drains
whatever records its last requests left in the ring.

DataLoader workers: num_workers 0 or 1. Several workers would each need the dump dir's one reader, so
num_workers > 1 is refused with a one-line error (LiveDatasetError) rather than sharded; the server is
the part that works, and `concurrency` keeps it busy from one process. Use one dataset per server
(each with its own dump dir) to feed from several.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import time
import uuid
from typing import Iterable, Iterator, Optional, Union

import torch


class LiveDatasetError(RuntimeError):
    """A one-line error: the server, its dump dir or a request did not do what the dataset needs."""


class LiveHiddenStates(torch.utils.data.IterableDataset):
    def __init__(self, data: Union[str, os.PathLike, Iterable], server: str, dump_dir: str, concurrency: int = 8,
                 max_samples: Optional[int] = None, request_timeout: float = 3600.0, reader_wait: float = 30.0,
                 owner=None) -> None:
        """`data`: a path (JSON Lines, HF dataset) or an iterable of records, iterated anew each epoch.
        `server`: the URL of an sglang-hs server capturing into `dump_dir` with --hs-last. `owner`: the
        server's user when it is not you (see HiddenStateReader)."""
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        self.data = os.fspath(data) if isinstance(data, (str, os.PathLike)) else data
        self.url = server.rstrip("/")
        self.dump_dir = str(dump_dir)
        self.concurrency, self.max_samples = concurrency, max_samples
        self.request_timeout, self.reader_wait, self.owner = request_timeout, reader_wait, owner
        self.skipped: "collections.Counter[str]" = collections.Counter()
        self._preparer = None

    def _records(self) -> Iterator:
        if isinstance(self.data, str):
            from sglang_hs.extract.dataset import read_records

            records = read_records(self.data)
        else:
            records = enumerate(self.data)
        for index, record in records:
            if self.max_samples is not None and index >= self.max_samples:
                return
            yield index, record

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise LiveDatasetError(f"LiveHiddenStates: DataLoader num_workers={info.num_workers}; use 0 or 1 (the "
                                   "dump dir has one reader; raise concurrency to keep the server busy instead)")
        return self._iterate()

    def _iterate(self) -> Iterator[dict]:
        import requests

        from sglang_hs.extract.cli import RECORD_GRACE_S, ExtractError, make_preparer, record_loss_mask, request_body
        from sglang_hs.extract.dataset import SkipSample
        from sglang_hs.extract.sinks import specforge_sample
        from sglang_hs.reader import HiddenStateReader

        try:
            reader = HiddenStateReader(self.dump_dir, wait=self.reader_wait, owner=self.owner)
        except (RuntimeError, FileNotFoundError) as e:
            raise LiveDatasetError(f"LiveHiddenStates: {e}") from None
        session = requests.Session()
        pool = cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="sglang-hs-live")
        pending: "collections.OrderedDict[str, list]" = collections.OrderedDict()  # rid -> [sample, future, t_reply]
        try:
            if not reader.manifest["last"]:
                raise LiveDatasetError(f"LiveHiddenStates: the server at {self.url} runs without --hs-last; "
                                       "SpecForge's layout needs the final hidden state")
            if self._preparer is None:
                self._preparer = make_preparer(reader.manifest)
            ours = f"hsl-{uuid.uuid4().hex[:12]}-"
            timeout = self.request_timeout

            def send(body):
                r = session.post(f"{self.url}/generate", json=body, timeout=timeout)
                if r.status_code != 200:
                    raise LiveDatasetError(f"HTTP {r.status_code}: {r.text[:300]}")
                reply = r.json()
                reason = reply.get("meta_info", {}).get("finish_reason") or {}
                if reason.get("type") == "abort":
                    raise LiveDatasetError(f"the server aborted the request: {reason.get('message', '')}")
                return reply

            records, exhausted = self._records(), False
            while not exhausted or pending:
                while not exhausted and len(pending) < self.concurrency:
                    try:
                        index, record = next(records)
                    except StopIteration:
                        exhausted = True
                        break
                    try:
                        sample = self._preparer(index, record)
                    except SkipSample as e:
                        self.skipped[e.reason] += 1
                        continue
                    rid = ours + str(index)
                    pending[rid] = [sample, pool.submit(send, request_body(sample, rid)), None]
                if not pending:
                    continue
                rid, (sample, fut, t_reply) = next(iter(pending.items()))  # dataset order: the oldest first
                try:
                    reply = fut.result()
                except LiveDatasetError as e:
                    raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: {e}") from None
                except requests.RequestException as e:
                    raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: the server at {self.url} "
                                           f"did not answer ({type(e).__name__}: {e})") from None
                rec = reader.pop_ready(rid)
                if rec is None:
                    reader.poll()
                    for other in reader.ready_rids():  # records of others' requests: not ours to keep
                        if not other.startswith(ours):
                            reader.pop_ready(other)
                    rec = reader.pop_ready(rid)
                if rec is None and reader.not_captured(rid):
                    raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: served without capture "
                                           f"({reader.not_captured(rid)}): the server runs with --hs-when-behind "
                                           "skip; serve training with hold (the default)")
                if rec is None:  # published before the reply left the server: on its way, briefly
                    if t_reply is None:
                        pending[rid][2] = time.monotonic()
                    elif time.monotonic() - t_reply > RECORD_GRACE_S:
                        raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: no record arrived "
                                               f"{RECORD_GRACE_S:.0f}s after the reply")
                    time.sleep(reader.poll_interval)
                    continue
                del pending[rid]
                try:
                    mask = record_loss_mask(sample, reply.get("output_ids", []), rec)
                except ExtractError as e:
                    raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: {e}") from None
                out = specforge_sample(rec.input_ids, mask, rec.aux_hidden_states, rec.last_hidden_state)
                del rec
                yield out
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for rid, (_, fut, _) in pending.items():
                if not fut.done():
                    try:
                        requests.post(f"{self.url}/abort_request", json={"rid": rid}, timeout=5)
                    except requests.RequestException:
                        pass
            pool.shutdown(wait=True)
            session.close()
            reader.close()
