"""Capture on: create the store when SGLang sizes its own per-token capturers, publish a record where
SGLang finishes a request, and hold new requests back while the output ring lacks room for them.

The record itself is gathered and published by the finish worker (sglang_hs/server/store/finisher.py): the
finish hook hands the request over; the scheduler-side hooks below take the worker's results without
waiting for it (`get_next_batch_to_run` every iteration, `on_idle`, request intake), and on CUDA with
the direct copy order each step's writes into the store after the pending gathers, on the GPU
(`ModelRunner.forward`). SGLang's KV allocator is not touched. SGLANG_HS_SYNC_FINISH=1 publishes on the
scheduler thread instead.

See the ledger in sglang_hs/server/patches/__init__.py. Each hook wraps an upstream method (the originals
stay reachable as `ORIGINALS`) and calls it first, unchanged.
"""
from __future__ import annotations

import collections
import logging
import os
from array import array
from typing import Optional

from sglang_hs.version import SGLANG_VERSION

logger = logging.getLogger(__name__)
ORIGINALS = {}
_writer = None  # this process's CaptureWriter, when it is a writer rank
_admission = None  # its AdmissionControl
_scheduler = None  # the Scheduler of this process, for reconciling reservations
_reserved = None  # (rows, device tensor): the staging buffers' memory, held while SGLang sizes the KV pool
_finisher = None  # its FinishWorker once the first request finished; False: the synchronous path
_selection = None  # DraftSelection (store/draft_selection.py): --hs-capture-accept-below / -lowest
_part_bytes = 0  # --hs-record-part-size where this writer publishes records in parts (parts_here); 0: whole records


def _after_init_capturers(self) -> None:
    ORIGINALS["init_routed_experts_capturer"](self)
    global _writer, _admission, _reserved, _selection, _part_bytes
    from sglang.srt.runtime_context import get_parallel

    model, par = self.model, get_parallel()
    if getattr(model, "hs_spec", None) is None or getattr(self, "is_draft_worker", False):
        return
    check_kv_index_space(self)
    if par.attn_tp_rank != 0 or getattr(par, "attn_cp_rank", 0) != 0:
        return  # one writer per data-parallel attention group: its attention-TP rank 0
    from sglang_hs import envs
    from sglang_hs.server.identity import served_identity
    from sglang_hs.server.store.writer import CaptureWriter

    from sglang_hs.server.identity import resolved_args

    args = resolved_args(getattr(self, "server_args", None))  # the unit tests' stand-in runners have none
    staging_rows = envs.SGLANG_HS_STAGING_ROWS or (_reserved[0] if _reserved else _default_staging_rows(self))
    _reserved = None  # handed back to the caching allocator, where the staging buffers are carved from it
    num_slots = self.kv_index_translator.capture_token_capacity(self.max_token_pool_size)
    writer_id = getattr(par, "attn_dp_rank", 0)
    _writer = CaptureWriter(
        envs.SGLANG_HS_DUMP_DIR, model.hs_spec, num_slots, self.model_config.dtype, envs.SGLANG_HS_RING_SIZE,
        model_path=self.model_config.model_path,
        architecture=(getattr(self.model_config.hf_config, "architectures", None) or [""])[0],
        device=self.device, context_len=self.model_config.context_len, page_size=getattr(self, "page_size", 1),
        copy=envs.SGLANG_HS_COPY, staging_rows=staging_rows,
        # one writer per DP attention group; the dump dir is this node's: it lists this node's writers
        writer_id=writer_id, node=node_writers(par), served=served_identity(args),
    )
    model.hs_writer = _writer
    follow_kv_moves(self.token_to_kv_pool, _writer)
    if str(self.device).startswith("cuda") and (_writer.staging is None or _writer.staging.deferred) \
            and not envs.SGLANG_HS_SYNC_FINISH:
        from sglang_hs.server.store.finisher import check_stream_wait

        check_stream_wait()  # the finish worker orders the store's writes with it: refused now, not mid-serving
    from sglang_hs.server.store.admission import AdmissionControl, part_rows_of

    _part_bytes = parts_here(par, self)
    row_bytes = _writer.P * model.hs_spec.hidden_size * _writer.store.element_size()
    _admission = AdmissionControl(_writer.ring, _writer.P, model.hs_spec.hidden_size, _writer.store.element_size(),
                                  self.model_config.context_len, timeout=envs.SGLANG_HS_ADMISSION_TIMEOUT,
                                  mode=envs.SGLANG_HS_CAPTURE, sample=envs.SGLANG_HS_CAPTURE_SAMPLE,
                                  when_behind=envs.SGLANG_HS_WHEN_BEHIND, recorded_prompt_len=_recorded_prompt_len,
                                  sample_key=envs.SGLANG_HS_CAPTURE_SAMPLE_KEY or os.urandom(32),
                                  max_bytes=envs.SGLANG_HS_CAPTURE_MAX_BYTES,
                                  speculative=bool(getattr(args, "speculative_algorithm", None)),
                                  part_rows=part_rows_of(_part_bytes, row_bytes),
                                  hold_budget=hold_budget(self) if _part_bytes else 0)
    from sglang_hs.server.store.draft_selection import DraftSelection

    _selection = DraftSelection(below=envs.SGLANG_HS_CAPTURE_ACCEPT_BELOW, lowest=envs.SGLANG_HS_CAPTURE_ACCEPT_LOWEST,
                                window=envs.SGLANG_HS_CAPTURE_ACCEPT_WINDOW,
                                confidence_below=envs.SGLANG_HS_CAPTURE_CONFIDENCE_BELOW)
    if model.hs_status is not None:  # shown in the overlay's status file, the log and /metrics
        status = model.hs_status
        status.sources.update(writer=_writer.stats, admission=_admission.stats)
        status.ring_fill = _writer.ring.fill_ratio
        status.unaccounted = _unaccounted
        status.writer_id = writer_id
        from sglang_hs.server import metrics

        if metrics.enabled():
            status.listeners.append(metrics.CaptureMetrics(writer_id).refresh)


def hold_budget(runner) -> int:
    """Tokens of KV the captured requests in flight may hold after they finish (records in parts): the pool less one
    full-context request, so one can always run (at least half the pool)."""
    pool = int(getattr(runner, "max_total_num_tokens", 0) or runner.max_token_pool_size)
    return max(pool - int(runner.model_config.context_len), pool // 2)


def parts_here(par, runner) -> int:
    """--hs-record-part-size's bytes (0: not asked for). Start-up stops in one line where this writer cannot publish
    records in parts: the finish worker must run (not SGLANG_HS_SYNC_FINISH) on an allocator it follows, and the
    writer must be its attention group's only rank (holding slots on one rank alone would make the ranks'
    allocators diverge; the launcher refuses those flags, this is the server's own check). Records whole instead
    would not fit a ring sized for parts."""
    from sglang_hs import envs

    part_bytes = envs.SGLANG_HS_RECORD_PART_BYTES
    if not part_bytes:
        return 0
    from sglang_hs.server.store.finisher import check_allocator

    allocator = getattr(runner, "token_to_kv_pool_allocator", None)
    why = ("SGLANG_HS_SYNC_FINISH is set" if envs.SGLANG_HS_SYNC_FINISH else
           f"attention TP size {par.attn_tp_size} (holding slots needs every rank's consent)"
           if getattr(par, "attn_tp_size", 1) != 1 else
           check_allocator(allocator) if allocator is not None else "no KV allocator")
    if why is not None:
        raise RuntimeError(f"sglang-hs: --hs-record-part-size: records cannot leave the ring in parts here: {why}")
    logger.info("sglang-hs: records of more than %d row bytes leave the output ring in parts; their requests' KV "
                "slots are held until gathered (--hs-record-part-size)", part_bytes)
    return part_bytes


def follow_kv_moves(pool, writer) -> None:
    """Make `pool.move_kv_cache` (this pool object's alone) move the store's rows after the KV: speculative
    workers move accepted draft tokens' KV within a request's draft window after every verify
    (spec_utils.move_accept_tokens_to_target_kvcache, through token_to_kv_pool_allocator.get_kvcache(),
    which is this pool)."""
    original = pool.move_kv_cache

    def move_kv_cache(tgt_loc, src_loc):
        original(tgt_loc, src_loc)
        writer.move(tgt_loc, src_loc)

    move_kv_cache.__wrapped__ = original
    pool.move_kv_cache = move_kv_cache


def check_kv_index_space(runner) -> None:
    """Refuse a KV pool whose slot ids are translated (SGLang's KVIndexTranslator.is_translating: a unified
    SWA or Mamba allocator, a draft fused into the target's pool), on every rank alike. There an eager step
    hands the copy the virtual ids (`out_cache_loc_virtual`) but a CUDA-graph replay the physical ones its
    captured `out_cache_loc` buffer holds, while a record is gathered by the virtual ids of req_to_token:
    graph steps would write rows where no gather reads them. The flags that choose such pools are refused
    up front (serve.check_server_args); this stops any other way in before the store is made."""
    translator = getattr(runner, "kv_index_translator", None)
    if getattr(translator, "is_translating", False):
        raise RuntimeError(
            "sglang-hs: this server's KV pool translates slot ids (SGLang's "
            f"{type(getattr(runner, 'token_to_kv_pool_allocator', None)).__name__}: a unified SWA/Mamba allocator "
            "or a fused draft); capture copies rows by the ids a CUDA-graph replay was captured with, which are "
            "physical there while records are gathered by virtual ones: not supported with --hs-dump-dir")


def _unaccounted() -> int:
    """The status file's `unaccounted`: admission's (tickets and held requests), and the finish worker's
    jobs handed over without a ticket (a request whose ticket a reconcile dropped): their outcome is not
    counted yet either."""
    return _admission.unaccounted() + (_finisher.untracked if _finisher else 0)


def node_writers(par) -> dict:
    """This node's share of the writers (SGLang --nnodes), the manifest's node fields: dp_ranks (the DP
    attention groups whose writer runs on this node, capture_spec.node_dp_ranks), dp_size, nnodes, node_rank."""
    from sglang_hs.server.capture_spec import node_dp_ranks

    tp, dp, nnodes, node = (int(getattr(par, k, 0) or d) for k, d in
                            (("tp_size", 1), ("attn_dp_size", 1), ("nnodes", 1), ("node_rank", 0)))
    return {"dp_ranks": node_dp_ranks(tp, dp, nnodes, node), "dp_size": dp, "nnodes": nnodes, "node_rank": node}


def _recorded_prompt_len(req):
    """The prompt length of `req`'s record when it is not len(input_ids): a session turn's record holds
    the session's whole context (sglang_hs/server/store/session_turns.py)."""
    s = _scheduler
    if s is None or getattr(req, "session_params", None) is None:
        return None
    from sglang_hs.server.store.session_turns import turn_prompt_len

    return turn_prompt_len(req, getattr(s, "session_controller", None), getattr(s, "tokenizer", None),
                           radix_native=bool(getattr(s, "enable_session_radix_cache", False)))


def _default_staging_rows(runner) -> int:
    """The most rows one forward is expected to carry, as SGLang sizes its own routed-experts buffer:
    a prefill chunk, a decode batch or the largest decode graph. Larger eager steps are shipped in
    chunks (staging.py); a graph larger than the stage is refused at capture."""
    from sglang.srt.runtime_context import get_exec, get_schedule

    sched = get_schedule()
    prefill = sched.chunked_prefill_size if sched.chunked_prefill_size and sched.chunked_prefill_size > 0 \
        else sched.max_prefill_tokens
    graphs = getattr(get_exec().graph, "cuda_graph_config", None)
    decode_graph = getattr(getattr(graphs, "decode", None), "max_bs", None)
    # ModelRunner.max_running_requests is set by alloc_memory_pool: before it, the scheduler's setting
    running = getattr(runner, "max_running_requests", None) or sched.max_running_requests
    return max(int(prefill or 0), int(running or 0), int(decode_graph or 0), 1)


def _alloc_memory_pool(self, *args, **kwargs):
    """ModelRunner.alloc_memory_pool: SGLang sizes the KV pool from the device memory free at this point
    (for MLA models once, before graph capture). The staging buffers are made later, with the store, so
    on the writer rank their bytes are held here first: the pool then leaves room for them, instead of
    the stage coming out of the graph and activation headroom of rank 0 alone."""
    global _reserved
    rows = _staging_reservation_rows(self)
    if rows:
        import torch

        from sglang_hs.server.store.staging import device_bytes

        spec = self.model.hs_spec
        nbytes = device_bytes(rows, spec.rows_per_token, spec.hidden_size,
                                      torch.empty(0, dtype=self.model_config.dtype).element_size())
        try:
            _reserved = (rows, torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        except torch.OutOfMemoryError:
            raise RuntimeError(f"sglang-hs: no room for the {rows}-row staging buffers ({nbytes / 1e9:.2f} GB) on "
                               f"{self.device}; lower --hs-staging-rows, or use --hs-copy direct") from None
        logger.info("sglang-hs staging: %d rows, %.2f GB of device memory held before the KV pool is sized",
                    rows, nbytes / 1e9)
    return ORIGINALS["alloc_memory_pool"](self, *args, **kwargs)


def _staging_reservation_rows(runner) -> int:
    """Rows to hold device memory for: 0 unless this is the writer rank of a capturing server with
    --hs-copy staging or deferred on an accelerator (on the CPU engine the stage is host memory, like the pool)."""
    from sglang_hs import envs

    if envs.SGLANG_HS_COPY not in ("staging", "deferred") or str(runner.device).startswith("cpu"):
        return 0
    if getattr(runner.model, "hs_spec", None) is None or getattr(runner, "is_draft_worker", False):
        return 0
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    if par.attn_tp_rank != 0 or getattr(par, "attn_cp_rank", 0) != 0:
        return 0
    return envs.SGLANG_HS_STAGING_ROWS or _default_staging_rows(runner)


def _forward(self, forward_batch, *args, **kwargs):
    """ModelRunner.forward: every step the scheduler makes, whether the model runs eagerly or a CUDA graph
    is replayed (a replay runs none of the overlay's Python). The overlay's status counts the step here
    (its real rows, no graph padding, and its request ids), and a staging writer ships what it wrote.
    Graph capture and warm-up passes call the model directly and are not counted."""
    if getattr(self, "is_draft_worker", False):
        return ORIGINALS["forward"](self, forward_batch, *args, **kwargs)
    status = getattr(self.model, "hs_status", None)
    w = _writer if _writer is not None and _writer.staging is not None else None  # direct copy: no step work
    if _finisher and w is None:
        _finisher.order_device_writes()  # CUDA direct: the step's copy waits for pending gathers, on the GPU
    if w is None and status is None:
        return ORIGINALS["forward"](self, forward_batch, *args, **kwargs)
    # Read before the forward: an eager step may pad out_cache_loc in place to keep ranks' token counts
    # equal (DeepEP and other all-to-all MoE backends, --moe-dense-tp-size) and never trims it back.
    loc = getattr(forward_batch, "out_cache_loc_virtual", None)
    loc = forward_batch.out_cache_loc if loc is None else loc
    rows = 0 if loc is None else int(loc.shape[0])
    if w is not None:
        w.before_step()
    out = ORIGINALS["forward"](self, forward_batch, *args, **kwargs)
    if w is not None:
        w.after_step(rows, bool(getattr(out, "can_run_graph", False)))
    if status is not None:
        status.record(forward_batch.forward_mode.name, rows, getattr(forward_batch, "rids", None))
    return out


def _after_collect(self, req) -> None:
    ORIGINALS["_maybe_collect_routed_experts"](self, req)
    if _writer is None:
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from sglang_hs.server.patches.warmup_rid import PREFIX as WARMUP

    if isinstance(req.finished_reason, FINISH_ABORT) or str(req.rid).startswith(("HEALTH_CHECK", WARMUP)):
        _admission.release(req.rid, req)
        return  # aborted requests, health checks and SGLang's start-up warm-up are not emitted
    # this request's own ticket (a rid used again has one per request): its decision, its ring room
    ticket = _admission.finish(req.rid, req)
    did_well = _draft_did_well(req)  # every finished request counts in the recent traffic (-lowest)
    if ticket is not None and ticket.decision is not None:  # served without capture: at most a marker record
        _publish_marker(self, str(req.rid), *ticket.decision, ticket=ticket)
        return
    if did_well:  # --hs-capture-accept-below / -lowest: its rows are not what the next draft needs
        _admission.stats["skipped_draft_accepted"] += 1
        _publish_marker(self, str(req.rid), "draft_accepted", True, ticket=ticket)
        return
    tokens = _token_record(req.origin_input_ids, req.output_ids_through_stop)
    if not tokens:  # nothing forwarded and nothing sent (an empty prompt that generated nothing): no record
        _admission.drop(ticket)
        return
    T = len(tokens) - 1  # every prompt token, every generated token but the last
    slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx][:T]
    # where the prompt ends, and the last token (no row): the record then holds the whole exchange
    said = dict(prompt_len=len(req.origin_input_ids), next_token=int(tokens[T]), meta=record_meta(req))
    worker = _finish_worker(self)
    if worker is not None:  # the worker gathers and publishes; the reservation goes when it is done
        # a record in parts, or any behind one: its KV slots held until gathered (hold_finished_kv); never a
        # streaming session's request, whose row SGLang keeps for the next turn
        streaming = getattr(getattr(req, "session", None), "streaming", False)
        held = bool(_part_bytes) and not streaming and worker.holds(T)
        seq = worker.submit(str(req.rid), tokens[:T], slots, **said, ticket=ticket, held=held)
        if held:
            from sglang_hs.server.patches import hold_finished_kv

            hold_finished_kv.hold(req, seq, worker, _writer.stats)
        return
    try:
        _writer.finish(str(req.rid), tokens[:T], slots, **said)
    except (TimeoutError, ValueError) as e:  # cannot happen for admitted requests; loudly, not the server
        _writer.stats["dropped"] += 1
        logger.error("sglang-hs: record of request %s NOT published: %s", req.rid, e)
    finally:  # after its outcome is counted: the status file's unaccounted
        _admission.drop(ticket)


def accept_length(req) -> Optional[float]:
    """SGLang's spec_accept_length of a request (completion tokens per verify step, the bonus token included:
    tokenizer_manager's meta_info), or None before its first verify step. Completion tokens are those through
    the stop (`output_ids_through_stop`, SGLang's completion_tokens): a verify step appends its whole accepted
    run, which can reach past an EOS, a stop string or max_new_tokens."""
    verifies = getattr(req, "spec_verify_ct", 0) or 0
    return len(req.output_ids_through_stop) / verifies if verifies > 0 else None


def _step_accepted(self, num_correct_drafts: int) -> None:
    """Req.update_spec_correct_drafts_histogram, called once per verify step of a request with the drafts it
    accepted (the bonus token not counted): SGLang keeps their histogram, the record keeps them in order. Called
    as SGLang processes the step's result, after waiting for the step's copies to the host: the draft's confidence
    of this step and every earlier one is on the host by then (_resolve_confidence)."""
    ORIGINALS["update_spec_correct_drafts_histogram"](self, num_correct_drafts)
    steps = getattr(self, "hs_accepted_drafts", None)
    if steps is None:
        steps = self.hs_accepted_drafts = array("H")
    steps.append(min(int(num_correct_drafts), 0xFFFF))
    if getattr(self, "hs_confidence_pending", None):
        _resolve_confidence(self, len(steps))


def _observe_verify_step(self, **kw) -> None:
    """DsparkStepObservers.observe_verify_step, called by DSparkWorkerV2 once per verify pass of a batch with its
    requests (`reqs`, batch order) and the draft's confidence of each of their drafts (`confidence` [bs, gamma],
    the confidence head's, None without one): each request's mean over its drafts, kept step by step.

    It runs inside the forward, so it never waits for the device: the means are computed at once (the confidence
    is a view of the draft sampler's buffer, which the next step rewrites) and, on a GPU, queued to the host
    behind the forward on its stream; SGLang's result processing waits for the batch's copies (copy_done: its copy
    stream waits for the forward stream), and only then does _step_accepted read them (_resolve_confidence)."""
    ORIGINALS["observe_verify_step"](self, **kw)
    confidence = kw.get("confidence")
    if _writer is None:
        return
    if confidence is None:  # no confidence head
        if getattr(_selection, "confidence_below", None) is not None:
            _warn_no_confidence_head()
        return
    means = confidence[: kw["bs"]].float().mean(dim=1)
    if means.device.type != "cpu":
        means = means.to("cpu", non_blocking=True)  # pinned, read once the step's result is processed
    for i, req in enumerate(kw["reqs"]):
        pending = getattr(req, "hs_confidence_pending", None)
        if pending is None:
            pending = req.hs_confidence_pending = collections.deque()
        pending.append((means, i))


def _retracted(self) -> None:
    """Req.reset_for_retract: the request leaves the batch to come back later. The scheduler retracts it while
    choosing the next batch, before it processes the result of the pass just run (overlap scheduler), and that
    result skips a retracted request: no verify step is counted for that pass, so its pending confidence (the
    only one not yet read: every earlier pass was processed) is dropped, or every later step would get the mean
    of the step before."""
    ORIGINALS["reset_for_retract"](self)
    pending = getattr(self, "hs_confidence_pending", None)
    if pending:
        pending.clear()


_said_no_head = False


def _warn_no_confidence_head() -> None:
    """Once per process: --hs-capture-confidence-below with a DSpark draft that computes no confidence (its config
    has no confidence head), so every request keeps its record."""
    global _said_no_head
    if not _said_no_head:
        _said_no_head = True
        logger.warning("sglang-hs: --hs-capture-confidence-below, but the DSpark draft computes no confidence (its "
                       "config has no confidence head): every captured request keeps its record")


def _resolve_confidence(req, steps: int) -> None:
    """The means of `req`'s first `steps` verify steps, from the pending host copies (oldest first) into
    hs_draft_confidence: called once those steps' results are processed, so their copies are complete."""
    done = getattr(req, "hs_draft_confidence", None)
    if done is None:
        done = req.hs_draft_confidence = array("d")
    pending = req.hs_confidence_pending
    while pending and len(done) < steps:
        means, i = pending.popleft()
        done.append(float(means[i]))


def confidence_steps(req) -> list:
    """The draft's mean confidence over each verify step's drafts of `req` (SGLang's DSpark confidence head), as
    many steps as it accepted drafts at (hs_accepted_drafts): a pass the scheduler ran past the request's finish
    is not its. Empty without a confidence head."""
    steps = len(getattr(req, "hs_accepted_drafts", None) or ())
    if getattr(req, "hs_confidence_pending", None):
        _resolve_confidence(req, steps)
    return list((getattr(req, "hs_draft_confidence", None) or ())[:steps])


def record_meta(req) -> bytes:
    """A record's metadata (ring.encode_meta): under speculative decoding, the drafts each verify step of the
    request accepted, in order (its accept length at step i is accepted_drafts[i] + 1, the bonus token), and with
    a DSpark confidence head the draft's mean confidence over each step's drafts (`confidence`, 4 decimals)."""
    from sglang_hs.server.store.ring import encode_meta

    steps = getattr(req, "hs_accepted_drafts", None)
    if not steps:
        return b""
    spec = {"verify_steps": len(steps), "accepted_drafts": steps.tolist()}
    confidence = confidence_steps(req)
    if confidence:
        spec["confidence"] = [round(c, 4) for c in confidence]
    return encode_meta({"speculative": spec})


def _draft_did_well(req) -> bool:
    """Whether the draft did well enough on `req` for its record to be dropped (--hs-capture-accept-below L:
    an accept length of L or more; --hs-capture-accept-lowest F: not in the lowest F of recent traffic;
    --hs-capture-confidence-below C: a mean draft confidence of C or more; store/draft_selection.py). Opted-in
    requests and those without a verify step are kept. Called once per finished request, in finish order."""
    if _selection is None or not _selection.active:
        return False
    from sglang_hs.server.store.admission import opted_in

    from sglang_hs.server.store.draft_selection import mean_confidence

    return _selection.did_well(accept_length(req), opted_in(req), mean_confidence(confidence_steps(req)))


def _token_record(prompt, output) -> array:
    """The prompt's tokens then the generated ones, as one int64 array (SGLang 0.5.23 keeps both as
    array('q'): a copy at memory speed, about 2 us for 2,000 tokens where lists of Python ints took 26 us
    on the scheduler thread); the finish worker converts it. Any other sequence of ints is taken too."""
    tokens = array("q", prompt)
    if isinstance(output, array) and output.typecode != "q":  # extend() takes only an array of its own kind
        output = output.tolist()
    tokens.extend(output)
    return tokens


def _publish_marker(processor, rid: str, reason: str, marked: bool, ticket=None) -> None:
    """The marker record of a request admitted without capture, when admission reserved room for it."""
    if not marked:
        _admission.drop(ticket)
        return
    worker = _finish_worker(processor)
    if worker is not None:  # in order with the records; the reservation goes when it is published
        worker.submit_marker(rid, reason, ticket=ticket)
        return
    try:
        _writer.publish_marker(rid, reason)
    except (TimeoutError, ValueError) as e:
        _writer.stats["dropped"] += 1
        logger.error("sglang-hs: marker of request %s NOT published: %s", rid, e)
    finally:  # after its outcome is counted: the status file's unaccounted
        _admission.drop(ticket)


def _finish_worker(processor):
    """The finish worker of this writer (sglang_hs/server/store/finisher.py), made on the first finish, once the
    KV allocator is known; None: the synchronous path (SGLANG_HS_SYNC_FINISH, or an allocator the worker
    is not checked with, said once in the log)."""
    global _finisher
    if _finisher is not None:
        return _finisher or None
    from sglang_hs import envs

    if envs.SGLANG_HS_SYNC_FINISH:
        _finisher = False
        return None
    from sglang_hs.server.store.finisher import FinishWorker, check_allocator

    why = check_allocator(processor.token_to_kv_pool_allocator)
    if why is not None:
        logger.warning("sglang-hs: finished records are published on the scheduler thread: %s", why)
        _finisher = False
        return None
    import atexit

    worker = FinishWorker(_writer, on_done=_admission.release_reservation)
    if _part_bytes:
        worker.enable_parts(_part_bytes)
        worker.part_room, worker.part_room_done = _admission.part_room, _admission.part_room_done
    allocator = processor.token_to_kv_pool_allocator
    if str(getattr(allocator, "device", "cpu")).startswith("cuda"):
        worker.watch_allocator(allocator)  # the GPU's waits narrowed to the gathers a step's slots may need
    atexit.register(worker.close)  # shutdown publishes what was handed over
    _finisher = worker
    return worker


def _get_next_batch_to_run(self, *args, **kwargs):
    """Scheduler.get_next_batch_to_run, at the start of every iteration: take the worker's results
    (admission reservations of published records go back), without waiting for it."""
    if _finisher:
        _finisher.poll()
    return ORIGINALS["get_next_batch_to_run"](self, *args, **kwargs)


def _on_idle(self, *args, **kwargs):
    """Scheduler.on_idle: take the worker's results without waiting for it. Nothing of the KV pool is
    held (finisher.py), so SGLang's idle leak check (available + evictable == total) sees its own pool
    as it is; a gather still running only delays its own record, not the intake of new requests. With
    records in parts (--hs-record-part-size) the KV of requests whose records are not gathered yet is held
    (hold_finished_kv: the scheduler is not idle then, and no leak check runs): the releases now due are made,
    and while some are left a turn waits up to 5 ms for the worker instead of spinning."""
    if _finisher:
        _finisher.poll()
        if _part_bytes and _release_held():  # waiting for the reader: a short wait for the worker, not a spin
            _finisher.wait_progress(0.005)
    return ORIGINALS["on_idle"](self, *args, **kwargs)


def _release_held() -> int:
    """SGLang's KV releases held for records now gathered, made (hold_finished_kv); returns how many are left."""
    from sglang_hs.server.patches import hold_finished_kv

    return hold_finished_kv.release_done()


def _ingest_requests(self, *args, **kwargs):
    """Scheduler.ingest_requests, first in every iteration of both event loops: on CUDA mark the
    iteration's start on the stream (FinishWorker.mark_iteration), after the previous iteration's result
    processing and before this iteration's launch. This iteration's hand-overs copy their slot ids after
    it, those of a pause_generation(retract) inside the intake too (it processes the last batch's
    results there)."""
    global _scheduler
    _scheduler = self
    if _writer is not None:  # both finish paths copy slot ids after it (slot_ids.py)
        _writer.slot_ids.mark_iteration()
    return ORIGINALS["ingest_requests"](self, *args, **kwargs)


def _known_rids():
    s = _scheduler
    if s is None:
        return None
    rids = {r.rid for r in s.waiting_queue}
    if _finisher:  # finished, handed to the worker, not yet published: still reserved
        rids.update(_finisher.pending_rids())
    for msg in getattr(s, "_deferred_input_requests", ()):  # pulled, not yet handled (e.g. behind a pause)
        batch = getattr(msg, "batch", None)  # Batch{Generate,Embedding}ReqInput: the rids are its members'
        rids.update(getattr(r, "rid", None) for r in (batch if isinstance(batch, list) else (msg,)))
    grammar = getattr(s, "grammar_manager", None)  # requests waiting for their grammar to compile
    rids.update(r.rid for r in getattr(grammar, "grammar_queue", ()))
    # pulled and admitted, held back by SGLang before the waiting queue: the colocated-batch input blocker
    # (SGLANG_ENABLE_COLOCATED_BATCH_GEN) and, language-only under EPD, the multimodal receiver's waiting list
    for pending in (getattr(getattr(s, "input_blocker", None), "_pending_reqs", ()),
                    getattr(getattr(s, "mm_receiver", None), "waiting_list", ())):
        for msg in pending or ():
            batch = getattr(msg, "batch", None)
            rids.update(getattr(r, "rid", None) for r in (batch if isinstance(batch, list) else (msg,)))
    for batch in (s.running_batch, s.last_batch):
        if batch is not None:
            rids.update(r.rid for r in batch.reqs)
    if s.chunked_req is not None:
        rids.add(s.chunked_req.rid)
    return rids


def _pull_raw_reqs(self):
    if _finisher:  # reservations of records published meanwhile go back before admission decides
        _finisher.poll()
        if _part_bytes:  # and the KV slots of requests whose records are gathered now, before scheduling
            _release_held()
    pulled = ORIGINALS["_pull_raw_reqs"](self)
    if _admission is None or pulled is None:
        return pulled
    return _admission.filter(pulled, _known_rids)


def apply():
    import sglang
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as BatchResultProcessor,
    )
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.dspark_components.dspark_observability import DsparkStepObservers

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs capture hooks target sglang {SGLANG_VERSION}, found {sglang.__version__}")
    ORIGINALS["init_routed_experts_capturer"] = ModelRunner.init_routed_experts_capturer
    ORIGINALS["_maybe_collect_routed_experts"] = BatchResultProcessor._maybe_collect_routed_experts
    ORIGINALS["ingest_requests"] = Scheduler.ingest_requests
    ORIGINALS["_pull_raw_reqs"] = SchedulerRequestReceiver._pull_raw_reqs
    ORIGINALS["forward"] = ModelRunner.forward
    ORIGINALS["alloc_memory_pool"] = ModelRunner.alloc_memory_pool
    ORIGINALS["get_next_batch_to_run"] = Scheduler.get_next_batch_to_run
    ORIGINALS["on_idle"] = Scheduler.on_idle
    ORIGINALS["update_spec_correct_drafts_histogram"] = Req.update_spec_correct_drafts_histogram
    ORIGINALS["observe_verify_step"] = DsparkStepObservers.observe_verify_step
    ORIGINALS["reset_for_retract"] = Req.reset_for_retract
    ModelRunner.init_routed_experts_capturer = _after_init_capturers
    BatchResultProcessor._maybe_collect_routed_experts = _after_collect
    Scheduler.ingest_requests = _ingest_requests
    SchedulerRequestReceiver._pull_raw_reqs = _pull_raw_reqs
    ModelRunner.forward = _forward
    ModelRunner.alloc_memory_pool = _alloc_memory_pool
    Scheduler.get_next_batch_to_run = _get_next_batch_to_run
    Scheduler.on_idle = _on_idle
    Req.update_spec_correct_drafts_histogram = _step_accepted
    DsparkStepObservers.observe_verify_step = _observe_verify_step
    Req.reset_for_retract = _retracted
    return dict(ORIGINALS)
