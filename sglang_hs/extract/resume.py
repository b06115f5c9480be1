"""What --output already holds when a run starts, and whether this run may continue it, in one place.

A --data run continues only with --resume and the --save-dtype of the run before (manifest.json says it);
the samples whose file is there are skipped (the sink's resume state). A harvest continues where the last one
stopped, its journal (journal.py) saying which records have their file; sample files without a journal are
another run's, refused. Either way the temporary files of an interrupted write are removed, a harvest's only
once it holds the journal's lock (they may be a running harvester's otherwise).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.journal import JOURNAL, Journal
from sglang_hs.extract.manifest import previous
from sglang_hs.extract.output import prepare_output
from sglang_hs.extract.sinks.base import ResumeState, Sink


def continue_requests(output, sink: Sink) -> ResumeState:
    """--output made or checked for a --data run (`output`: config.OutputSettings): its sample files are
    refused without --resume, or with another --save-dtype; returns what is there (ExtractError, OSError)."""
    prepare_output(output.dir, output.gid)
    state = sink.resume_state()
    if state.files and not output.resume:
        raise ExtractError(f"--output {output.dir} already holds {state.files} {output.format} sample files; pass "
                           "--resume to continue that run, or choose another folder")
    if state.files:
        check_save_dtype(output.dir, output.save_dtype)
    removed = sink.remove_partial()
    if removed:
        print(f"[extract] removed {removed} partial file(s) an interrupted run left", file=sys.stderr)
    return state


def continue_harvest(output, sink: Sink) -> Journal:
    """--output made or checked for a harvest, its journal opened and locked (ExtractError: another
    harvester's, or sample files of a run that was no harvest; OSError)."""
    prepare_output(output.dir, output.gid)
    state = sink.resume_state()
    if state.files and not os.path.lexists(os.path.join(output.dir, JOURNAL)):
        raise ExtractError(f"--output {output.dir} already holds {state.files} {output.format} sample files of "
                           "another run (no harvest journal): choose another folder")
    journal = Journal(output.dir, output.gid)
    try:
        sink.remove_partial()  # under the lock: no other harvester's file in the making
    except BaseException:
        journal.close()
        raise
    return journal


def check_save_dtype(out_dir: str, save_dtype: Optional[str]) -> None:
    """--resume continues a run with the --save-dtype it had (manifest.json says which)."""
    last_run = previous(out_dir)
    if last_run is None:
        return  # no manifest (a run killed before writing one): finalize still refuses mixed files
    before = last_run.get("save_dtype")
    if before is None and save_dtype == "bf16" and last_run.get("stored_dtype") == "bfloat16":
        return  # a specforge run from before bf16 was its default, of a bf16 server: the same files
    if before != save_dtype:
        said = lambda d: f"--save-dtype {d}" if d else "no --save-dtype"  # noqa: E731
        raise ExtractError(f"--save-dtype: --output {out_dir} holds files of a run with {said(before)}; resume it "
                           f"with the same (this run has {said(save_dtype)})")
