"""The run's configuration, typed and checked once: parse_args turns the command line into an ExtractConfig
(or one ExtractError line naming the flag), and each part of the pipeline gets the pieces it needs:

  output     OutputSettings   --output, --format, --save-dtype, --output-group, --resume: the sink, resume
  selection  Selection        --shard (and the node split, settled when the dump is read): the dataset source
  server     ServerSettings   --server, --hs-dump-dir, --hs-owner and the launcher flags: the server, transport
  requests   RequestSettings  --concurrency, --verify, --regenerate and its sampling, --request-timeout
  harvest    HarvestSettings  --from-dump, --idle-timeout, --max-samples: the harvest
  facts      RunFacts         what manifest.json records of the command line
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from sglang_hs.envs import DEFAULT_PART_BYTES
from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.flags import build_parser
from sglang_hs.extract.selection import Selection

PART_BYTES = DEFAULT_PART_BYTES  # --part-mb's default
TRANSPORT = "ring"  # transport/__init__.py's TRANSPORTS: the node-local ring by default (--transport)


@dataclass(frozen=True)
class OutputSettings:
    dir: str  # --output, absolute
    format: str  # --format: a name of sinks.SINKS
    save_dtype: Optional[str]  # --save-dtype (bf16 for specforge when not given)
    gid: Optional[int]  # --output-group's gid; None: files of this user only
    resume: bool
    part_bytes: int = PART_BYTES  # --part-mb: a record of more row bytes is written a chunk of this size at a time


@dataclass(frozen=True)
class ServerSettings:
    url: Optional[str]  # --server, without a trailing /; None: this command starts one
    dump_dir: Optional[str]  # --hs-dump-dir; None without --server: a fresh one in /dev/shm
    owner: Optional[int]  # --hs-owner's uid; None: this user
    launcher_args: Tuple[str, ...]  # the flags for python -m sglang_hs.launch_server
    transport: str = TRANSPORT


@dataclass(frozen=True)
class RequestSettings:
    concurrency: int
    verify: float  # the fraction of samples checked against the server's logprobs
    request_timeout: float
    regenerate: bool  # send the prompt only; the target writes the reply, sampled with the three below
    max_new_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class HarvestSettings:
    dump_dir: str  # --from-dump, as given
    idle_timeout: Optional[float]
    max_samples: Optional[int]  # stop after this many files written
    owner: Optional[int]  # --hs-owner's uid
    transport: str = TRANSPORT


@dataclass(frozen=True)
class RunFacts:
    """What manifest.json records of the command line (manifest.write_manifest)."""
    data: Optional[str]
    from_dump: Optional[str]
    save_dtype: Optional[str]
    regenerate: bool
    selection: Selection

    @property
    def shard(self) -> str:
        return self.selection.label


@dataclass(frozen=True)
class ExtractConfig:
    mode: str  # "data" (--data), "harvest" (--from-dump) or "finalize" (--finalize)
    output: OutputSettings
    data: Optional[str]
    max_samples: Optional[int]  # --data: only the first N records
    selection: Selection
    server: ServerSettings
    requests: RequestSettings
    harvest: Optional[HarvestSettings]
    torch_threads: int
    progress: bool

    # the flags by their names, as the command line said them (the node split may rewrite the shard's)
    @property
    def format(self) -> str:
        return self.output.format

    @property
    def save_dtype(self) -> Optional[str]:
        return self.output.save_dtype

    @property
    def shard(self) -> str:
        return self.selection.label

    @property
    def route(self):
        return self.selection.route

    @property
    def facts(self) -> RunFacts:
        return RunFacts(self.data, self.harvest.dump_dir if self.harvest else None, self.output.save_dtype,
                        self.requests.regenerate, self.selection)


def parse_args(argv: List[str]) -> Tuple[ExtractConfig, List[str]]:
    """The configuration of `argv`, and the flags it hands to the launcher; ExtractError (one line naming the
    flag) for a command line that cannot run."""
    ns, launcher_args = build_parser().parse_known_args(argv)
    gid = None
    if ns.output_group is not None:
        from sglang_hs.fsutil import resolve_share_group

        try:
            gid = resolve_share_group(ns.output_group, "--output-group")
        except ValueError as e:
            raise ExtractError(str(e)) from None
    # 0/1 (all) is the default, also when written out
    selection = Selection(ns.shard or "0/1", given=ns.shard not in (None, "0/1"))
    save_dtype = _save_dtype(ns.format, ns.save_dtype)
    part_bytes = _part_bytes(ns.part_mb)
    if ns.idle_timeout is not None and not ns.from_dump:
        raise ExtractError("--idle-timeout is for --from-dump")
    if ns.from_dump and ns.finalize:
        raise ExtractError("--finalize does not go with --from-dump (a --from-dump run finalizes when it stops)")
    mode, owner = "harvest" if ns.from_dump else "finalize" if ns.finalize else "data", None
    if mode == "harvest":
        why = _not_for_harvest(ns, launcher_args, selection)
        if why:
            raise ExtractError(why)
        _at_least_one("--torch-threads", ns.torch_threads)
        owner = _owner(ns.hs_owner)
    elif mode == "finalize":
        if ns.format not in ("safetensors", "deepspec"):
            raise ExtractError("--finalize is for --format safetensors or deepspec (SpecForge reads rows_*/ as they "
                               "are: merge --shard outputs by copying their rows_* folders into one)")
    else:
        owner = _check_data_run(ns, launcher_args)
    return ExtractConfig(
        mode=mode,
        output=OutputSettings(os.path.abspath(ns.output), ns.format, save_dtype, gid, ns.resume, part_bytes),
        data=ns.data, max_samples=ns.max_samples, selection=selection,
        server=ServerSettings(ns.server.rstrip("/") if ns.server else None,
                              ns.mooncake if ns.transport == "mooncake" else ns.hs_dump_dir, owner,
                              tuple(launcher_args), ns.transport),
        requests=RequestSettings(ns.concurrency, ns.verify, ns.request_timeout, ns.regenerate, ns.max_new_tokens,
                                 ns.temperature, ns.top_p),
        harvest=HarvestSettings(ns.from_dump, ns.idle_timeout, ns.max_samples, owner) if ns.from_dump else None,
        torch_threads=ns.torch_threads, progress=not ns.no_progress), launcher_args


def _save_dtype(fmt: str, save_dtype: Optional[str]) -> Optional[str]:
    from sglang_hs.extract.fp8 import SAVE_DTYPES

    if save_dtype is not None and save_dtype not in SAVE_DTYPES:
        raise ExtractError(f"--save-dtype: {save_dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
    if fmt == "deepspec":
        if save_dtype == "fp8-per-layer":
            raise ExtractError("--save-dtype fp8-per-layer: --format deepspec stores FP8 unscaled (hidden_dtype "
                               "float8_e4m3fn or float8_e5m2: --save-dtype fp8 or fp8-e5m2), no per-layer scale")
        # DeepSpec's CacheDataset reads bf16 (hidden_dtype "bfloat16"), whatever the server's dtype
        return save_dtype or "bf16"
    if save_dtype == "fp8-e5m2":
        raise ExtractError(f"--save-dtype fp8-e5m2 needs --format deepspec (an unscaled e5m2 cast); --format {fmt} "
                           "takes bf16" + (", fp8 or fp8-per-layer" if fmt == "safetensors" else ""))
    if save_dtype in ("fp8", "fp8-per-layer") and fmt != "safetensors":
        raise ExtractError(f"--save-dtype {save_dtype} needs --format safetensors: SpecForge 0.2.0 reads "
                           f"--format {fmt} files with no FP8 scales (it would train on the unscaled values)")
    if fmt == "specforge" and save_dtype is None:
        # SpecForge 0.2.0's TargetHead is bf16 only (a float32 file fails its first step, "float != BFloat16")
        return "bf16"
    return save_dtype


def _not_for_harvest(ns, launcher_args: List[str], selection: Selection) -> Optional[str]:
    """Why these flags cannot go with --from-dump (one line), else None."""
    if launcher_args:
        return f"{launcher_args[0]}: --from-dump reads a running server's dump; it starts no server"
    if ns.transport != "ring" or ns.mooncake:
        return "--transport mooncake is for --data runs (a harvest across hosts: not yet)"
    for flag, given in (("--data", ns.data), ("--server", ns.server), ("--hs-dump-dir", ns.hs_dump_dir),
                        ("--regenerate", ns.regenerate), ("--verify", ns.verify),
                        ("--shard", selection.label != "0/1")):
        if given:
            return f"{flag} does not go with --from-dump: the records come from the server's live traffic"
    if ns.idle_timeout is not None and ns.idle_timeout <= 0:
        return f"--idle-timeout: seconds > 0, got {ns.idle_timeout}"
    if ns.max_samples is not None and ns.max_samples < 1:
        return f"--max-samples: must be >= 1 with --from-dump, got {ns.max_samples}"
    return None


def _check_data_run(ns, launcher_args: List[str]) -> Optional[int]:
    """The flags of a --data run checked; returns --hs-owner's uid."""
    if not ns.data:
        raise ExtractError("--data is required")
    _at_least_one("--concurrency", ns.concurrency)
    _at_least_one("--torch-threads", ns.torch_threads)
    if not 0.0 <= ns.verify <= 1.0:
        raise ExtractError(f"--verify: a fraction in [0, 1], got {ns.verify}")
    if ns.max_samples is not None and ns.max_samples < 0:
        raise ExtractError(f"--max-samples: must be >= 0, got {ns.max_samples}")
    if ns.server and launcher_args:
        raise ExtractError(f"{launcher_args[0]}: launcher flags need no --server (the server is already running)")
    if ns.transport not in ("ring", "mooncake"):
        raise ExtractError(f"--transport: expected ring or mooncake, got {ns.transport!r}")
    if ns.transport == "mooncake":
        from sglang_hs.extract.transport.mooncake import parse_address

        if not ns.mooncake:
            raise ExtractError("--transport mooncake needs --mooncake HOST:PORT: the serving node's python -m "
                               "sglang_hs.publish --listen address")
        try:
            parse_address(ns.mooncake, "--mooncake")
        except ValueError as e:
            raise ExtractError(str(e)) from None
        for flag, given in (("--hs-dump-dir", ns.hs_dump_dir), ("--hs-owner", ns.hs_owner)):
            if given:
                raise ExtractError(f"{flag} does not go with --transport mooncake: the dump dir is the serving node's, "
                                   "read there by its publisher")
        if not ns.server:
            raise ExtractError("--transport mooncake needs --server: the URL of the server on the other host")
    elif ns.mooncake:
        raise ExtractError("--mooncake needs --transport mooncake")
    if ns.server and not ns.hs_dump_dir and ns.transport != "mooncake":
        raise ExtractError("--server needs --hs-dump-dir: the dump dir that server captures into")
    if ns.hs_owner is not None and not ns.server:
        raise ExtractError("--hs-owner needs --server or --from-dump: a server this command starts runs as you")
    owner = _owner(ns.hs_owner)  # refused before --data is looked at
    if not os.path.exists(ns.data) and os.path.sep in ns.data:
        raise ExtractError(f"--data: {ns.data} does not exist")
    return owner


def _part_bytes(value: Optional[str]) -> int:
    """--part-mb in bytes (MiB, a number > 0; at most 1 TiB)."""
    if value is None:
        return PART_BYTES
    try:
        mib = float(value)
    except ValueError:
        mib = float("nan")
    if not 0 < mib <= 1 << 20 or int(mib * (1 << 20)) < 1:
        raise ExtractError(f"--part-mb: a size in MiB > 0 (at most 1048576), got {value!r}")
    return int(mib * (1 << 20))


def _at_least_one(flag: str, value: int) -> None:
    if value < 1:
        raise ExtractError(f"{flag}: must be >= 1, got {value}")


def _owner(name: Optional[str]) -> Optional[int]:
    """--hs-owner as a uid."""
    if name is None:
        return None
    from sglang_hs.fsutil import owner_uid

    try:
        return owner_uid(name)
    except ValueError:
        raise ExtractError(f"--hs-owner: no such user {name!r}") from None
