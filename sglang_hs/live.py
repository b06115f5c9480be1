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
`loss_mask` [T] int64, `hidden_state` [1, T, H] (final state) and `aux_hidden_state` [1, T, K*H], in bf16
(`dtype=`, as the files). With layout="deepspec", DeepSpec's target-cache rows instead, as its CacheDataset
reads them from --format deepspec's files (sinks.deepspec_sample). Samples come in dataset order (a sample
waits for the ones before it), so a run over the same data and server is reproducible. Records the extraction
would skip (malformed, too long) are skipped and counted in `self.skipped` (of the process iterating); a
request that fails raises LiveDatasetError.

The server must run with --hs-last (SpecForge trains on the final state) and nobody else may read its
dump dir while this iterates: the dataset holds the one HiddenStateReader of the dump dir from the start
of an iteration to its end (records are drained as they arrive, not acknowledged: a sample is in memory
only until it is yielded). An iteration that ends, is closed early (`break`, garbage collection) or
raises aborts its requests still in flight, closes the reader and its HTTP threads; a consumer killed
outright leaves the server serving: its flock on the dump dir dies with it, and a later reader drains
whatever records its last requests left in the ring. A server restarted meanwhile is followed to its new
ring (HiddenStateReader(reattach=True)); one that comes back with another setup ends the iteration with
LiveDatasetError.

A long record (more than `part_bytes` of rows, 256 MiB by default; ring transport) is never copied whole: it
stays in the ring as views, and its sample's states are written a chunk at a time into files in `spill_dir`
(default: the temp folder; not a tmpfs, or the file is memory again: the first spill into a tmpfs or ramfs folder
warns once, in one line), which are mapped (copy on write: the trainer may change them in place) and unlinked at
once, so nothing is left behind whatever happens to the process, then the record is acknowledged. The trainer
gets the same dict, its two state tensors file-backed (torch.from_file): their pages come from the page cache as
they are read. From DataLoader workers the files cross to the main process, not copies (sglang_hs/spill.py); with
several workers the router spills the record itself to a file the worker maps. Mooncake still hands a long record
over whole.

DataLoader workers: any number. With num_workers N > 1, worker k sends the records of index % N == k
(concurrency / N of them in flight each, at least one: max(concurrency, N) in all), and worker 0 holds the
dump dir's one reader in a thread that hands each record to the worker whose request it is, tensors through
shared memory (sglang_hs/live_workers.py; fork or spawn). Every sample comes once per epoch. Order: each
worker yields its share in dataset order and the DataLoader (in_order, the default) takes one sample from
each worker in turn, so the order is the dataset's until a worker's share runs short (a skipped record,
an uneven split), and the same for the same data and N. No worker waits for another (the DataLoader
would wait for that one and hand the others no work): worker 0's router thread outlives worker 0's share
and closes the reader before it answers the last worker's goodbye, so when the DataLoader's iteration
ends, every request has been answered and the reader is closed. `skipped` counts in each
worker's copy, out of the main process's sight. A killed consumer's workers exit once PyTorch's
watchdog sees their parent gone (within 5 s), the router's reader lock going with worker 0.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import time
import uuid
from typing import Iterable, Iterator, Optional, Union

import torch

from sglang_hs.envs import DEFAULT_PART_BYTES
from sglang_hs.live_workers import LiveDatasetError  # defined there, where the workers raise it too; public here
from sglang_hs.reader import is_long

LAYOUTS = ("specforge", "deepspec")  # the --format whose files the samples equal, tensor for tensor


SPILL_PIECES = 8  # spill_sample copies an eighth of a chunk at a time (the states are not contiguous in the ring)


def spill_sample(reader, rec, loss_mask: torch.Tensor, layout: str = "specforge", dtype: Optional[torch.dtype] =
                 torch.bfloat16, spill_dir: Optional[str] = None) -> dict:
    """The sample LiveHiddenStates yields for record `rec` (specforge_sample's or deepspec_sample's dict, the same
    tensors), its two state tensors written into files in `spill_dir` (default: the temp folder) a chunk of rows
    at a time from reader.chunks(rec) (each chunk's ring pages unmapped once the next is read), then mapped copy
    on write and unlinked at once (sglang_hs/spill.py): the whole record is never in this process's memory, and no
    file outlives the tensors. In a DataLoader worker they cross to the main process as the files, not as copies
    (spill.crossing_as_file). The caller acknowledges `rec` afterwards."""
    from sglang_hs.extract.sinks.base import write_at
    from sglang_hs.extract.sinks.deepspec import fit_hidden
    from sglang_hs.spill import SpillFile, crossing_as_file, spill_folder

    T, K, H = rec.aux_hidden_states.shape
    ids = rec.input_ids.to(torch.int32 if layout == "deepspec" else torch.int64).clone()
    mask = loss_mask.to(torch.uint8 if layout == "deepspec" else torch.int64)
    cast = dtype if dtype is not None else rec.aux_hidden_states.dtype
    out_dtype = torch.bfloat16 if layout == "deepspec" and cast.itemsize == 1 else cast

    def convert(x: torch.Tensor) -> torch.Tensor:
        if layout == "deepspec" and dtype is not None:
            x = fit_hidden(x, dtype)  # an FP8 cast checked (per chunk), read back as bf16 as DeepSpec's reader does
        return x.to(out_dtype)

    folder = spill_folder(spill_dir)
    fa, fl = SpillFile(folder), SpillFile(folder)
    try:
        for c in reader.chunks(rec):
            n = c.stop - c.start
            step = max(1, -(-n // SPILL_PIECES))  # made contiguous (and cast) a piece of a chunk at a time
            for s in range(0, n, step):
                at, e = c.start + s, min(n, s + step)
                write_at(fa.file, at * K * H * out_dtype.itemsize,
                         convert(c.aux_hidden_states[s:e].reshape(e - s, K * H)))
                write_at(fl.file, at * H * out_dtype.itemsize, convert(c.last_hidden_state[s:e]))
        # in a DataLoader worker the sample crosses as its files: mapped shared, so what the worker changes in place
        # (a wrapper normalising the states) is in the file the main process maps
        shared = torch.utils.data.get_worker_info() is not None
        aux, last = fa.map(T * K * H, out_dtype, shared), fl.map(T * H, out_dtype, shared)
    except BaseException:  # e.g. rows FP8 cannot store: the files go at once
        fa.close()
        fl.close()
        raise
    if layout == "deepspec":
        states = {"target_hidden_states": (aux.view(T, K * H), fa), "target_last_hidden_states": (last.view(T, H), fl)}
    else:
        states = {"hidden_state": (last.view(1, T, H), fl), "aux_hidden_state": (aux.view(1, T, K * H), fa)}
    out = {"input_ids": ids, "loss_mask": mask}
    for key, (t, spill) in states.items():
        out[key] = crossing_as_file(t, spill) if shared else t
    for spill in (fa, fl):
        if not shared:  # the mappings keep the files; only a crossing needs the descriptor
            spill.close()
    return out


class LiveHiddenStates(torch.utils.data.IterableDataset):
    def __init__(self, data: Union[str, os.PathLike, Iterable], server: str, dump_dir: Optional[str] = None,
                 concurrency: int = 8, max_samples: Optional[int] = None, request_timeout: float = 3600.0,
                 reader_wait: float = 30.0, owner=None, dtype: Optional[torch.dtype] = torch.bfloat16,
                 layout: str = "specforge", transport: str = "ring", publisher: Optional[str] = None,
                 part_bytes: Optional[int] = DEFAULT_PART_BYTES, spill_dir: Optional[str] = None) -> None:
        """`data`: a path (JSON Lines, HF dataset) or an iterable of records, iterated anew each epoch.
        `server`: the URL of an sglang-hs server capturing into `dump_dir` with --hs-last. `owner`: the
        server's user when it is not you (see HiddenStateReader). `dtype`: the states' dtype, bf16 by
        default as `--format specforge` writes them (SpecForge's TargetHead reads bf16 only); None: the
        server's dtype. `layout`: "specforge" (the default), or "deepspec": DeepSpec's CacheDataset rows
        (input_ids int32, loss_mask uint8, target_hidden_states [T, K*H], target_last_hidden_states [T, H]),
        built by the function --format deepspec writes its files with (sinks.deepspec_sample); `dtype` is then
        the cache's hidden dtype (bf16; an FP8 dtype gives the cast read back as bf16, as DeepSpec's FP8 reader
        does). `transport`: "ring" (the dump dir on this node) or
        "mooncake": a server on another host, its records through its `python -m sglang_hs.publish` at `publisher`
        (HOST:PORT; no dump_dir). `part_bytes`: a record of more row bytes is spilled to `spill_dir` a chunk
        at a time, never copied whole (module docstring); None: every record copied."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout: one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        if transport not in ("ring", "mooncake"):
            raise ValueError(f"transport: expected 'ring' or 'mooncake', got {transport!r}")
        if transport == "mooncake":
            from sglang_hs.extract.transport.mooncake import parse_address

            if publisher is None:
                raise ValueError("publisher: expected the HOST:PORT of the serving node's python -m sglang_hs.publish "
                                 "--listen with transport='mooncake'")
            parse_address(publisher, "publisher")
            if dump_dir is not None:
                raise ValueError("dump_dir: the serving node's, not this one's, with transport='mooncake' (its "
                                 "publisher reads it); leave it out")
        elif dump_dir is None:
            raise ValueError("dump_dir: expected the server's --hs-dump-dir (or transport='mooncake' and publisher=)")
        elif publisher is not None:
            raise ValueError("publisher: only with transport='mooncake'")
        self.transport, self.publisher = transport, publisher
        if part_bytes is not None and (isinstance(part_bytes, bool) or not isinstance(part_bytes, int)
                                       or part_bytes < 1):
            raise ValueError(f"part_bytes: a byte count >= 1 or None, got {part_bytes!r}")
        self.part_bytes = part_bytes
        self.spill_dir = os.fspath(spill_dir) if spill_dir is not None else None
        if self.spill_dir is not None and not (os.path.isdir(self.spill_dir) and os.access(self.spill_dir, os.W_OK)):
            raise ValueError(f"spill_dir: expected a writable directory (disk-backed: long records are written there), "
                             f"got {self.spill_dir!r}")
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype: a floating-point torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.data = os.fspath(data) if isinstance(data, (str, os.PathLike)) else data
        self.url = server.rstrip("/")
        self.dump_dir = str(dump_dir) if dump_dir is not None else None
        self.concurrency, self.max_samples = concurrency, max_samples
        self.request_timeout, self.reader_wait, self.owner = request_timeout, reader_wait, owner
        self.skipped: "collections.Counter[str]" = collections.Counter()
        self._preparer = None
        self._key, self._authkey, self._epochs = uuid.uuid4().hex, os.urandom(32), 0  # for DataLoader workers
        from sglang_hs.live_workers import make_rendezvous_dir

        self._rendezvous = make_rendezvous_dir(self)  # their private meeting folder, removed with this dataset
        self._router = None  # worker 0's RecordRouter of its latest iteration

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
        if info is None or info.num_workers == 1:
            return self._iterate()
        self._epochs += 1  # in this worker's copy; every worker counts the same
        return self._iterate_worker(info)

    def _iterate(self) -> Iterator[dict]:
        """One process (no DataLoader workers, or one): it holds the dump dir's reader itself."""
        from sglang_hs.live_workers import open_live_reader

        try:
            reader = open_live_reader(self.dump_dir, self.reader_wait, self.owner, self.publisher,
                                      self.part_bytes if self.publisher is None else None)
        except (RuntimeError, FileNotFoundError, ConnectionError, ImportError) as e:
            raise LiveDatasetError(f"LiveHiddenStates: {e}") from None
        yield from self._samples(reader, f"hsl-{uuid.uuid4().hex[:12]}-", 0, 1, self.concurrency)

    def _iterate_worker(self, info) -> Iterator[dict]:
        """DataLoader worker `info.id` of several: it sends the records of index % num_workers == id, and
        gets their records from the router worker 0 runs (sglang_hs/live_workers.py). Worker 0's iteration
        ends with its share, not waiting for the others' (the DataLoader, in order, would wait for it and
        hand the others no work: a deadlock); its router goes on until every worker is done, the last one's
        done answered only once the reader is closed."""
        from sglang_hs.live_workers import RecordRouter, RoutedRecords, iteration_key, rendezvous_address

        key, n = iteration_key(self._key, self._epochs), info.num_workers
        address = rendezvous_address(self._rendezvous, key, create=True)  # any worker may be first
        router = None
        if info.id == 0:
            if self._router is not None:  # persistent workers: the last epoch's, ended or stopped early
                self._router.stop()
                self._router.join()
            try:
                router = self._router = RecordRouter(address, self._authkey, n, self.dump_dir, self.reader_wait,
                                                     self.owner, self.publisher, self.part_bytes, self.spill_dir)
            except (RuntimeError, FileNotFoundError, OSError, ImportError) as e:
                raise LiveDatasetError(f"LiveHiddenStates: {e}") from None
        finished = False
        try:
            try:  # worker 0 may still be waiting for the manifest
                source = RoutedRecords(address, self._authkey, info.id, 2 * self.reader_wait + 10,
                                       part_bytes=self.part_bytes if self.publisher is None else None)
            except (OSError, EOFError) as e:
                raise LiveDatasetError(f"LiveHiddenStates: DataLoader worker {info.id}: the record router "
                                       f"(worker 0) did not answer ({type(e).__name__}: {e})") from None
            share = max(1, (self.concurrency + n - 1 - info.id) // n)  # the shares sum to concurrency
            yield from self._samples(source, source.rid_prefix, info.id, n, share)
            finished = True
        finally:
            if router is not None and not finished:  # an error, or the iteration closed early: end them all
                router.stop()

    def _samples(self, reader, ours: str, worker: int, num_workers: int, concurrency: int) -> Iterator[dict]:
        """The samples of records index % num_workers == worker, records from `reader` (a HiddenStateReader
        or a worker's RoutedRecords), rids `ours` + index; closes `reader` when it ends."""
        import requests

        from sglang_hs.extract.errors import ExtractError
        from sglang_hs.extract.samples import STATUS_CHECK_S, make_preparer, record_loss_mask, record_overdue, request_body
        from sglang_hs.extract.dataset import SkipSample
        from sglang_hs.extract.sinks import deepspec_sample, specforge_sample
        from sglang_hs.server.capture_spec import final_states
        from sglang_hs.reader import ServerRestarted, node_share

        session = requests.Session()
        pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="sglang-hs-live")
        pending: "collections.OrderedDict[str, list]" = collections.OrderedDict()  # rid -> [sample, future, t_reply]
        try:
            if "post-norm" not in final_states(reader.manifest):
                raise LiveDatasetError(f"LiveHiddenStates: the server at {self.url} runs without --hs-last (or "
                                       f"with --hs-last pre-norm); the {self.layout} layout needs the post-norm final "
                                       "state")
            if int(reader.manifest.get("rows_per_layer", 1)) != 1:  # as the extraction's check_streams
                raise LiveDatasetError(f"LiveHiddenStates: the server at {self.url} captures DeepSeek-V4's full "
                                       "hyper-connection streams (--hs-hc-streams full); SpecForge's layout takes one "
                                       "row per layer id: restart it with --hs-hc-streams mean")
            if self._preparer is None:
                self._preparer = make_preparer(reader.manifest, url=self.url)
            # one node of a multi-node server (--nnodes): this node's samples (index modulo the DP size is one
            # of its DP ranks), each routed to its rank, so its record lands in this node's dump
            share = node_share(reader.manifest)
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

            # the server's status (sglang_hs.status) is read where its dump dir is; across hosts there is none
            # here (a mooncake:// path holds no status file): a record then has its grace, RECORD_GRACE_S
            status_dir = self.dump_dir if self.dump_dir is not None else f"mooncake://{self.publisher}"
            records, exhausted, next_check = self._records(), False, 0.0
            while not exhausted or pending:
                while not exhausted and len(pending) < concurrency:
                    try:
                        index, record = next(records)
                    except StopIteration:
                        exhausted = True
                        break
                    pos = index  # among the samples this node takes: each worker gets every num_workers-th
                    if share is not None:
                        ranks, dp_size = share
                        if index % dp_size not in ranks:
                            continue  # another node's sample
                        pos = index // dp_size * len(ranks) + ranks.index(index % dp_size)
                    if pos % num_workers != worker:
                        continue
                    try:
                        sample = self._preparer(index, record)
                    except SkipSample as e:
                        self.skipped[e.reason] += 1
                        continue
                    rid = ours + str(index)
                    body = request_body(sample, rid)
                    if share is not None:
                        body["routed_dp_rank"] = index % share[1]
                    pending[rid] = [sample, pool.submit(send, body), None]
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
                    try:
                        reader.poll()  # follows a restarted server to its new ring (reattach)
                    except (ServerRestarted, ConnectionError) as e:  # one it cannot follow; a publisher gone
                        raise LiveDatasetError(f"LiveHiddenStates: {e}") from None
                    for other in reader.ready_rids():  # records of others' requests: not ours to keep
                        if not other.startswith(ours):
                            reader.discard(other)
                    rec = reader.pop_ready(rid)
                if rec is None and reader.not_captured(rid):
                    raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: served without capture "
                                           f"({reader.not_captured(rid)}): the server runs with --hs-when-behind "
                                           "skip; serve training with hold (the default)")
                if rec is None:  # published after the reply left the server: on its way, briefly
                    if t_reply is None:
                        pending[rid][2] = time.monotonic()
                    elif time.monotonic() >= next_check:  # the server's status says whether it is still to come
                        next_check = time.monotonic() + STATUS_CHECK_S
                        why = record_overdue(status_dir, t_reply)
                        if why is not None:  # one more read after that status: it is there, or never comes
                            reader.poll()
                            if rid not in reader.ready_rids() and not reader.not_captured(rid):
                                raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: {why}")
                            continue
                    time.sleep(reader.poll_interval)
                    continue
                del pending[rid]
                from sglang_hs.extract.fp8 import UnstorableRows

                try:  # every way out gives the record's ring bytes back (an acknowledging reader: else the ring
                    # stays pinned behind it and the server holds every captured request once it wraps)
                    try:
                        mask = record_loss_mask(sample, reply.get("output_ids", []), rec)
                    except ExtractError as e:
                        raise LiveDatasetError(f"LiveHiddenStates: sample {sample.index}: {e}") from None
                    if is_long(reader, rec):
                        out = spill_sample(reader, rec, mask, self.layout, self.dtype, self.spill_dir)
                        if not reader.intact(rec):  # its ring bytes were taken back meanwhile: the spill is torn
                            raise LiveDatasetError(
                                f"LiveHiddenStates: sample {sample.index}: the record's ring bytes were given back "
                                "while it was spilled (someone else wrote this reader's read offset)")
                    elif self.layout == "deepspec":
                        out = deepspec_sample(rec.input_ids, mask, rec.aux_hidden_states, rec.last_hidden_state,
                                              dtype=self.dtype)
                    else:
                        out = specforge_sample(rec.input_ids, mask, rec.aux_hidden_states, rec.last_hidden_state,
                                               dtype=self.dtype)
                except UnstorableRows as e:  # the file would not be written either
                    self.skipped[e.reason] += 1
                    continue
                finally:
                    if getattr(reader, "ack_mode", False):
                        reader.ack(rec)  # copied or spilled out, or skipped: its ring bytes go back
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
