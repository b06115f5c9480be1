"""Runtime patches of SGLang 0.5.23, each in its own module, applied lazily and once per process.

Ledger (what / why / upstream status / removal plan):

| module            | what                                         | when applied     |
|-------------------|----------------------------------------------|------------------|
| mla_torch_native  | registers a `torch_native` attention handler | CPU mode only    |
|                   | for DeepSeek MLA that always dispatches to   |                  |
|                   | the absorbed MLA path                        |                  |
| capture_hooks     | wraps ModelRunner.init_routed_experts_       | capture on       |
|                   | capturer (create the store),                 |                  |
|                   | SchedulerBatchResultProcessor._maybe_collect_|                  |
|                   | routed_experts (publish a finished request), |                  |
|                   | SchedulerRequestReceiver._pull_raw_reqs      |                  |
|                   | (admission control),                         |                  |
|                   | Scheduler.ingest_requests (to see its queues)|                  |
|                   | ModelRunner.forward (count each step in      |                  |
|                   | the status; step hooks of --hs-copy staging) |                  |
|                   | and ModelRunner.alloc_memory_pool (hold the  |                  |
|                   | staging buffers' device memory before the KV |                  |
|                   | pool is sized)                               |                  |
| warmup_rid        | wraps TokenizerManager.generate_request: a   | capture on, HTTP |
|                   | rid-less request before the server is Up     | server process   |
|                   | gets the rid HS_WARMUP-<hex>                 | (serve.py)       |

mla_torch_native
  why:      on the CPU engine the torch_native backend has no handler of its own, so SGLang's
            default sends a prefill without a cached prefix down the MHA path, where
            `TorchNativeAttnBackend.forward_extend` ignores the k/v it is given and attends over the
            latent MLA cache: wrong numerics (or a shape error, depending on head sizes).
  upstream: present in sglang 0.5.23; not reported upstream by us yet.
  removal:  when the pinned sglang registers a correct torch_native handler; the numerics e2e test
            (tests/e2e/test_numerics.py) fails without this patch, so it shows when it can go.

capture_hooks
  why:      the store must be sized from the KV pool (known to the ModelRunner, after the model is
            built, before CUDA-graph capture), and records must be published where SGLang finishes a
            request, before its KV slots are released. SGLang's own routed-experts capturer has exactly
            these two points; we wrap them (original called first, unchanged). Admission control must
            decide on the writer rank before SGLang broadcasts new requests to the other ranks, which
            is `_pull_raw_reqs` (sglang_hs/store/admission.py says why). The staging strategy must ship
            what a CUDA-graph replay wrote after every step, which runs no Python of the model: the
            point after `ModelRunner.forward` returns, where SGLang calls its capturers' `on_forward_end`.
            The same point counts every step in the overlay's status (a replay skips the model's
            Python, and capture passes call the model without ModelRunner.forward).
            SGLang sizes the KV pool from the device memory free when `alloc_memory_pool` runs (for
            MLA models once, before graph capture: no post-capture resize), and the store is made only
            after it; so the staging buffers' device bytes are held just before, and handed to the
            stage after, or rank 0 alone would take them out of its graph and activation headroom.
  upstream: no extension point for per-token capturers in 0.5.23 besides these.
  removal:  if SGLang grows a capturer registry or a `sglang.srt.plugins` hook at both points, move
            there. A change of either method's name or signature fails `apply()` loudly (AttributeError
            at start-up) and the version gate refuses any sglang but 0.5.23.

warmup_rid
  why:      SGLang's own warm-up request has no rid, so its record would reach readers like a user's.
  upstream: no way to name the warm-up request in 0.5.23.
  removal:  if SGLang gives its warm-up request a recognisable rid (as it does for HEALTH_CHECK).

Who applies them: the overlay model's constructor (sglang_hs/models/deepseek_v2.py), i.e. exactly the
processes that build the model, before any forward; warmup_rid, which concerns the HTTP server
process, is applied by sglang_hs/serve.py. Not a `sglang.srt.plugins` entry point: SGLang
logs and swallows exceptions raised by plugins, and would run ours in every SGLang process of the
environment, plain `sglang serve` runs included.
"""
from __future__ import annotations

import threading

from sglang_hs import envs

_lock = threading.Lock()
_applied: dict = {}


def apply() -> dict:
    """Apply the patches this process needs; idempotent. Returns {name: original} for tests."""
    with _lock:
        wanted = envs.SGLANG_HS_CPU_MODE and "mla_torch_native" not in envs.SGLANG_HS_DISABLE_PATCHES
        if wanted and "mla_torch_native" not in _applied:
            from sglang_hs.patches import mla_torch_native

            _applied["mla_torch_native"] = mla_torch_native.apply()
        if envs.SGLANG_HS_DUMP_DIR and "capture_hooks" not in _applied:
            from sglang_hs.patches import capture_hooks

            _applied["capture_hooks"] = capture_hooks.apply()
        return dict(_applied)
