"""Every setting sglang-hs reads from the environment, in one place, read lazily.

The launcher turns its `--hs-*` flags into these variables before SGLang starts, so every process
(the launcher, the scheduler and detokenizer processes that SGLang spawns, a reader) sees the same
values: `from sglang_hs import envs; envs.SGLANG_HS_DUMP_DIR`. Nothing is cached: each access reads
os.environ, so a test or a child process that changes a variable sees the change.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Optional

# Test-only switches (SGLANG_HS_TEST_*: planted hangs, delays, a broken overlay) are honoured only while this
# is 1: a production server that inherits one from a test shell or a copied environment runs as production.
TEST_GATE = "SGLANG_HS_TESTING"


class EnvError(ValueError):
    """A variable of the environment holds a value sglang-hs cannot use: one line naming it and what it takes."""


def _bool(name: str, default: bool = False) -> Callable[[], bool]:
    def get() -> bool:
        v = os.environ.get(name)
        if v is None or v == "":
            return default
        return v.strip().lower() in ("1", "true", "yes", "on")

    return get


def _str(name: str, default: Optional[str] = None) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name) or default


def _number(name: str, default, kind, ok: Optional[Callable[[Any], bool]] = None, expect: str = "") -> Callable[[], Any]:
    def get():
        v = os.environ.get(name)
        if v is None or v.strip() == "":
            return default
        try:
            x = kind(v)
        except ValueError:
            x = None
        if x is None or (ok is not None and not ok(x)) or (kind is float and math.isnan(x)):
            raise EnvError(f"{name}={v!r}: expected {expect or ('an integer' if kind is int else 'a number')}")
        return x

    return get


def _int(name: str, default: int) -> Callable[[], int]:
    return _number(name, default, int)


def _float(name: str, default: float) -> Callable[[], float]:
    return _number(name, default, float)


def _test_only(name: str, getter: Callable[[], Any], default: Any) -> Callable[[], Any]:
    return lambda: getter() if os.environ.get(TEST_GATE) == "1" else default


def ignored_test_switches() -> List[str]:
    """The SGLANG_HS_TEST_* variables set while TEST_GATE is not 1 (ignored: the launcher says so)."""
    if os.environ.get(TEST_GATE) == "1":
        return []
    return sorted(k for k, v in os.environ.items() if k.startswith("SGLANG_HS_TEST_") and v)


def _layers() -> Optional[List[int]]:
    v = os.environ.get("SGLANG_HS_LAYERS")
    return [int(x) for x in v.split(",")] if v else None


COPY_STRATEGIES = ("direct", "staging", "deferred")
CAPTURE_MODES = ("all", "opt-in")
WHEN_BEHIND = ("hold", "skip")
DEFAULT_RING_BYTES = 1 << 30
# A long record is read, written and spilled a chunk of this many row bytes at a time (HiddenStateReader.chunks,
# the extraction CLI's --part-mb, LiveHiddenStates(part_bytes=))
DEFAULT_PART_BYTES = 256 << 20
DEFAULT_ADMISSION_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 1200.0
DEFAULT_GATHER_THREADS = 1
DEFAULT_ACCEPT_WINDOW = 1000  # finished requests: --hs-capture-accept-lowest's recent traffic
# Seconds the finish worker may go without finishing a job while the forward stream waits on the GPU for it
# (CUDA, --hs-copy direct) before its watchdog stops the server with the stuck gather named: below SGLang's
# own --watchdog-timeout (300 s), which would kill the scheduler without saying why.
DEFAULT_FINISH_WATCHDOG_S = 120.0
# Provisional: one CPU thread streams ~5-10 GB/s into the store, a GPU's copy to host ~50; the GPU
# benchmark (benchmarks/bench_gpu_copy.py, staging at 1-8 threads) is what should set it.
DEFAULT_SCATTER_THREADS = 4
# OMP_WAIT_POLICY the launcher gives SGLang's CPU engine when the environment does not set it: libgomp's
# default spins each worker thread after a parallel region, which on cores shared with more runnable
# threads takes the core the next op needs (benchmarks/bench_omp_wait.py measures it).
CPU_OMP_WAIT_POLICY = "PASSIVE"
# TORCHDYNAMO_DISABLE the server gives SGLang's CPU engine when SGLang serves float32 and the environment does
# not set it (serve.cpu_torch_compile). A few of SGLang's helpers are torch.compile'd at import (the MoE grouped
# top-k among them); every scheduler process would trace them with dynamo and build them with inductor at its
# first forward, ~6 CPU-s a --tp 1 start. In float32 eager computes them in the same precision
# (benchmarks/bench_cpu_startup.py); in bfloat16 the compiled top-k keeps its sigmoid in float32 and eager
# would not, so other dtypes compile. Any TORCHDYNAMO_DISABLE of the user's is passed on (torch compiles unless
# it is "1").
CPU_TORCHDYNAMO_DISABLE = "1"

env_variables: Dict[str, Callable[[], Any]] = {
    # Capture is on when this is set: the folder of the manifest, the store and the output rings.
    "SGLANG_HS_DUMP_DIR": _str("SGLANG_HS_DUMP_DIR"),
    # Layer ids, validated by the launcher: id i = residual stream entering decoder layer i
    # = HF output_hidden_states[i]. Unset: the EAGLE-3 default [2, n//2, n-3].
    "SGLANG_HS_LAYERS": _layers,
    # Where SGLANG_HS_LAYERS came from (server/layer_source.py: --hs-layers, the default, or a checkpoint's
    # drafter ids), a JSON object the launcher sets for the manifest's `layer_source`; unset: not said.
    "SGLANG_HS_LAYER_SOURCE": lambda: json.loads(os.environ["SGLANG_HS_LAYER_SOURCE"])
    if os.environ.get("SGLANG_HS_LAYER_SOURCE") else None,
    # Also capture the final state (--hs-last): "post-norm" (HF output_hidden_states[n]; "1" means the same),
    # "pre-norm" (the final residual stream before the final norm, the input of HF model.model.norm) or
    # "both"; unset: none (capture_spec.parse_last).
    "SGLANG_HS_LAST": _str("SGLANG_HS_LAST"),
    # DeepSeek-V4 (hyper-connections, --hs-hc-streams): "mean" (one row per layer id, the streams' mean,
    # SGLang's DSpark convention) or "full" (hc_mult rows per layer id); unset: mean.
    "SGLANG_HS_HC_STREAMS": _str("SGLANG_HS_HC_STREAMS"),
    # Bytes of the output ring of finished records, per writer.
    "SGLANG_HS_RING_SIZE": _int("SGLANG_HS_RING_SIZE", DEFAULT_RING_BYTES),
    # Seconds a request may be held by admission control (output ring full: the reader is behind)
    # before the server fails it with a clear error; 0 = hold as long as it takes.
    "SGLANG_HS_ADMISSION_TIMEOUT": _float("SGLANG_HS_ADMISSION_TIMEOUT", DEFAULT_ADMISSION_TIMEOUT_S),
    # Which requests are captured (--hs-capture): "all", or "opt-in" (only requests whose sampling params
    # carry custom_params {"hs_capture": true}, plus the --hs-capture-sample share of the others).
    "SGLANG_HS_CAPTURE": _str("SGLANG_HS_CAPTURE", "all"),
    # --hs-capture-sample P (0 < P <= 1): capture the requests whose rid hashes below P (opted-in ones
    # always); unset: none sampled (all with --hs-capture all, none with opt-in).
    "SGLANG_HS_CAPTURE_SAMPLE": lambda: float(os.environ["SGLANG_HS_CAPTURE_SAMPLE"])
    if os.environ.get("SGLANG_HS_CAPTURE_SAMPLE") else None,
    # --hs-capture-sample-key HEX: the key of the sampling hash (1 to 64 bytes); unset: drawn at random at
    # start, so no client can choose a request id that gets sampled. Set it to sample alike across runs.
    "SGLANG_HS_CAPTURE_SAMPLE_KEY": lambda: bytes.fromhex(os.environ["SGLANG_HS_CAPTURE_SAMPLE_KEY"])
    if os.environ.get("SGLANG_HS_CAPTURE_SAMPLE_KEY") else None,
    # --hs-capture-accept-below L (speculative servers): a captured request whose draft did well, SGLang's
    # spec_accept_length (tokens per verify step) >= L, is dropped at its finish (marker draft_accepted);
    # opted-in requests are always kept. Unset: no selection on the draft.
    "SGLANG_HS_CAPTURE_ACCEPT_BELOW": lambda: float(os.environ["SGLANG_HS_CAPTURE_ACCEPT_BELOW"])
    if os.environ.get("SGLANG_HS_CAPTURE_ACCEPT_BELOW") else None,
    # --hs-capture-accept-lowest F (0 < F < 1, speculative servers): keep only the captured requests whose accept
    # length is in the lowest F of the last SGLANG_HS_CAPTURE_ACCEPT_WINDOW finished requests' (ties kept
    # together); the others are dropped at their finish (marker draft_accepted). Unset: no such selection.
    "SGLANG_HS_CAPTURE_ACCEPT_LOWEST": lambda: float(os.environ["SGLANG_HS_CAPTURE_ACCEPT_LOWEST"])
    if os.environ.get("SGLANG_HS_CAPTURE_ACCEPT_LOWEST") else None,
    # --hs-capture-confidence-below C (0 < C <= 1, DSPARK servers whose draft has a confidence head): a captured
    # request whose mean draft confidence (SGLang's DSpark confidence head, every draft of every verify step) is >= C
    # is dropped at its finish (marker draft_accepted); opted-in requests are always kept. Unset: no such selection.
    "SGLANG_HS_CAPTURE_CONFIDENCE_BELOW": lambda: float(os.environ["SGLANG_HS_CAPTURE_CONFIDENCE_BELOW"])
    if os.environ.get("SGLANG_HS_CAPTURE_CONFIDENCE_BELOW") else None,
    # --hs-capture-accept-window N: the recent traffic of --hs-capture-accept-lowest, in finished requests.
    "SGLANG_HS_CAPTURE_ACCEPT_WINDOW": _int("SGLANG_HS_CAPTURE_ACCEPT_WINDOW", DEFAULT_ACCEPT_WINDOW),
    # --hs-capture-max-bytes N: at most N bytes of captured records (worst case, charged at admission);
    # unset: no limit. Past it, requests are served without capture (reason over_budget).
    "SGLANG_HS_CAPTURE_MAX_BYTES": lambda: int(os.environ["SGLANG_HS_CAPTURE_MAX_BYTES"])
    if os.environ.get("SGLANG_HS_CAPTURE_MAX_BYTES") else None,
    # When the output ring cannot take a request's reservation (--hs-when-behind): "hold" it in admission
    # control until the reader frees room, or "skip": serve it without capture.
    "SGLANG_HS_WHEN_BEHIND": _str("SGLANG_HS_WHEN_BEHIND", "hold"),
    # How rows reach the store (--hs-copy): "direct" (the copy kernel writes the store: registered,
    # mapped host memory on CUDA), "staging" (a device buffer shipped on a copy stream and scattered on the
    # host, sglang_hs/server/store/staging.py) or "deferred" (CUDA: the same device buffer, written into the
    # mapped store by the copy kernel on the copy stream after the step).
    "SGLANG_HS_COPY": _str("SGLANG_HS_COPY", "direct"),
    # Rows of the staging buffers (--hs-staging-rows); 0: max(chunked prefill size, max running requests).
    "SGLANG_HS_STAGING_ROWS": _int("SGLANG_HS_STAGING_ROWS", 0),
    # Threads of the staging scatter of one step's rows into the store (--hs-scatter-threads); a step gets
    # at most one thread per 8 MiB of rows (csrc/row_threads.h), so decode steps always take one.
    "SGLANG_HS_SCATTER_THREADS": _int("SGLANG_HS_SCATTER_THREADS", DEFAULT_SCATTER_THREADS),
    # Publish finished records on the scheduler thread (the synchronous path, for debugging) instead of
    # handing them to the finish worker (sglang_hs/server/store/finisher.py).
    "SGLANG_HS_SYNC_FINISH": _bool("SGLANG_HS_SYNC_FINISH"),
    # Added to the finish worker thread's nice value (Linux: per thread; 0, the default, leaves it): where
    # cores are short the kernel runs the scheduler thread before the worker's gathers, and a write that
    # must wait for a gather waits longer (benchmarks/bench_full_pool.py, docs/benchmarks.md).
    "SGLANG_HS_FINISH_NICE": _number("SGLANG_HS_FINISH_NICE", 0, int, lambda x: 0 <= x <= 19,
                                     "an integer 0-19 (added to the finish worker thread's nice value)"),
    # The finish worker's watchdog (CUDA, --hs-copy direct): seconds without a finished job while the forward
    # stream waits on the GPU for one, before the server is stopped with the stuck gather named (finisher.py).
    "SGLANG_HS_FINISH_WATCHDOG_S": _number("SGLANG_HS_FINISH_WATCHDOG_S", DEFAULT_FINISH_WATCHDOG_S, float,
                                           lambda x: math.isfinite(x) and x > 0, "seconds > 0"),
    # --hs-record-part-size: a captured record of more row bytes leaves the output ring in parts of at most that
    # many row bytes, each published as soon as the ring has room, the request's KV slots held (not given back
    # to SGLang) until its last part is gathered (finisher.py, patches/hold_finished_kv.py); 0/unset: every
    # record whole. Only where the writer rank is the attention group's only rank (attention TP 1).
    "SGLANG_HS_RECORD_PART_BYTES": _int("SGLANG_HS_RECORD_PART_BYTES", 0),
    # Threads of one record's gather into the output ring (--hs-gather-threads); a record gets at most
    # one thread per 8 MiB of rows (csrc/gather_rows_cpu.cpp), so short records always take one.
    "SGLANG_HS_GATHER_THREADS": _int("SGLANG_HS_GATHER_THREADS", DEFAULT_GATHER_THREADS),
    # gid of --hs-share-group: the dump dir, manifest and rings are shared with this group (fsutil.py).
    "SGLANG_HS_SHARE_GID": lambda: int(os.environ["SGLANG_HS_SHARE_GID"]) if os.environ.get("SGLANG_HS_SHARE_GID") else None,
    # Not ours but read by the launcher in CPU mode (libgomp's own variable): unset, the launcher sets it to
    # CPU_OMP_WAIT_POLICY for the server's processes; set empty, the launcher removes it (libgomp's default
    # spin-wait); any other value is the user's and passed on as it is.
    "OMP_WAIT_POLICY": lambda: os.environ.get("OMP_WAIT_POLICY"),
    # Set by the launcher in CPU mode: the scheduler applies the CPU-engine fixes (sglang_hs/server/patches).
    "SGLANG_HS_CPU_MODE": _bool("SGLANG_HS_CPU_MODE"),
    # Set by the launcher to the server's --speculative-algorithm (upper case; unset: none). DSPARK: the CPU engine's
    # processes apply patches/dsv4_cpu_dspark (V4's DSpark draft); other servers leave SGLang's DSpark path as it is.
    "SGLANG_HS_SPECULATIVE_ALGORITHM": lambda: (os.environ.get("SGLANG_HS_SPECULATIVE_ALGORITHM") or "").upper()
    or None,
    # Set by the launcher when the server runs SGLang's data-parallel controller process (--dp or --attn-dp-size
    # above 1, or --elastic-ep-join-mode scale): the CPU engine's spawned processes apply
    # patches/dp_controller_idle_wait; other servers run none.
    "SGLANG_HS_DP_CONTROLLER": _bool("SGLANG_HS_DP_CONTROLLER"),
    # Comma-separated runtime patches NOT to apply (sglang_hs/server/patches), e.g. when sglang's source was
    # patched instead (patches/*.patch) or to show what a patch fixes.
    "SGLANG_HS_DISABLE_PATCHES": lambda: {p for p in os.environ.get("SGLANG_HS_DISABLE_PATCHES", "").split(",") if p},
    # Seconds of start-up without any sign of progress after which the launcher gives up (finite, > 0; an
    # inherited value is checked by the launcher like --hs-startup-timeout).
    "SGLANG_HS_STARTUP_TIMEOUT": _number("SGLANG_HS_STARTUP_TIMEOUT", DEFAULT_STARTUP_TIMEOUT_S, float,
                                         lambda x: math.isfinite(x) and x > 0, "seconds > 0"),
    # Test-only (honoured only with SGLANG_HS_TESTING=1, TEST_GATE): hang in this start-up phase ("load",
    # "warmup": sleeping; "load-busy", "warmup-busy": spinning a core) to exercise the stall detector.
    "SGLANG_HS_TEST_HANG_PHASE": _test_only("SGLANG_HS_TEST_HANG_PHASE", _str("SGLANG_HS_TEST_HANG_PHASE"), None),
    # Test-only (TEST_GATE): seconds the finish worker waits before each gather, so that a test sees slots
    # freed and handed out again while their gather is pending (tests/e2e/test_exact_rows.py).
    "SGLANG_HS_TEST_FINISH_DELAY": _test_only("SGLANG_HS_TEST_FINISH_DELAY", _float("SGLANG_HS_TEST_FINISH_DELAY", 0.0),
                                              0.0),
    # Test-only (TEST_GATE): the gather of a request whose rid starts with this prefix is held until a write into
    # the store waits for it (a slot it reads was handed out again and written), at most SGLANG_HS_TEST_HOLD_S
    # seconds: a test proves the ordering on published state instead of hoping a delay lines it up.
    "SGLANG_HS_TEST_HOLD_RID": _test_only("SGLANG_HS_TEST_HOLD_RID", _str("SGLANG_HS_TEST_HOLD_RID"), None),
    "SGLANG_HS_TEST_HOLD_S": _test_only("SGLANG_HS_TEST_HOLD_S", _float("SGLANG_HS_TEST_HOLD_S", 30.0), 30.0),
    # Test-only (TEST_GATE): benchmarks/bench_full_pool.py's overlap model (the gpu-model designs) holds the gather
    # of each job until the forward launched after its hand-over has written its rows, or waits for this gather
    # (or no forward follows), at most SGLANG_HS_TEST_HOLD_S seconds, then fails: a write into a slot the gather
    # reads is always issued before it, so the model sees an unordered write on published state, not by a
    # delay's luck (tests/unit/test_bench_full_pool.py).
    "SGLANG_HS_TEST_HOLD_GATHERS": _test_only("SGLANG_HS_TEST_HOLD_GATHERS", _bool("SGLANG_HS_TEST_HOLD_GATHERS"),
                                              False),
    # Test-only (TEST_GATE): make the overlay module fail to import, as a broken install would.
    "SGLANG_HS_TEST_BREAK_OVERLAY": _test_only("SGLANG_HS_TEST_BREAK_OVERLAY", _bool("SGLANG_HS_TEST_BREAK_OVERLAY"),
                                               False),
    # Test-only (TEST_GATE): several --nnodes "nodes" on one machine. A node of rank > 0 skips SGLang's
    # pre-checks that the DP-attention ports (derived from --dist-init-addr) are free on its own host: node
    # 0, on the same host, holds them; on separate machines they are free and the check passes
    # (tests/e2e/test_multi_node.py).
    "SGLANG_HS_TEST_SAME_HOST_NODES": _test_only("SGLANG_HS_TEST_SAME_HOST_NODES",
                                                 _bool("SGLANG_HS_TEST_SAME_HOST_NODES"), False),
    # The folder of a Mooncake install for the cross-machine transport (scripts/ensure_env.sh puts
    # requirements/mooncake.txt there and names it in .venv/.mooncake): site/ the wheel, lib/ the libibverbs and
    # libnl it links, loaded by absolute path (sglang_hs/extract/transport/mooncake.py); unset: an installed
    # `mooncake` package, its libraries the system's.
    "SGLANG_HS_MOONCAKE": _str("SGLANG_HS_MOONCAKE"),
    # The consumer's side of the Mooncake transport (LiveHiddenStates(transport="mooncake"), the extraction's
    # --transport mooncake): its RDMA devices when the publisher runs --mooncake-protocol rdma (e.g. "mlx5_0"),
    # and this host's address as the publisher's host reaches it (default: the address the control connection
    # to the publisher leaves from).
    "SGLANG_HS_MOONCAKE_DEVICE": _str("SGLANG_HS_MOONCAKE_DEVICE", ""),
    "SGLANG_HS_MOONCAKE_HOST": _str("SGLANG_HS_MOONCAKE_HOST"),
    # Cache of generated checkpoints (and, for the Makefile, the dependency venvs).
    "SGLANG_HS_CACHE": _str("SGLANG_HS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sglang-hs")),
}


def __getattr__(name: str) -> Any:
    if name in env_variables:
        return env_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return list(env_variables)
