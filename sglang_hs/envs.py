"""Every setting sglang-hs reads from the environment, in one place, read lazily.

The launcher turns its `--hs-*` flags into these variables before SGLang starts, so every process
(the launcher, the scheduler and detokenizer processes that SGLang spawns, a reader) sees the same
values: `from sglang_hs import envs; envs.SGLANG_HS_DUMP_DIR`. Nothing is cached: each access reads
os.environ, so a test or a child process that changes a variable sees the change.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional


def _bool(name: str, default: bool = False) -> Callable[[], bool]:
    def get() -> bool:
        v = os.environ.get(name)
        if v is None or v == "":
            return default
        return v.strip().lower() in ("1", "true", "yes", "on")

    return get


def _str(name: str, default: Optional[str] = None) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name) or default


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name) or default)


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name) or default)


def _layers() -> Optional[List[int]]:
    v = os.environ.get("SGLANG_HS_LAYERS")
    return [int(x) for x in v.split(",")] if v else None


COPY_STRATEGIES = ("direct", "staging")
CAPTURE_MODES = ("all", "opt-in")
WHEN_BEHIND = ("hold", "skip")
DEFAULT_RING_BYTES = 1 << 30
DEFAULT_ADMISSION_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 1200.0
DEFAULT_GATHER_THREADS = 1
# Provisional: one CPU thread streams ~5-10 GB/s into the store, a GPU's copy to host ~50; the GPU
# benchmark (benchmarks/bench_gpu_copy.py, staging at 1-8 threads) is what should set it.
DEFAULT_SCATTER_THREADS = 4

env_variables: Dict[str, Callable[[], Any]] = {
    # Capture is on when this is set: the folder of the manifest, the store and the output rings.
    "SGLANG_HS_DUMP_DIR": _str("SGLANG_HS_DUMP_DIR"),
    # Layer ids, validated by the launcher: id i = residual stream entering decoder layer i
    # = HF output_hidden_states[i]. Unset: the EAGLE-3 default [2, n//2, n-3].
    "SGLANG_HS_LAYERS": _layers,
    # Also capture the final state (--hs-last): "post-norm" (HF output_hidden_states[n]; "1" means the same),
    # "pre-norm" (the final residual stream before the final norm, the input of HF model.model.norm) or
    # "both"; unset: none (capture_spec.parse_last).
    "SGLANG_HS_LAST": _str("SGLANG_HS_LAST"),
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
    # When the output ring cannot take a request's reservation (--hs-when-behind): "hold" it in admission
    # control until the reader frees room, or "skip": serve it without capture.
    "SGLANG_HS_WHEN_BEHIND": _str("SGLANG_HS_WHEN_BEHIND", "hold"),
    # How rows reach the store (--hs-copy): "direct" (the copy kernel writes the store: registered,
    # mapped host memory on CUDA) or "staging" (a device buffer shipped on a copy stream, sglang_hs/store/staging.py).
    "SGLANG_HS_COPY": _str("SGLANG_HS_COPY", "direct"),
    # Rows of the staging buffers (--hs-staging-rows); 0: max(chunked prefill size, max running requests).
    "SGLANG_HS_STAGING_ROWS": _int("SGLANG_HS_STAGING_ROWS", 0),
    # Threads of the staging scatter of one step's rows into the store (--hs-scatter-threads); a step gets
    # at most one thread per 8 MiB of rows (csrc/row_threads.h), so decode steps always take one.
    "SGLANG_HS_SCATTER_THREADS": _int("SGLANG_HS_SCATTER_THREADS", DEFAULT_SCATTER_THREADS),
    # Publish finished records on the scheduler thread (the synchronous path, for debugging) instead of
    # handing them to the finish worker (sglang_hs/store/finisher.py).
    "SGLANG_HS_SYNC_FINISH": _bool("SGLANG_HS_SYNC_FINISH"),
    # Threads of one record's gather into the output ring (--hs-gather-threads); a record gets at most
    # one thread per 8 MiB of rows (csrc/gather_rows_cpu.cpp), so short records always take one.
    "SGLANG_HS_GATHER_THREADS": _int("SGLANG_HS_GATHER_THREADS", DEFAULT_GATHER_THREADS),
    # gid of --hs-share-group: the dump dir, manifest and rings are shared with this group (fsutil.py).
    "SGLANG_HS_SHARE_GID": lambda: int(os.environ["SGLANG_HS_SHARE_GID"]) if os.environ.get("SGLANG_HS_SHARE_GID") else None,
    # Set by the launcher in CPU mode: the scheduler applies the CPU-engine fixes (sglang_hs/patches).
    "SGLANG_HS_CPU_MODE": _bool("SGLANG_HS_CPU_MODE"),
    # Comma-separated runtime patches NOT to apply (sglang_hs/patches), e.g. when sglang's source was
    # patched instead (patches/*.patch) or to show what a patch fixes.
    "SGLANG_HS_DISABLE_PATCHES": lambda: {p for p in os.environ.get("SGLANG_HS_DISABLE_PATCHES", "").split(",") if p},
    # Seconds of start-up without any sign of progress after which the launcher gives up.
    "SGLANG_HS_STARTUP_TIMEOUT": _float("SGLANG_HS_STARTUP_TIMEOUT", DEFAULT_STARTUP_TIMEOUT_S),
    # Test-only: hang in this start-up phase ("load", "warmup": sleeping; "load-busy", "warmup-busy":
    # spinning a core) to exercise the stall detector.
    "SGLANG_HS_TEST_HANG_PHASE": _str("SGLANG_HS_TEST_HANG_PHASE"),
    # Test-only: seconds the finish worker waits before each gather, so that a test sees slots freed and
    # handed out again while their gather is pending (tests/e2e/test_exact_rows.py).
    "SGLANG_HS_TEST_FINISH_DELAY": _float("SGLANG_HS_TEST_FINISH_DELAY", 0.0),
    # Test-only: make the overlay module fail to import, as a broken install would.
    "SGLANG_HS_TEST_BREAK_OVERLAY": _bool("SGLANG_HS_TEST_BREAK_OVERLAY"),
    # Cache of generated checkpoints (and, for the Makefile, the dependency venvs).
    "SGLANG_HS_CACHE": _str("SGLANG_HS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sglang-hs")),
}


def __getattr__(name: str) -> Any:
    if name in env_variables:
        return env_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return list(env_variables)
