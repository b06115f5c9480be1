"""The extraction path as one pipeline, source -> transport -> sink, its data going one way:

  --data       the dataset file's samples (sources/dataset_file.py) -> a running server, given or started
               (sources/server.py, sources/launch.py) -> each request's record through the transport
               (transport/) -> the sink stage (writer.py) -> one file per sample (sinks/)
  --from-dump  a harvesting server's traffic (harvest.traffic) -> the transport -> one file per record, each
               journaled before it is acknowledged (harvest.Harvester, journal.py)

Each run first checks what --output already holds (resume.py), then what the server captures against what
the format needs (capture_checks.py), and ends the same way (finish.py: the training set, the summary,
manifest.json, the trainer's command). The configuration comes in pieces (config.py), never whole.
"""
from __future__ import annotations

import signal
import sys

from sglang_hs.extract import finish
from sglang_hs.extract.capture_checks import check_capture
from sglang_hs.extract.errors import PROG, ExtractError
from sglang_hs.extract.harvest import Harvester, traffic
from sglang_hs.extract.journal import setup_of
from sglang_hs.extract.resume import continue_harvest, continue_requests
from sglang_hs.extract.sinks.base import Sink, SinkError
from sglang_hs.extract.sources import launch
from sglang_hs.extract.sources.dataset_file import DatasetSource
from sglang_hs.extract.sources.server import Extraction
from sglang_hs.extract.stats import Stats
from sglang_hs.extract.trainers import model_vocab_size
from sglang_hs.extract.transport import TRANSPORTS


def run_data(output, sink: Sink, source: DatasetSource, server, requests, facts, torch_threads: int,
             progress: bool, model_side) -> int:
    """The --data run (`output`, `server`, `requests`, `facts`: config's pieces; `model_side(requests, manifest,
    url)`: the sample preparer and --verify's lm_head for the server's model); returns the exit status."""
    try:
        resumed = continue_requests(output, sink)
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
    torch.set_num_threads(torch_threads)  # restored below: main() also runs inside other programs
    process = extraction = manifest = dataset = reader = None
    status, rc = "failed", 1
    try:
        if server.url is not None:  # --server given (even one that is all slashes: refused where it is used)
            url, dump_dir = server.url, server.dump_dir
        else:
            process = launch.start(server, output.format, requests.verify)  # before the wait: Ctrl-C stops it too
            url, dump_dir = process.url, process.dump_dir
            launch.wait_ready(process)
        reader = TRANSPORTS[server.transport].for_requests(dump_dir, server.owner, output.part_bytes)
        source.selection.split_by_node(reader.manifest)
        manifest = dict(reader.manifest, vocab_size=model_vocab_size(reader.manifest["model_path"]))
        check_capture(output.format, sink, manifest, f"the server at {url}", verify=bool(requests.verify))
        sink.describe_capture(manifest)
        preparer, lm_head = model_side(requests, manifest, url)
        extraction = Extraction(requests, url, reader, sink, preparer, lm_head, process, progress)
        extraction.run(source, resumed)
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
        if process is not None:
            launch.stop(process, made_dump_dir=not server.dump_dir)
    if extraction is not None:
        finish.record_run(output, manifest, facts, extraction.stats, sink, status, dataset, manifest, rc == 0)
    return rc


def run_harvest(output, sink: Sink, harvest, facts, torch_threads: int) -> int:
    """The --from-dump run (sglang_hs/extract/harvest.py; `harvest`: config.HarvestSettings) until SIGINT or
    SIGTERM (the file in hand is finished), --max-samples files or --idle-timeout; returns the exit status."""
    stop = []

    def on_signal(signum, frame):
        stop.append(signal.Signals(signum).name)

    import torch

    from sglang_hs.reader import ServerRestarted
    from sglang_hs.server.store.ring import TornRecord

    reader = journal = harvester = manifest = dataset = None
    status, rc = "failed", 1
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        journal = continue_harvest(output, sink)  # locked: the partial files it removed are no other harvester's
        reader = TRANSPORTS[harvest.transport].for_harvest(harvest.dump_dir, harvest.owner, output.part_bytes)
        manifest = reader.manifest
        check_capture(output.format, sink, manifest, f"the server of {harvest.dump_dir}")
        journal.check_setup(setup_of(output, manifest), output.dir)
        sink.describe_capture(manifest)
        harvester = Harvester(reader, sink, journal, Stats())
        print(f"[extract] harvesting {harvest.dump_dir} into {output.dir} (--format {output.format}); stop with "
              "Ctrl-C or SIGTERM", file=sys.stderr, flush=True)
        torn = None
        records = traffic(reader, harvest.dump_dir, stop, harvest.idle_timeout)
        while True:
            try:  # only the reading: an error of handle() is not a torn ring
                rec = next(records)
            except StopIteration:
                break
            except (TornRecord, ServerRestarted) as e:  # the ring's bytes are not what the server wrote, or a
                torn = e  # restarted server this harvester cannot follow: nothing after it is read
                break
            harvester.handle(rec)
            if harvest.max_samples is not None and harvester.stats.done >= harvest.max_samples:
                break
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
            stats.end()
            # as a --data run does: the trainer's command on these files (SpecForge: its run config)
            finish.record_run(output, manifest, facts, stats, sink, status, dataset,
                              dict(manifest, vocab_size=model_vocab_size(manifest["model_path"])), rc == 0)
    finally:
        if journal is not None:
            journal.close()  # after the manifest: no other harvester writes into --output before it is there
    return rc

