"""The server a --data run starts itself (no --server): `python -m sglang_hs.launch_server` with the launcher
flags given, capturing into --hs-dump-dir or a fresh folder in /dev/shm, with the final state its --format
trains on; waited for, and stopped at the end (its dump folder removed when this run made it)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from sglang_hs.extract.errors import ExtractError


def last_state_for(fmt: str, verify: float) -> str:
    """The --hs-last a server started for --format `fmt` runs with: the final state its trainer reads
    (SpecForge: post-norm; speculators: pre-norm), both when --verify also needs the post-norm one."""
    from sglang_hs.extract.sinks import SINKS

    want = SINKS[fmt].final_state
    return "both" if verify and want != "post-norm" else want


def start(server, fmt: str, verify: float):
    """Start the server of `server` (config.ServerSettings: its --hs-dump-dir, launcher flags), not yet
    waited for; it has .url and .dump_dir."""
    from sglang_hs.tools.server_process import ServerProcess

    dump_dir = server.dump_dir or os.path.join(
        tempfile.mkdtemp(prefix="sglang-hs-extract-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None), "hs")
    args = ["--hs-dump-dir", dump_dir, *server.launcher_args]
    if not any(a == "--hs-last" or a.startswith("--hs-last=") for a in server.launcher_args):
        args += ["--hs-last", last_state_for(fmt, verify)]  # both formats train on the final state
    process = ServerProcess(args)
    process.dump_dir = dump_dir
    print(f"[extract] starting the server: {' '.join(process.cmd)} (log {process.log_path})", file=sys.stderr,
          flush=True)
    return process


def wait_ready(process) -> None:
    from sglang_hs.tools.server_process import ServerStartError

    try:
        process.wait_ready()
    except ServerStartError as e:
        raise ExtractError(str(e)) from None


def stop(process, made_dump_dir: bool) -> None:
    """Stop it; the dump folder this run made goes too (its ring and manifest outlive the server)."""
    process.stop()
    if made_dump_dir:
        shutil.rmtree(os.path.dirname(process.dump_dir), ignore_errors=True)
