"""python -m sglang_hs.launch_server [--hs-* flags] [any SGLang flag]

SGLang 0.5.23's server with the sglang-hs overlay. The `--hs-*` flags are taken out of argv before
SGLang parses it and reach every process through environment variables (sglang_hs/envs.py); the rest
goes to SGLang unchanged (SGLang's --config YAML merged in as SGLang merges it: expand_config). Without
--model-path it serves the embedded tiny DeepSeek-V3. Without a CUDA device (or with --device cpu) it runs
SGLang's CPU engine. `--help` lists both sets of flags.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import List, Optional, Tuple

# argv.py holds them (the supervisor reads flags too); the names here stay as the launcher has always called them
from sglang_hs.tools.argv import flag_value as _flag_value, has_flag as _has_flag
from sglang_hs.server.capture_spec import (
    HC_ARCHITECTURES,
    STREAMS_CHOICES,
    TEXT_CONFIG_WRAPPERS,
    CaptureConfigError,
    LAST_CHOICES,
    CaptureSpec,
    check_architecture,
    hc_mult_of,
    last_choice,
    parse_layer_ids,
    v4_dspark_ids,
)
from sglang_hs.server import layer_source, speculative_capture

PROG = "python -m sglang_hs.launch_server"
_dump_dir_lock = None
CPU_DEFAULT_MAX_TOTAL_TOKENS = "4096"
CPU_DEFAULT_RING_SIZE = "256MiB"  # the CPU engine's models are small; /dev/shm is RAM
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _number(text: str) -> float:
    """A flag's number, NaN when it is none (every range check then fails, and its error names the flag)."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def parse_size(text: str, flag: str = "--hs-ring-size") -> int:
    """'8GiB' -> 8589934592; units k/M/G/T (decimal) and KiB/MiB/GiB/TiB (binary)."""
    m = _SIZE.match(text or "")
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise CaptureConfigError(f"{flag}: {text!r} is not a size; write e.g. 8GiB, 512MiB or 1000000000")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise CaptureConfigError(f"{flag}: must be more than 0 bytes, got {text!r}")
    return n


def add_hs_args(parser: argparse.ArgumentParser) -> None:
    from sglang_hs import envs

    g = parser.add_argument_group(
        "sglang-hs (hidden-state capture)",
        "Layer id i = residual stream entering decoder layer i = HF output_hidden_states[i].",
    )
    g.add_argument("--hs-dump-dir", default=None, metavar="DIR",
                   help="capture hidden states into this folder (e.g. /dev/shm/hs); default: plain serving")
    g.add_argument("--hs-layers", default=None, metavar="IDS",
                   help="comma-separated, strictly increasing layer ids 0 <= i < n (DeepSeek-V4: 0 < i <= n; default: the "
                        "layers the checkpoint's drafter reads, dspark_target_layer_ids / eagle_aux_hidden_state_"
                        "layer_ids in the draft's config, else the target's, else 2,n//2,n-3)")
    g.add_argument("--hs-last", nargs="?", const="post-norm", default=None, metavar="|".join(LAST_CHOICES),
                   help="also capture the final hidden state: post-norm (a bare --hs-last; HF "
                        "output_hidden_states[n], what SpecForge trains on), pre-norm (the final residual stream "
                        "before the final norm, what speculators trains on: it applies the norm itself) or both "
                        "(one more row per token)")
    g.add_argument("--hs-hc-streams", default=None, choices=STREAMS_CHOICES,
                   help="DeepSeek-V4 (hc_mult residual streams per token): mean (default; one row per layer, the "
                        "streams' mean, what SGLang's DSpark/EAGLE drafters for V4 are served on) or full (hc_mult "
                        "rows per layer, stream s = HF output_hidden_states[i][..., s, :])")
    g.add_argument("--hs-ring-size", default=None, metavar="SIZE",
                   help="bytes of the output ring of finished records per writer, e.g. 8GiB "
                        f"(default {envs.DEFAULT_RING_BYTES >> 30}GiB; {CPU_DEFAULT_RING_SIZE} in CPU mode; grown to hold "
                        "one record at the maximal context, or of --hs-max-record-tokens)")
    g.add_argument("--hs-max-record-tokens", type=int, default=None, metavar="N",
                   help="the ring need only hold records of N tokens (prompt + max_new_tokens), not one at the "
                        "server's maximal context: a request whose record can never fit the ring is refused with a "
                        "400 naming the limit (with --hs-when-behind skip: served without capture, marker oversized); "
                        "admission counts a request without max_new_tokens at the whole context (default: the "
                        "context length)")
    g.add_argument("--hs-record-part-size", default=None, metavar="SIZE",
                   help="a record of more row bytes than SIZE (e.g. 256MiB) leaves the output ring in parts, each as "
                        "soon as the ring has room, the request's KV slots held until its last part is gathered: the "
                        "ring need hold only a part, not a whole long sample (then sized for that). Needs attention TP "
                        "1 (--tp 1, or --attn-dp-size equal to --tp) (default: every record whole)")
    g.add_argument("--hs-admission-timeout", type=float, default=None, metavar="SECONDS",
                   help="fail a request held this long because the output ring is full (the reader is behind) "
                        f"instead of holding it forever; 0 = no limit (default {envs.DEFAULT_ADMISSION_TIMEOUT_S:g})")
    g.add_argument("--hs-capture", default=None, metavar="all|opt-in",
                   help="which requests are captured: all (default), or opt-in: only requests whose sampling params "
                        "(OpenAI: the request) carry custom_params {\"hs_capture\": true}, plus the "
                        "--hs-capture-sample share of the others")
    g.add_argument("--hs-capture-sample", default=None, metavar="P",
                   help="capture a fraction 0 < P <= 1 of the requests (not opted in), chosen by a hash of the "
                        "request id keyed with a secret drawn at start (--hs-capture-sample-key), so no client "
                        "can pick a request id that is sampled")
    g.add_argument("--hs-capture-sample-key", default=None, metavar="HEX",
                   help="the key of --hs-capture-sample's hash, 1 to 64 bytes in hex, to sample the same request "
                        "ids across runs (default: drawn at random at start)")
    g.add_argument("--hs-capture-accept-below", default=None, metavar="L",
                   help="on a speculative server, keep only the captured requests its draft did poorly on: those "
                        "whose accept length (SGLang's spec_accept_length, tokens per verify step) is below L > 1; "
                        "the others leave a marker, reason draft_accepted (opted-in requests are always kept)")
    g.add_argument("--hs-capture-accept-lowest", default=None, metavar="F",
                   help="on a speculative server, keep only the captured requests whose accept length is in the "
                        "lowest fraction 0 < F < 1 of recent traffic (the last --hs-capture-accept-window finished "
                        "requests, ties kept together); the others leave a marker, reason draft_accepted")
    g.add_argument("--hs-capture-confidence-below", default=None, metavar="C",
                   help="on a DSPARK server whose draft has a confidence head (SGLANG_RAGGED_VERIFY_MODE cap-accept), "
                        "keep only the captured requests the draft was unsure of: those whose mean draft confidence "
                        "is below 0 < C <= 1; the others leave a marker, reason draft_accepted")
    g.add_argument("--hs-capture-accept-window", default=None, metavar="N", type=int,
                   help="the recent traffic of --hs-capture-accept-lowest, in finished requests (default 1000)")
    g.add_argument("--hs-capture-max-bytes", default=None, metavar="SIZE",
                   help="capture at most SIZE bytes of records (e.g. 100GiB; each captured request is charged its "
                        "worst-case record as it is admitted); past it, requests are served without capture, "
                        "counted as over_budget (default: no limit)")
    g.add_argument("--hs-when-behind", default=None, metavar="hold|skip",
                   help="when the output ring has no room for a new request's record (the reader is behind): hold "
                        "the request (default; --hs-admission-timeout), or skip: serve it without capture")
    g.add_argument("--hs-copy", default=None, choices=envs.COPY_STRATEGIES,
                   help="how captured rows reach the host store: direct (the copy kernel writes registered, mapped "
                        "host memory inside the forward), staging (a device buffer, copied out on a copy stream after "
                        "each step and scattered on the host) or deferred (CUDA: the same device buffer, written into "
                        "the mapped store by the copy kernel on the copy stream); all exact (default direct; "
                        "docs/gpu.md compares them)")
    g.add_argument("--hs-staging-rows", type=int, default=None, metavar="N",
                   help="rows of the --hs-copy staging/deferred buffers (2 on the device; staging: 2 pinned on the "
                        "host too); larger "
                        "steps are shipped in chunks; CUDA graphs must fit (default: max(--chunked-prefill-size, "
                        "--max-running-requests))")
    g.add_argument("--hs-scatter-threads", type=int, default=None, metavar="N",
                   help="threads of --hs-copy staging's scatter from the pinned host buffer into the store, off "
                        "the scheduler thread (one per 8 MiB of a step's rows at most; default "
                        f"{envs.DEFAULT_SCATTER_THREADS})")
    g.add_argument("--hs-gather-threads", type=int, default=None, metavar="N",
                   help="threads that copy one finished record's rows from the store into the output ring, off the "
                        "scheduler thread (one per 8 MiB of rows at most; default "
                        f"{envs.DEFAULT_GATHER_THREADS})")
    g.add_argument("--hs-share-group", default=None, metavar="GROUP",
                   help="let readers running as other users of GROUP read the dump (folder 0750, manifest 0640, "
                        "rings 0640 and their offset files 0660, of GROUP; the store stays 0600); they pass "
                        "owner=<this user> to HiddenStateReader (default: everything 0600/0700, this user only)")
    g.add_argument("--hs-startup-timeout", type=float, default=None, metavar="SECONDS",
                   help="give up when start-up shows no progress for this long "
                        f"(default {envs.DEFAULT_STARTUP_TIMEOUT_S:g})")


def selection_env(ns: argparse.Namespace) -> dict:
    """The settings of --hs-capture, --hs-capture-sample and --hs-when-behind, checked (one-line errors)."""
    from sglang_hs import envs

    env = {}
    if ns.hs_capture is not None:
        if ns.hs_capture not in envs.CAPTURE_MODES:
            raise CaptureConfigError(f"--hs-capture: all or opt-in, got {ns.hs_capture!r}")
        env["SGLANG_HS_CAPTURE"] = ns.hs_capture
    if ns.hs_capture_sample is not None:
        p = _number(ns.hs_capture_sample)
        if not 0 < p <= 1:
            raise CaptureConfigError(f"--hs-capture-sample: a fraction 0 < P <= 1 of the requests, got "
                                     f"{ns.hs_capture_sample!r}")
        env["SGLANG_HS_CAPTURE_SAMPLE"] = repr(p)
    if ns.hs_capture_sample_key is not None:
        try:
            key = bytes.fromhex(ns.hs_capture_sample_key)
        except ValueError:
            key = b""
        if not 1 <= len(key) <= 64:
            raise CaptureConfigError(f"--hs-capture-sample-key: 1 to 64 bytes in hex, got {ns.hs_capture_sample_key!r}")
        env["SGLANG_HS_CAPTURE_SAMPLE_KEY"] = key.hex()
    if ns.hs_capture_accept_below is not None:
        below = _number(ns.hs_capture_accept_below)
        if not below > 1 or below == float("inf"):
            raise CaptureConfigError(f"--hs-capture-accept-below: an accept length L > 1 (tokens per verify step; "
                                     f"every step gives at least 1), got {ns.hs_capture_accept_below!r}")
        env["SGLANG_HS_CAPTURE_ACCEPT_BELOW"] = repr(below)
    if ns.hs_capture_accept_lowest is not None:
        if ns.hs_capture_accept_below is not None:
            raise CaptureConfigError("--hs-capture-accept-lowest and --hs-capture-accept-below: one policy at a time "
                                     "(a fraction of recent traffic, or a fixed accept length)")
        lowest = _number(ns.hs_capture_accept_lowest)
        if not 0 < lowest < 1:
            raise CaptureConfigError(f"--hs-capture-accept-lowest: a fraction 0 < F < 1 of recent traffic, got "
                                     f"{ns.hs_capture_accept_lowest!r}")
        env["SGLANG_HS_CAPTURE_ACCEPT_LOWEST"] = repr(lowest)
    if ns.hs_capture_confidence_below is not None:
        if ns.hs_capture_accept_below is not None or ns.hs_capture_accept_lowest is not None:
            raise CaptureConfigError("--hs-capture-confidence-below and --hs-capture-accept-below/-lowest: one policy "
                                     "at a time")
        conf = _number(ns.hs_capture_confidence_below)
        if not 0 < conf <= 1:
            raise CaptureConfigError(f"--hs-capture-confidence-below: a mean draft confidence 0 < C <= 1, got "
                                     f"{ns.hs_capture_confidence_below!r}")
        env["SGLANG_HS_CAPTURE_CONFIDENCE_BELOW"] = repr(conf)
    if ns.hs_capture_accept_window is not None:
        if ns.hs_capture_accept_lowest is None:
            raise CaptureConfigError("--hs-capture-accept-window sizes --hs-capture-accept-lowest's recent traffic: "
                                     "give that too")
        if ns.hs_capture_accept_window < 1:
            raise CaptureConfigError(f"--hs-capture-accept-window: at least 1 finished request, got "
                                     f"{ns.hs_capture_accept_window}")
        env["SGLANG_HS_CAPTURE_ACCEPT_WINDOW"] = str(ns.hs_capture_accept_window)
    if ns.hs_capture_max_bytes is not None:
        env["SGLANG_HS_CAPTURE_MAX_BYTES"] = str(parse_size(ns.hs_capture_max_bytes, "--hs-capture-max-bytes"))
    if ns.hs_when_behind is not None:
        if ns.hs_when_behind not in envs.WHEN_BEHIND:
            raise CaptureConfigError(f"--hs-when-behind: hold or skip, got {ns.hs_when_behind!r}")
        env["SGLANG_HS_WHEN_BEHIND"] = ns.hs_when_behind
    return env


def split_argv(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    """Take the --hs-* flags out of argv; refuse unknown ones (SGLang would only say 'unrecognized')."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_hs_args(parser)
    ns, rest = parser.parse_known_args(argv)
    unknown = [a.split("=", 1)[0] for a in rest if a.startswith("--hs-") or a.startswith("--hs_")]
    if unknown:
        known = ", ".join(sorted(a for act in parser._actions for a in act.option_strings))
        raise CaptureConfigError(f"unknown sglang-hs flag {unknown[0]}; the sglang-hs flags are {known}")
    return ns, rest


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    add_hs_args(parser)
    ServerArgs.add_cli_args(parser)
    parser.print_help()


# What a process needs to reach a GPU through torch.cuda: NVIDIA's device nodes or driver (Jetson's nvgpu nodes),
# WSL2's GPU paravirtualisation, or (a ROCm build of torch) AMD's compute node; and a GPU driver library torch could
# load (a driver whose module is loaded only at the first cuInit has the library but no node yet). With none of them
# there is no device, and the launcher need not import torch to learn it (~1.5 s of every CPU-mode start).
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/nvhost-ctrl", "/dev/nvgpu", "/dev/dxg",
             "/dev/kfd")
GPU_DRIVER_LIBS = ("cuda", "amdhip64")  # libcuda.so.1 (NVIDIA's driver API), libamdhip64.so (ROCm)


def no_gpu_driver() -> bool:
    """True when this machine has no GPU node and no GPU driver library: no device torch could reach."""
    import ctypes.util

    return not any(os.path.exists(p) for p in GPU_NODES) and not any(
        ctypes.util.find_library(lib) for lib in GPU_DRIVER_LIBS)


def cuda_available() -> bool:
    if no_gpu_driver():
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install means: no CUDA device for us
        return False


def read_model_config(model_path: str, trust_remote_code: bool) -> dict:
    local = os.path.join(model_path, "config.json")
    if not os.path.isfile(local) and os.path.isfile(os.path.join(model_path, "params.json")):
        # Mistral's native format (Mistral Large 3): read it with SGLang's own parser, as the server will.
        from sglang.srt.utils.hf_transformers.mistral_utils import MistralConfigParser

        try:
            return MistralConfigParser().parse(model_path)[0]
        except (OSError, ValueError, KeyError, AssertionError) as e:
            raise CaptureConfigError(f"--model-path: cannot read {model_path}/params.json: {e}") from None
    if os.path.isfile(local):
        try:
            with open(local) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise CaptureConfigError(f"--model-path: cannot read {local}: {e}") from None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()


def fs_type(path: str) -> str:
    """File-system type of the mount holding `path` (from /proc/self/mounts), '' if unknown."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def check_sglang_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    from sglang_hs.version import SGLANG_VERSION, __version__

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = "none"
    if found != SGLANG_VERSION:
        raise CaptureConfigError(f"sglang-hs {__version__} runs on sglang {SGLANG_VERSION} only, found sglang "
                                 f"{found}: pip install sglang=={SGLANG_VERSION}")


def _human(nbytes: int, up: bool = False) -> str:
    """Bytes in GiB or MiB; `up` rounds up, for a minimum ("at least 1.1MiB", never a too-small 1.0MiB)."""
    unit, name, digits = (2**30, "GiB", 2) if nbytes >= 2**30 else (2**20, "MiB", 1)
    value = nbytes / unit
    if up:
        value = math.ceil(value * 10**digits) / 10**digits
    return f"{value:.{digits}f}{name}"


def record_part_bytes(value: Optional[str], argv: List[str]) -> int:
    """--hs-record-part-size in bytes (0: not given). Refused in one line where a writer's attention group has more
    than one rank: holding a finished request's KV slots on the writer alone would make the ranks' allocators
    diverge (sglang_hs/server/patches/hold_finished_kv.py)."""
    if value is None:
        return 0
    from sglang_hs import envs

    part = parse_size(value, "--hs-record-part-size")
    for flag, why in (("--enable-streaming-session", "SGLang keeps a streaming session's KV row for its next turn, "
                       "so it cannot be held while a record in parts is gathered"),
                      ("--enable-memory-saver", "release_memory_occupation needs the scheduler idle, which it is "
                       "not while finished requests' KV is held")):
        if _has_flag(argv, flag):
            raise CaptureConfigError(f"--hs-record-part-size with {flag}: {why}; drop one of them")
    if envs.SGLANG_HS_SYNC_FINISH:
        raise CaptureConfigError("--hs-record-part-size with SGLANG_HS_SYNC_FINISH=1: records in parts are published "
                                 "by the finish worker; unset SGLANG_HS_SYNC_FINISH")
    try:
        sizes = parallel_sizes(argv)
        tp, dp = int(sizes[0]), int(sizes[2])
    except ValueError:  # SGLang's parser refuses it with its own message
        return part
    if tp // max(dp, 1) > 1:
        raise CaptureConfigError(f"--hs-record-part-size with --tp {tp}" + (f" and {dp} attention DP groups" if dp > 1
                                                                             else "") +
                                 f": attention TP {tp // max(dp, 1)}; records in parts need attention TP 1 (--tp 1, "
                                 "or --attn-dp-size equal to --tp): holding a request's KV slots on one rank of its "
                                 "attention group is not built")
    return part


def check_ring_size(ring: int, explicit: bool, spec: CaptureSpec, config: dict, argv: List[str],
                    dump_dir: str, max_record_tokens: Optional[int] = None, part_bytes: int = 0) -> int:
    """The output ring must hold one record at the server's maximal context length, or of `max_record_tokens`
    (--hs-max-record-tokens) when that is fewer (twice: admission reserves room to wrap), and fit the dump
    dir's filesystem. A default ring grows to that; a size the user gave is refused, naming the flags. With
    records in parts (`part_bytes`, --hs-record-part-size) one part of such a record (all its token ids) will do."""
    from sglang_hs.server.store.admission import ring_floor

    ctx = _flag_value(argv, "--context-length") or config.get("max_position_embeddings")
    dtype = str(_flag_value(argv, "--dtype") or config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    elem = 4 if dtype in ("float32", "float") else 2
    P = spec.rows_per_token
    if part_bytes and part_bytes < P * spec.hidden_size * elem:
        raise CaptureConfigError(f"--hs-record-part-size: {part_bytes} bytes is less than one token's rows ({P} x "
                                 f"{spec.hidden_size} x {elem} = {P * spec.hidden_size * elem} bytes); give at least "
                                 "that (e.g. 256MiB)")
    capped = max_record_tokens is not None and (not ctx or max_record_tokens < int(ctx))
    tokens = max_record_tokens if capped else ctx
    if tokens:  # a speculative server's records also hold each verify step's accepted drafts
        need = ring_floor(int(tokens), P, spec.hidden_size, elem, bool(_flag_value(argv, "--speculative-algorithm")),
                          part_bytes=part_bytes)
        what, lower = (("of --hs-max-record-tokens", "--hs-max-record-tokens") if capped else
                       ("at the server's maximal context length", "--context-length (or cap records with "
                                                                  "--hs-max-record-tokens)"))
        if ring < need and explicit:
            raise CaptureConfigError(
                f"--hs-ring-size: {ring} bytes cannot hold one record {what} ({int(tokens)} tokens x {P} x "
                f"{spec.hidden_size} x {elem} bytes, twice to wrap: {need} bytes); raise it to at least "
                f"{_human(need, up=True)} or lower {lower}")
        if ring < need:
            print(f"[sglang-hs] output ring: {_human(need)} (room for one record {what}, {int(tokens)} tokens; set "
                  "--hs-ring-size for more)", file=sys.stderr)
            ring = need
        if capped:
            print(f"[sglang-hs] records of at most ~{tokens} tokens (--hs-max-record-tokens; the context is "
                  f"{ctx or 'unknown'}): a request whose record can never fit the ring is refused with a 400 "
                  "(--hs-when-behind skip: served without capture)", file=sys.stderr)
    st = os.statvfs(dump_dir)
    free = st.f_bavail * st.f_frsize
    if ring > free:
        raise CaptureConfigError(f"--hs-ring-size: {_human(ring)} does not fit the {_human(free)} free "
                                 f"in {dump_dir}'s filesystem (and the store needs room too); lower --hs-ring-size or "
                                 "--context-length, or give the filesystem more room (docker: --shm-size)")
    return ring


def cpu_threads_bind(argv: List[str]) -> Optional[str]:
    """SGLANG_CPU_OMP_THREADS_BIND for the CPU engine ("0|1": rank i's cores), or None where SGLang's
    default (one NUMA node per rank) fits: with more ranks than NUMA nodes, this process's cores split
    into one contiguous group per rank (ranks share cores when there are fewer cores than ranks)."""
    def size(*flags):
        return int(_flag_value(argv, *flags) or 1)

    ranks = size("--tp-size", "--tp") * size("--pp-size", "--pp")
    if not _has_flag(argv, "--enable-dp-attention"):
        ranks *= size("--dp-size", "--dp")
    nodes = len([d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)]) \
        if os.path.isdir("/sys/devices/system/node") else 1
    if ranks <= max(nodes, 1):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return "|".join(str(cores[i % len(cores)]) for i in range(ranks))
    groups = [cores[i * len(cores) // ranks:(i + 1) * len(cores) // ranks] for i in range(ranks)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1
                    else ",".join(map(str, g)) for g in groups)


def cpu_omp_wait_policy(env) -> str:
    """Give the CPU engine envs.CPU_OMP_WAIT_POLICY unless the environment sets OMP_WAIT_POLICY (an empty
    value asks for libgomp's default and is removed: libgomp would warn about it); returns what was chosen
    and by whom, for the CPU-mode line the launcher prints."""
    from sglang_hs import envs

    given = env.get("OMP_WAIT_POLICY")
    if given is None:
        env["OMP_WAIT_POLICY"] = envs.CPU_OMP_WAIT_POLICY
        return (f"OMP_WAIT_POLICY={envs.CPU_OMP_WAIT_POLICY} (set by sglang-hs: libgomp's spin-wait slows decode "
                "on shared cores; OMP_WAIT_POLICY= keeps libgomp's default)")
    if not given.strip():
        del env["OMP_WAIT_POLICY"]
        return "OMP_WAIT_POLICY unset (empty in the environment: libgomp's default spin-wait)"
    return f"OMP_WAIT_POLICY={given} (from the environment)"


def text_only(argv: List[str]) -> List[str]:
    """Serve a vision-language wrapper as text only: `language_model_only` in the model config (through
    --json-model-override-args, merged with the user's). SGLang then builds no multimodal processor
    (Kimi-K2.5's is remote code) and treats the model as text-only (model_config.py: is_lm_only);
    its --language-model-only flag would do the same but refuses KimiK25ForConditionalGeneration
    (srt/arg_groups/model_hook.py, handle_language_model_only)."""
    flag = "--json-model-override-args"
    given = _flag_value(argv, flag)
    try:
        overrides = json.loads(given) if given else {}
    except ValueError as e:
        raise CaptureConfigError(f"{flag}: not JSON ({e})") from None
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out + [flag, json.dumps(dict(overrides, language_model_only=True))]


def v4_on_cpu(arch: str, config: Optional[dict] = None) -> Optional[str]:
    """Why this hyper-connection model (DeepSeek-V4) does not serve on the CPU engine, in one line; None when it
    does: a config whose layers are sliding-window, compressed sparse or heavily compressed (compress_ratios 0 / 4 /
    128), which the CPU-engine patches serve (sglang_hs/server/patches/dsv4_*.py) and tests/e2e/test_v4_cpu.py judges row by row
    against HF float32."""
    config = config or {}
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        return (f"{arch} with quantization_config ({method}) on the CPU engine: sglang-hs's V4 CPU patches read "
                "unquantized weights only (a quantized one would be read without its scales); serve a bf16/float32 "
                "checkpoint, or capture it on a GPU")
    ratios = config.get("compress_ratios")
    if ratios and set(ratios) <= {0, 4, 128}:
        return None
    return (f"{arch}: SGLang 0.5.23 serves DeepSeek-V4 on CUDA only, and sglang-hs's CPU-engine patches serve only "
            "compress_ratios 0, 4 and 128 (sliding-window, CSA, HCA layers); this config has other ratios (V4.1's 1 "
            "and 2) or no compress_ratios: capture it on a GPU")


def runs_on_cpu(sg_argv: List[str]) -> bool:
    """Whether the server runs SGLang's CPU engine: --device cpu, or no --device and no CUDA device."""
    device = _flag_value(sg_argv, "--device")
    return device == "cpu" or (device is None and not cuda_available())


def layers_source(ns: argparse.Namespace, sg_argv: List[str], model_path: str, raw_config: dict,
                  config: dict) -> dict:
    """Where the captured layers come from (the manifest's `layer_source`): --hs-layers, else the drafter ids the
    draft's or the target's config names (sglang_hs/server/layer_source.py), else the EAGLE-3 default."""
    if ns.hs_layers is not None:
        return layer_source.describe_default(True)
    draft_path = _flag_value(sg_argv, "--speculative-draft-model-path", "--speculative-draft-model")
    draft = None
    # EAGLE3 and DSPARK are the algorithms served with capture whose draft reads target layers of its choice (the
    # served draft's ids come first: a capture for its next version defaults to them; DFLASH is refused with
    # capture; an MTP draft is the target itself; NGRAM has none)
    if draft_path and str(_flag_value(sg_argv, "--speculative-algorithm") or "").upper() in ("EAGLE3", "DSPARK"):
        draft = layer_source.read_draft_config(draft_path, _flag_value(sg_argv, "--speculative-draft-model-revision"))
    else:
        draft_path = None
    target = dict(raw_config, **config) if config is not raw_config else raw_config  # a wrapper's text_config too
    found = layer_source.checkpoint_layers(target, layer_source.config_where(model_path), draft,
                                           layer_source.config_where(draft_path) if draft_path else None)
    return found or layer_source.describe_default(False)


def parallel_sizes(argv: List[str]) -> Tuple[str, str, str]:
    """(--tp, --dp, attention DP groups) as spelled ("1" where not given): attention DP groups from --attn-dp-size
    (--attention-data-parallel-size, SGLang 0.5.23's spelling), or --dp with --enable-dp-attention."""
    tp = _flag_value(argv, "--tp-size", "--tp", "--tensor-parallel-size") or "1"
    dp = _flag_value(argv, "--dp-size", "--dp", "--data-parallel-size") or "1"
    attn = _flag_value(argv, "--attn-dp-size", "--attention-data-parallel-size") or (
        dp if _has_flag(argv, "--enable-dp-attention") else "1")
    return tp, dp, attn


def patch_settings(sg_argv: List[str]) -> dict:
    """The settings (envs.py) that tell the server's processes which of the patches only some servers need to apply
    (sglang_hs/server/patches NEEDED_WHEN): its --speculative-algorithm, and whether SGLang runs a DP controller:
    with more than one DP rank, or as an elastic-EP scale joiner (`--elastic-ep-join-mode scale`, at any DP size;
    SGLang's `use_dp_controller`, entrypoints/engine.py)."""
    settings = {}
    algorithm = _flag_value(sg_argv, "--speculative-algorithm")
    if algorithm:
        settings["SGLANG_HS_SPECULATIVE_ALGORITHM"] = algorithm.upper()
    _, dp, attn = parallel_sizes(sg_argv)
    if ((speculative_capture.count(dp), speculative_capture.count(attn)) != (1, 1)
            or _flag_value(sg_argv, "--elastic-ep-join-mode") == "scale"):
        settings["SGLANG_HS_DP_CONTROLLER"] = "1"
    return settings


def speculative_setting(arch: str, algorithm: str, sg_argv: List[str], cpu: bool,
                        model_path: str) -> speculative_capture.SpeculativeSetting:
    """The speculative setting the command line gives (each size as spelled; one not given is None, so SGLang's
    defaults never pick a setting the rule has not seen)."""
    count = speculative_capture.count
    tp, dp, attn = parallel_sizes(sg_argv)
    steps, topk, tokens = (count(_flag_value(sg_argv, flag)) for flag in speculative_capture.V4_SPECULATIVE)
    return speculative_capture.SpeculativeSetting(
        algorithm=algorithm, arch=arch, cpu=cpu, model_path=model_path,
        draft_path=_flag_value(sg_argv, "--speculative-draft-model-path", "--speculative-draft-model"),
        tp=count(tp), dp=count(dp), attn_dp=count(attn),
        variant=next((flag for flag, _ in speculative_capture.SPECULATIVE_VARIANTS if _has_flag(sg_argv, flag)), None),
        steps=steps, topk=topk, tokens=tokens)


def speculative_refusal(arch: str, algorithm: str, sg_argv: List[str], cpu: bool, model_path: str) -> str:
    """The one line refusing --speculative-algorithm for this architecture with capture, or "" where it is served
    (sglang_hs/server/speculative_capture.py refusal; the server checks SGLang's resolved arguments again)."""
    return speculative_capture.refusal(speculative_setting(arch, algorithm, sg_argv, cpu, model_path))


def resolve_capture(ns: argparse.Namespace, sg_argv: List[str], model_path: str, cpu: bool,
                    v4_hint: str = "") -> Tuple[str, dict, CaptureSpec]:
    """The model's architecture, its (language model's) config and the capture the --hs-* flags give for it,
    checked in one line (CaptureConfigError): the architecture, the layer ids and --hs-last/--hs-hc-streams
    against that config, and DeepSeek-V4 refused on the CPU engine (`cpu`; `v4_hint` ends that line) where the
    CPU-engine patches do not serve it (v4_on_cpu). The launcher and the self-test."""
    config = raw_config = read_model_config(model_path, _has_flag(sg_argv, "--trust-remote-code"))
    arch = check_architecture(config.get("architectures"), where=f"{model_path}/config.json", config=config)
    if arch in TEXT_CONFIG_WRAPPERS:  # Kimi-K2.5: its language model's config
        config = config["text_config"]
    algorithm = _flag_value(sg_argv, "--speculative-algorithm")
    refusal = algorithm and speculative_refusal(arch, algorithm, sg_argv, cpu, model_path)
    if refusal:  # before a draft's config is read for its layers
        raise CaptureConfigError(refusal)
    source = layers_source(ns, sg_argv, model_path, raw_config, config)
    ids = parse_layer_ids(ns.hs_layers) if ns.hs_layers is not None else source.get("layers")
    try:
        spec = CaptureSpec.resolve(ids, ns.hs_last, config["num_hidden_layers"], config["hidden_size"],
                                   hc_mult=hc_mult_of(config), streams=ns.hs_hc_streams, source=source)
        if arch in HC_ARCHITECTURES:
            v4_dspark_ids(spec, bool(config.get("hc_pre_from_prev_sublayer", False)))
    except CaptureConfigError as e:
        if not source.get("key") or not str(e).startswith("--hs-layers: "):  # not the ids' fault: as it is
            raise
        raise CaptureConfigError(f"{source['key']} {source['ids']} in {source['from']} (our ids {source['layers']}): "
                                 f"{str(e).replace('--hs-layers: ', '')}; pass --hs-layers") from None
    if arch in HC_ARCHITECTURES and cpu and v4_on_cpu(arch, config):
        raise CaptureConfigError(v4_on_cpu(arch, config) + v4_hint)
    if arch in HC_ARCHITECTURES and cpu:
        from sglang_hs.server.patches.dsv4_cpu_tp import tp_refusal  # imports no sglang

        tp = _flag_value(sg_argv, "--tp-size", "--tp", "--tensor-parallel-size")
        dp = _flag_value(sg_argv, "--dp-size", "--dp", "--data-parallel-size") or "1"
        dp_attention = _has_flag(sg_argv, "--enable-dp-attention")
        if dp != "1" and not dp_attention:
            raise CaptureConfigError(f"--dp {dp} with {arch} on the CPU engine: sglang-hs's V4 CPU patches serve "
                                     "data parallel as DP attention only (--tp N --dp M --enable-dp-attention)")
        if dp_attention and dp != (tp or "1"):  # attention TP 1 per group, the one DP layout run (test_v4_cpu.py)
            raise CaptureConfigError(f"--dp {dp} with --tp {tp or 1} and --enable-dp-attention, {arch} on the CPU "
                                     "engine: sglang-hs's V4 CPU patches serve DP attention with --dp equal to --tp "
                                     "(one rank per attention group); attention tensor parallel inside a group is "
                                     "untested there")
        ep = _flag_value(sg_argv, "--ep-size", "--ep", "--expert-parallel-size")
        if ep is not None and str(ep) != "1":
            raise CaptureConfigError(f"--ep-size {ep} with {arch} on the CPU engine: sglang-hs's V4 CPU patches serve "
                                     "its experts tensor parallel only (expert parallel with V4's hash-routed layers "
                                     "is untested there); drop it")
        if tp and tp.isdigit() and dp.isdigit() and int(tp) > 1:  # the query heads and wo_a's groups split over
            attn_tp = max(1, int(tp) // int(dp)) if dp_attention else int(tp)  # each attention-TP group's ranks
            why = attn_tp > 1 and tp_refusal(config.get("num_attention_heads", 1), config.get("o_groups", 1), attn_tp)
            if why:
                raise CaptureConfigError(f"--tp {tp} with {arch} on the CPU engine: {why}")
        for flag in ("--attn-dp-size", "--attention-data-parallel-size", "--attn-cp-size",
                     "--attention-context-parallel-size", "--pp-size", "--pipeline-parallel-size"):
            value = _flag_value(sg_argv, flag)
            if value is not None and str(value) != "1":
                raise CaptureConfigError(f"{flag} {value} with {arch} on the CPU engine: sglang-hs's V4 CPU patches "
                                         "serve tensor parallel (--tp) and DP attention (--dp --enable-dp-attention) "
                                         "only; drop it")
    for flag, value in (("--hs-capture-accept-below", ns.hs_capture_accept_below),
                        ("--hs-capture-accept-lowest", ns.hs_capture_accept_lowest)):
        if value is not None and (not algorithm or _has_flag(sg_argv, "--enable-return-aux-hidden-states")):
            raise CaptureConfigError(f"{flag} selects on the draft's accept length: it needs a server that decodes "
                                     "speculatively (--speculative-algorithm with a draft)")
    if ns.hs_capture_confidence_below is not None:
        mode = os.environ.get("SGLANG_RAGGED_VERIFY_MODE", "static") or "static"
        if str(algorithm or "").upper() != "DSPARK" or mode == "static":
            raise CaptureConfigError("--hs-capture-confidence-below selects on the DSpark draft's confidence head: it "
                                     "needs --speculative-algorithm DSPARK with SGLANG_RAGGED_VERIFY_MODE=cap-accept "
                                     f"(SGLang builds no head under static; got {algorithm or 'no draft'}, {mode})")
    return arch, config, spec


def node_without_writers(argv: List[str]) -> Optional[dict]:
    """What fsutil.NO_WRITER says when this node of a multi-node server (SGLang --nnodes) hosts no writer (a
    writer is the attention-TP rank 0 of each DP attention group: capture_spec.node_dp_ranks), else None."""
    from sglang_hs.server.capture_spec import node_dp_ranks

    try:
        nnodes = int(_flag_value(argv, "--nnodes") or 1)
        node = int(_flag_value(argv, "--node-rank") or 0)
        tp = int(_flag_value(argv, "--tp-size", "--tp") or 1)
        dp = int(_flag_value(argv, "--dp-size", "--dp") or 1) if _has_flag(argv, "--enable-dp-attention") else 1
    except ValueError:  # SGLang's parser refuses it with its own message
        return None
    if nnodes <= 1 or node_dp_ranks(tp, dp, nnodes, node):
        return None
    layout = f"--tp {tp}" + (f" --dp {dp} --enable-dp-attention" if dp > 1 else "") + f" over {nnodes} nodes"
    return {"nnodes": nnodes, "node_rank": node, "layout": layout,
            "writer_nodes": [n for n in range(nnodes) if node_dp_ranks(tp, dp, nnodes, n)]}


def mark_node_writers(dump_dir: str, argv: List[str], share_gid: Optional[int]) -> None:
    """In the dump dir of a node without writers, fsutil.NO_WRITER (readers there fail at once, naming the nodes
    whose dumps get the records, instead of waiting for a manifest that never comes); elsewhere a stale one
    of an earlier server goes."""
    from sglang_hs import fsutil

    marker = node_without_writers(argv)
    if marker is None:
        try:
            os.unlink(os.path.join(dump_dir, fsutil.NO_WRITER))
        except FileNotFoundError:
            pass
        return
    fsutil.write_private_file(dump_dir, fsutil.NO_WRITER, json.dumps(marker, indent=1).encode(), share_gid)
    nodes = ", ".join(map(str, marker["writer_nodes"]))
    print(f"[sglang-hs] node {marker['node_rank']} of {marker['nnodes']} hosts no writer ({marker['layout']}): the "
          f"records land in node {nodes}'s dump; {dump_dir}/{fsutil.NO_WRITER} says so to readers here",
          file=sys.stderr, flush=True)


def expand_config(sg_argv: List[str]) -> List[str]:
    """SGLang's --config YAML merged into the command line as SGLang merges it (its ConfigArgumentMerger: the file's
    settings first, the command line's after them and winning), so the launcher checks and sets up the server SGLang
    will run; SGLang then gets the merged command line. Without --config, sg_argv as it is (and SGLang not loaded)."""
    if "--config" not in sg_argv:
        return sg_argv
    import yaml
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser(prog=PROG)
    ServerArgs.add_cli_args(parser)
    try:
        merged = ConfigArgumentMerger(parser).merge_config_with_args(sg_argv)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise CaptureConfigError(f"--config: {' '.join(str(e).split())}") from None
    ours = next((a for a in merged if a.startswith("--hs-") or a.startswith("--hs_")), None)
    if ours:
        raise CaptureConfigError(f"--config: {ours} is an sglang-hs flag; give it on the command line (SGLang's "
                                 "config file holds SGLang's flags only)")
    return merged


def prepare(argv: List[str]) -> Tuple[List[str], Optional[str]]:
    """Resolve flags into (sglang argv, dump dir), writing the settings into os.environ, which the
    server's processes inherit. Raises CaptureConfigError with a one-line message on bad input."""
    from sglang_hs import fsutil
    from sglang_hs.tools import tiny_model
    from sglang_hs.server.cpu import stubs_dir

    check_sglang_version()
    ns, sg_argv = split_argv(argv)
    sg_argv = expand_config(sg_argv)
    env = os.environ
    default_ring = None  # bytes; None: envs.DEFAULT_RING_BYTES
    # SGLang imports every module of this package and registers its EntryClass (ours win).
    env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "sglang_hs.server.models"

    model_path = _flag_value(sg_argv, "--model-path", "--model")
    if model_path is None:
        model_path = tiny_model.ensure()
        sg_argv = ["--model-path", model_path] + sg_argv

    device = _flag_value(sg_argv, "--device")
    if runs_on_cpu(sg_argv):
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["SGLANG_HS_CPU_MODE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (stubs_dir(), env.get("PYTHONPATH")) if p)
        if device is None:
            sg_argv += ["--device", "cpu"]
        if not _has_flag(sg_argv, "--max-total-tokens", "--mem-fraction-static"):
            sg_argv += ["--max-total-tokens", CPU_DEFAULT_MAX_TOTAL_TOKENS]
        default_ring = parse_size(CPU_DEFAULT_RING_SIZE)
        if not _has_flag(sg_argv, "--sleep-on-idle"):
            sg_argv += ["--sleep-on-idle"]  # an idle scheduler otherwise spins a core the CPU engine needs
        bind = cpu_threads_bind(sg_argv)
        if bind and not env.get("SGLANG_CPU_OMP_THREADS_BIND"):
            env["SGLANG_CPU_OMP_THREADS_BIND"] = bind  # SGLang asserts one NUMA node per rank otherwise
        print(f"[sglang-hs] CPU mode (SGLang's CPU engine): {cpu_omp_wait_policy(env)}", file=sys.stderr)
    else:
        env.pop("SGLANG_HS_CPU_MODE", None)

    for key in ("SGLANG_HS_DUMP_DIR", "SGLANG_HS_LAYERS", "SGLANG_HS_LAYER_SOURCE", "SGLANG_HS_LAST", "SGLANG_HS_HC_STREAMS", "SGLANG_HS_SHARE_GID", "SGLANG_HS_COPY",
                "SGLANG_HS_STAGING_ROWS", "SGLANG_HS_SCATTER_THREADS", "SGLANG_HS_GATHER_THREADS", "SGLANG_HS_CAPTURE",
                "SGLANG_HS_CAPTURE_SAMPLE", "SGLANG_HS_WHEN_BEHIND", "SGLANG_HS_CAPTURE_SAMPLE_KEY",
                "SGLANG_HS_CAPTURE_MAX_BYTES", "SGLANG_HS_CAPTURE_ACCEPT_BELOW", "SGLANG_HS_CAPTURE_ACCEPT_LOWEST",
                "SGLANG_HS_CAPTURE_ACCEPT_WINDOW", "SGLANG_HS_CAPTURE_CONFIDENCE_BELOW", "SGLANG_HS_RECORD_PART_BYTES", "SGLANG_HS_SPECULATIVE_ALGORITHM",
                "SGLANG_HS_DP_CONTROLLER"):
        env.pop(key, None)
    env.update(patch_settings(sg_argv))
    dump_dir = None
    if ns.hs_dump_dir:
        arch, config, spec = resolve_capture(ns, sg_argv, model_path, bool(env.get("SGLANG_HS_CPU_MODE")))
        if arch in TEXT_CONFIG_WRAPPERS:  # Kimi-K2.5: capture its language model, text requests only
            sg_argv = text_only(sg_argv)
            print(f"[sglang-hs] {arch}: served text only (language_model_only): no image processor, chat "
                  "requests with images are refused, image data sent to /generate is ignored", file=sys.stderr)
        try:
            share_gid = fsutil.resolve_share_group(ns.hs_share_group) if ns.hs_share_group else None
            dump_dir = fsutil.ensure_private_dir(ns.hs_dump_dir, share_gid)
            global _dump_dir_lock
            _dump_dir_lock = fsutil.lock_dump_dir(dump_dir)  # held until this process exits
            mark_node_writers(dump_dir, sg_argv, share_gid)
        except (OSError, ValueError) as e:
            raise CaptureConfigError(str(e)) from None
        if fs_type(dump_dir) not in ("tmpfs", "ramfs"):
            print(f"[sglang-hs] warning: --hs-dump-dir {dump_dir} is not on tmpfs (e.g. /dev/shm): the "
                  "store and ring will page to disk", file=sys.stderr)
        env["SGLANG_HS_DUMP_DIR"] = dump_dir
        if share_gid is not None:
            env["SGLANG_HS_SHARE_GID"] = str(share_gid)
        env["SGLANG_HS_LAYERS"] = ",".join(map(str, spec.layers))
        env["SGLANG_HS_LAYER_SOURCE"] = json.dumps(spec.source)
        if spec.hc_mult > 1:
            env["SGLANG_HS_HC_STREAMS"] = spec.streams
        if spec.last:
            env["SGLANG_HS_LAST"] = last_choice(spec.finals)
        if ns.hs_copy:
            env["SGLANG_HS_COPY"] = ns.hs_copy
        for flag, key, unit, copies in (("--hs-staging-rows", "SGLANG_HS_STAGING_ROWS", "rows", ("staging", "deferred")),
                                        ("--hs-scatter-threads", "SGLANG_HS_SCATTER_THREADS", "threads", ("staging",)),
                                        ("--hs-gather-threads", "SGLANG_HS_GATHER_THREADS", "threads", None)):
            value = getattr(ns, flag[2:].replace("-", "_"))
            if value is None:
                continue
            if copies is not None and ns.hs_copy not in copies:
                raise CaptureConfigError(f"{flag} needs --hs-copy {' or '.join(copies)}")
            if value <= 0:
                raise CaptureConfigError(f"{flag}: must be > 0 {unit}, got {value}")
            env[key] = str(value)
        if ns.hs_copy == "deferred" and env.get("SGLANG_HS_CPU_MODE"):
            raise CaptureConfigError("--hs-copy deferred needs a CUDA device (this server runs SGLang's CPU engine); "
                                     "use --hs-copy direct or staging")
        env.update(selection_env(ns))
        print(f"[sglang-hs] capture: layers {list(spec.layers)}{' + last ' + last_choice(spec.finals) if spec.last else ''} of "
              f"{spec.num_layers} (hidden {spec.hidden_size}) into {dump_dir}; {layer_source.startup_line(spec.source)}",
              file=sys.stderr, flush=True)
    elif ns.hs_layers is not None or ns.hs_last or ns.hs_share_group or ns.hs_copy or ns.hs_staging_rows is not None \
            or ns.hs_scatter_threads is not None or ns.hs_gather_threads is not None or ns.hs_capture is not None \
            or ns.hs_capture_sample is not None or ns.hs_when_behind is not None \
            or ns.hs_capture_sample_key is not None or ns.hs_capture_max_bytes is not None \
            or ns.hs_hc_streams is not None or ns.hs_capture_accept_below is not None \
            or ns.hs_capture_accept_lowest is not None or ns.hs_capture_accept_window is not None \
            or ns.hs_capture_confidence_below is not None \
            or ns.hs_max_record_tokens is not None or ns.hs_record_part_size is not None:
        raise CaptureConfigError("--hs-layers/--hs-last/--hs-hc-streams/--hs-share-group/--hs-copy/--hs-staging-rows/--hs-scatter-"
                                 "threads/--hs-gather-threads/--hs-capture/--hs-capture-sample(-key)/--hs-capture-max-"
                                 "bytes/--hs-capture-accept-below/-lowest/-window/--hs-capture-confidence-below/"
                                 "--hs-when-behind/--hs-record-part-size/"
                                 "--hs-max-record-tokens need "
                                 "--hs-dump-dir (where to write the capture)")
    from sglang_hs import envs

    ring = parse_size(ns.hs_ring_size) if ns.hs_ring_size else (default_ring or envs.DEFAULT_RING_BYTES)
    if dump_dir:
        if ns.hs_max_record_tokens is not None and ns.hs_max_record_tokens < 1:
            raise CaptureConfigError(f"--hs-max-record-tokens: at least 1 token (prompt + max_new_tokens), got "
                                     f"{ns.hs_max_record_tokens}")
        part_bytes = record_part_bytes(ns.hs_record_part_size, sg_argv)
        if part_bytes:
            env["SGLANG_HS_RECORD_PART_BYTES"] = str(part_bytes)
        ring = check_ring_size(ring, explicit=bool(ns.hs_ring_size), spec=spec, config=config, argv=sg_argv,
                               dump_dir=dump_dir, max_record_tokens=ns.hs_max_record_tokens, part_bytes=part_bytes)
    env["SGLANG_HS_RING_SIZE"] = str(ring)
    env.pop("SGLANG_HS_ADMISSION_TIMEOUT", None)
    if ns.hs_admission_timeout is not None:
        if not ns.hs_admission_timeout >= 0:
            raise CaptureConfigError(f"--hs-admission-timeout: must be >= 0 seconds (0 = no limit), got "
                                     f"{ns.hs_admission_timeout}")
        env["SGLANG_HS_ADMISSION_TIMEOUT"] = str(ns.hs_admission_timeout)
    if ns.hs_startup_timeout is not None:
        if not (math.isfinite(ns.hs_startup_timeout) and ns.hs_startup_timeout > 0):
            raise CaptureConfigError(f"--hs-startup-timeout: must be > 0 seconds, got {ns.hs_startup_timeout}")
        env["SGLANG_HS_STARTUP_TIMEOUT"] = str(ns.hs_startup_timeout)
    try:  # an inherited value: checked as the flag is
        envs.SGLANG_HS_STARTUP_TIMEOUT
    except envs.EnvError as e:
        raise CaptureConfigError(f"{e} (inherited from the environment; unset it or pass --hs-startup-timeout)") from None
    return sg_argv, dump_dir


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    try:
        sg_argv, dump_dir = prepare(argv)
    except CaptureConfigError as e:
        print(f"sglang-hs: error: {e}", file=sys.stderr)
        return 2
    from sglang_hs import envs
    from sglang_hs.tools.supervisor import Supervisor

    ignored = envs.ignored_test_switches()
    if ignored:
        print(f"sglang-hs: ignoring {', '.join(ignored)}: test-only switches, honoured only with "
              f"{envs.TEST_GATE}=1", file=sys.stderr)
    cmd = [sys.executable, "-m", "sglang_hs.server.serve"] + sg_argv
    return Supervisor(cmd, envs.SGLANG_HS_STARTUP_TIMEOUT, dump_dir).run()


if __name__ == "__main__":
    sys.exit(main())
