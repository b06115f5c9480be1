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

This module holds the command's flags and their help (what `--help` prints: the paragraph above is its
description); sglang_hs/extract/config.py turns what they parse into the run's typed configuration.
"""
from __future__ import annotations

import argparse

from sglang_hs.extract.errors import PROG
from sglang_hs.extract.sinks import SINKS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1],
                                epilog="Any other flag goes to python -m sglang_hs.launch_server (without --server).")
    p.add_argument("--data", metavar="FILE",
                   help="JSON Lines (conversations/messages, or input_ids [+ loss_mask]), or a Hugging Face dataset")
    p.add_argument("--output", required=True, metavar="DIR", help="folder of the training files and manifest.json")
    p.add_argument("--output-group", default=None, metavar="GROUP",
                   help="let GROUP read the output files (folders 0750, files 0640 of GROUP, e.g. a trainer running "
                        "as another user); default: 0700/0600, this user only")
    p.add_argument("--format", choices=list(SINKS), default="specforge",
                   help="specforge: rows_*/data_{i}.ckpt; safetensors: speculators' dataset (hs_{i}.safetensors per "
                        "sample, the datasets table and hidden_states/ written when the run completes); deepspec: "
                        "DeepSpec's target cache v2 (sample_{i}.bin per sample, target_cache/ written when the run "
                        "completes); all need the final state")
    p.add_argument("--save-dtype", default=None, metavar="DTYPE",
                   help="bf16, fp8, fp8-per-layer or fp8-e5m2 (default: bf16 for --format specforge, whose "
                        "TargetHead reads bf16 only, and deepspec, whatever the server's dtype; else the dtype the "
                        "server captured in, bf16 "
                        "for these models). fp8: --format safetensors only, speculators' FP8 scheme (e4m3, one float32 "
                        "scale per token over all layers; train with --hidden-states-backend fp8), about half "
                        "the disk of bf16; fp8-per-layer: a scale per token and layer (read by hs-connectors "
                        "0.9.0's FP8Transfer through broadcasting, not its documented scheme). --format deepspec: "
                        "fp8 (float8_e4m3fn) or fp8-e5m2 (float8_e5m2), an unscaled cast (DeepSpec's FP8 cache "
                        "proposal; its released reader takes bf16 only); a sample beyond the dtype's range is skipped")
    p.add_argument("--finalize", action="store_true",
                   help="--format safetensors: only (re)write speculators' dataset for the hs_*.safetensors files in "
                        "--output (--format deepspec: target_cache/ for the sample_*.bin files), e.g. after copying "
                        "the outputs of several --shard runs into one folder")
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
    p.add_argument("--transport", default="ring", metavar="KIND",
                   help="how the records come: ring (default: the server's --hs-dump-dir on this node) or mooncake "
                        "(a server on another host, through its python -m sglang_hs.publish: --mooncake)")
    p.add_argument("--mooncake", default=None, metavar="HOST:PORT",
                   help="with --transport mooncake: the serving node's publisher (its --listen address)")
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
    p.add_argument("--part-mb", default=None, metavar="MIB",
                   help="records of more than this many MiB of rows (default 256) are written a chunk of this size at "
                        "a time, never held whole: the reader maps only the chunk's ring pages")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a line per 1000 samples instead)")
    return p
