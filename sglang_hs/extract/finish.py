"""The end of a run, the same for a --data run and a harvest: speculators' dataset made of the sample files
(sink.finalize(), when the server captured the final state), the summary line, manifest.json and the trainer's
command; and `--finalize`, which does only the first, for sample files already in --output."""
from __future__ import annotations

import sys
from typing import Optional

from sglang_hs.extract.errors import PROG, ExtractError
from sglang_hs.extract.manifest import write_manifest
from sglang_hs.extract.output import prepare_output
from sglang_hs.extract.sinks.base import Sink, SinkError
from sglang_hs.extract.stats import Stats, print_summary
from sglang_hs.extract.trainers import print_training_command


def record_run(output, manifest: dict, facts, stats: Stats, sink: Sink, status: str, dataset: Optional[dict],
               trainer_manifest: dict, ok: bool) -> None:
    """Say how the run went (`output`: config.OutputSettings, `facts`: config.RunFacts), write manifest.json,
    and, for a run that succeeded, how to train on the files (`trainer_manifest`: the capture's manifest with
    the model's vocab_size)."""
    print_summary(stats, output.dir)
    write_manifest(output.dir, manifest, facts, stats, sink, status, dataset)
    if ok:
        print_training_command(output.dir, trainer_manifest, sink.name, output.save_dtype, output.gid)


def finalize_only(output, sink: Sink) -> int:
    """--finalize: (re)write speculators' dataset (DeepSpec's target cache) for the sample files in --output;
    returns the exit status."""
    try:
        prepare_output(output.dir, output.gid)
    except ExtractError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        n = len(sink.samples())
        rows = sink.finalize()["rows"]
    except (SinkError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    what = "DeepSpec target cache" if sink.name == "deepspec" else "speculators dataset"
    print(f"[extract] {what} of {rows} rows (of {n} sample files) in {sink.out_dir}", file=sys.stderr)
    return 0
