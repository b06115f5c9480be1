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
|                   | Scheduler.ingest_requests (to see its queues;|                  |
|                   | on CUDA mark each iteration's start for the  |                  |
|                   | finish hand-over's slot-id copy),            |                  |
|                   | ModelRunner.forward (count each step in      |                  |
|                   | the status; step hooks of --hs-copy staging) |                  |
|                   | and ModelRunner.alloc_memory_pool (hold the  |                  |
|                   | staging buffers' device memory before the KV |                  |
|                   | pool is sized); Req.update_spec_correct_     |                  |
|                   | drafts_histogram (each verify step's         |                  |
|                   | accepted drafts, in order, for the record);  |                  |
|                   | DsparkStepObservers.observe_verify_step      |                  |
|                   | (each DSpark verify step's draft confidence) |                  |
| warmup_rid        | wraps TokenizerManager.generate_request: a   | capture on, HTTP |
|                   | rid-less request before the server is Up     | server process   |
|                   | gets the rid HS_WARMUP-<hex>                 | (serve.py)       |
| parallel_sampling | wraps TokenizerManager._handle_batch_request | capture on, HTTP |
|                   | and ._send_one_request: the max_new_tokens=0 | server process   |
|                   | prefix request of an n > 1 request is tagged | (serve.py)       |
|                   | (custom_params): no record                   |                  |
| sigterm_watchdog  | wraps TokenizerManager.sigterm_watchdog and  | every server,    |
|                   | SignalHandler.sigterm_handler: the shutdown  | HTTP server      |
|                   | starts when SIGTERM arrives (an event), not  | process          |
|                   | at the watchdog's next 5 s look at the flag  | (serve.py)       |
| cpu_gloo_groups   | wraps GroupCoordinator.__init__: no PyNccl   | CPU mode, every  |
|                   | communicator for a group on the CPU device;  | spawned process  |
|                   | and .reduce_scatterv: without PyNccl, a CPU  |                  |
|                   | tensor takes SGLang's all-reduce + narrow    |                  |
| kimi_k25_language_| rebinds kimi_k25.DeepseekV3ForCausalLM to    | while the Kimi-  |
| model             | the overlay's class, restored afterwards     | K2.5 overlay is  |
|                   |                                              | constructed      |
| torch_native_cpu_ | gives TorchNativeAttnBackend the padded seq- | CPU mode only    |
| pad               | len fill value only the AMX backend defines  |                  |
| torch_native_     | wraps TorchNativeAttnBackend._run_sdpa_      | CPU mode only    |
| extend            | forward_extend: a chunk's queries only; and  |                  |
|                   | .forward_extend: DP padding requests zeros   |                  |
| moe_native_ep     | wraps fused_moe_native.moe_forward_native:   | CPU mode only    |
|                   | other ranks' experts (id -1) are skipped     |                  |
| dsa_torch_native  | replaces dsa_indexer.Indexer.forward_native  | CPU mode only    |
|                   | (a plain-torch DSA indexer); wraps           |                  |
|                   | TorchNativeAttnBackend.forward_extend/decode |                  |
|                   | to attend over the indexer's top-k keys      |                  |
| dsa_cpu_server_   | DSA configs' server-argument resolution on   | CPU mode, HTTP   |
| args              | CPU: no GPU capability query or FP8/DSA      | server process   |
|                   | kernel defaults; torch_native, page size 1   | (serve.py)       |
| spec_verify_torch_| wraps TorchNativeAttnBackend.forward_extend: | CPU mode only    |
| native            | a TARGET_VERIFY batch attends over each      |                  |
|                   | request's prefix and its draft tree          |                  |
| dsa_spec_verify   | wraps dsa_torch_native's Indexer.forward_    | CPU mode only    |
|                   | native and TorchNativeAttnBackend.forward_   |                  |
|                   | extend: in TARGET_VERIFY each draft row's    |                  |
|                   | top-k and sparse attention within its tree   |                  |
| eagle_cpu_draft   | DeepseekV2ForCausalLM.set_embed_and_head     | CPU mode only    |
|                   | without CUDA calls on a CPU device; a        |                  |
|                   | torch_native draft-extend backend and a      |                  |
|                   | torch_native multi-step draft decode backend |                  |
|                   | in DraftBackendFactory._create_backend       |                  |
| dsv4_torch_native | DeepSeek-V4 sliding-window, CSA (ratio 4)    | CPU mode only    |
|                   | and HCA (ratio 128) layers: plain MHA        |                  |
|                   | pool (kv_cache_configurator.is_deepseek_v4   |                  |
|                   | says no), MQALayer.forward as HF's windowed  |                  |
|                   | attention with sinks (+ CSA/HCA block keys   |                  |
|                   | and the CSA indexer's top-k, from per-token  |                  |
|                   | sources at the KV slots),                    |                  |
|                   | hc_pre/hc_post/hc_head                       |                  |
|                   | in torch; MQALayer.__init__ without the CPU  |                  |
|                   | rope factory's YaRN assertion                |                  |
| dsv4_cpu_spec     | V4 with its MTP draft (EAGLE/NEXTN, a chain  | CPU mode only    |
|                   | of drafts): dsv4_torch_native.requests_of    |                  |
|                   | gets a TARGET_VERIFY branch (each request's  |                  |
|                   | drafts a causal span after its prefix; a     |                  |
|                   | tree refused) and the draft's decode steps   |                  |
|                   | (a token at its position); DeepseekV4ForCau- |                  |
|                   | salLM.set_                                   |                  |
|                   | embed_and_head without CUDA calls on CPU     |                  |
| dsv4_cpu_dspark   | V4 with its DSpark draft (DSPARK, one rank): | CPU mode, a      |
|                   | dspark_worker_v2's draft backend torch_      | DSPARK server    |
|                   | native; DSparkAttention.forward (context     | only             |
|                   | window + whole block, sinks) and DeepseekV4- |                  |
|                   | ForCausalLMDSpark.write_target_hidden_kv     |                  |
|                   | (commit gate) in torch on the MHA pool;      |                  |
|                   | Tensor.record_stream a no-op on CPU tensors; |                  |
|                   | dspark_accept's chain rejection sampling in  |                  |
|                   | torch on CPU tensors (sampled requests)      |                  |
| dsv4_cpu_moe      | V4's clamped SwiGLU: deepseek_v2.silu_and_   | CPU mode only    |
|                   | mul_clamp (shared expert) and moe_forward_   |                  |
|                   | native's activation (routed experts)         |                  |
| dsv4_cpu_server_  | V4 configs' server arguments on CPU:         | CPU mode, HTTP   |
| args              | torch_native, page 1, no hybrid SWA pools,   | server process   |
|                   | KV dtype auto; CPU_ENV (mHC kernels off) in  | (serve.py)       |
|                   | the environment its schedulers inherit;      |                  |
|                   | speculative_hook._handle_dspark past its     |                  |
|                   | device check on CPU                          |                  |
| dp_controller_    | replaces DataParallelController.event_loop   | CPU mode, every  |
| idle_wait         | with --sleep-on-idle: drained as upstream,   | spawned process  |
|                   | then a zmq poll instead of spinning a core   | of a DP server   |
| dsv4_cpu_tp       | wraps update_config.adjust_config_with_      | CPU mode, every  |
|                   | unaligned_cpu_tp: a V4 config keeps its head | spawned process  |
|                   | counts (one MQA KV head) under --tp > 1      |                  |
| cpu_inplace_all_  | registers SGLang's sglang::inplace_all_reduce| CPU mode only    |
| reduce            | op for the CPU dispatch key (its own         |                  |
|                   | function): integer DP-attention gathers      |                  |
| hold_finished_kv  | wraps batch_result_processor.release_kv_     | capture on, with |
|                   | cache: a finished request whose record is    | --hs-record-part-|
|                   | published in parts (or behind one) gives its | size             |
|                   | KV back once gathered; Scheduler.is_fully_   |                  |
|                   | idle, SchedulerInvariantChecker._requests_   |                  |
|                   | owning_rows count what is held               |                  |
| hc_full_streams   | rebinds deepseek_v4.AuxHiddenStatePacker to  | the V4 overlay   |
|                   | hc_mult x H wide slots and mhc.mhc_stream_   | built with       |
|                   | mean to write the streams into such a slot   | --hs-hc-streams  |
|                   |                                              | full             |

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
            is `_pull_raw_reqs` (sglang_hs/server/store/admission.py says why). The staging strategy must ship
            what a CUDA-graph replay wrote after every step, which runs no Python of the model: the
            point after `ModelRunner.forward` returns, where SGLang calls its capturers' `on_forward_end`.
            The same point counts every step in the overlay's status (a replay skips the model's
            Python, and capture passes call the model without ModelRunner.forward).
            Under speculative decoding a record carries each verify step's accepted drafts in order
            (its metadata): SGLang keeps only their count and histogram per request, and calls
            `Req.update_spec_correct_drafts_histogram` once per step with that step's count, so the
            wrap appends it to a per-request array (2 bytes a step). A DSpark draft with a confidence head
            (SGLANG_RAGGED_VERIFY_MODE cap-accept) gives each draft a confidence that SGLang uses for its
            verify schedule and its debug dump only; `DsparkStepObservers.observe_verify_step` (once per verify
            pass, the batch's requests and their [bs, gamma] confidence) is wrapped to keep each request's rows
            (record metadata `confidence`; --hs-capture-confidence-below).
            SGLang sizes the KV pool from the device memory free when `alloc_memory_pool` runs (for
            MLA models once, before graph capture: no post-capture resize), and the store is made only
            after it; so the staging buffers' device bytes are held just before, and handed to the
            stage after, or rank 0 alone would take them out of its graph and activation headroom.
  upstream: no extension point for per-token capturers in 0.5.23 besides these.
  removal:  if SGLang grows a capturer registry or a `sglang.srt.plugins` hook at both points, move
            there. A change of either method's name or signature fails `apply()` loudly (AttributeError
            at start-up) and the version gate refuses any sglang but 0.5.23.

            Finished records are published by a worker thread (sglang_hs/server/store/finisher.py); the KV
            allocator is not touched: the next write of a slot into the store waits for the gathers
            that read it (the CPU forward's copy, the staging scatter thread, or on CUDA with the
            direct copy a stream wait issued in the ModelRunner.forward hook). Scheduler.
            get_next_batch_to_run, Scheduler.on_idle and _pull_raw_reqs take the worker's results
            without waiting for it.
hold_finished_kv
  why:      a record in parts (--hs-record-part-size) leaves the ring as the reader makes room, so its gather
            may wait for the reader; SGLang frees a finished request's KV slots at once, and a forward step that
            reused one would then wait for the reader too. Holding SGLang's own release call (whole: radix insert,
            frees, unlock, req_to_token row) until the gather is done keeps the slots allocated, so SGLang
            schedules around them instead (its module docstring says what else it patches and why).
  upstream: none: SGLang 0.5.23 frees at once (batch_result_processor.py, both release_kv_cache calls after
            _maybe_collect_routed_experts); only disaggregation defers releases, its own way.
  removal:  if SGLang grows a hook to delay a finished request's KV release; tests/e2e/test_record_parts.py's
            stalled-reader test shows forward copies waiting for gathers (store_write_waits) without it.

warmup_rid
  why:      SGLang's own warm-up request has no rid, so its record would reach readers like a user's.
  upstream: no way to name the warm-up request in 0.5.23.
  removal:  if SGLang gives its warm-up request a recognisable rid (as it does for HEALTH_CHECK).

parallel_sampling
  why:      for n > 1 SGLang first sends each prompt as a max_new_tokens=0 request under a fresh random rid
            (to warm the radix cache), then the n choices under rids of their own; the scheduler cannot
            tell that prefix request from a user's prompt-only request, so it would leave a record nobody
            asked for (holding ring space for good with an acknowledging reader). The first batch_size
            requests an n > 1 request sends are its prefix requests: each is tagged on its own copy of the
            sampling params, and admission serves it without a record or marker.
  upstream: present in sglang 0.5.23 (tokenizer_manager.py, _handle_batch_request, "Cache the common
            prefix for parallel sampling"); nothing to report (the prefix request is SGLang's business).
  removal:  if SGLang marks the prefix request itself; tests/e2e/test_request_contract.py's n > 1 test
            fails (an extra prompt-only record) without it.

sigterm_watchdog
  why:      SGLang's SIGTERM handler only sets TokenizerManager.gracefully_exit, and the task that drains and
            stops the server looks at it every 5 s: each stop (a user's Ctrl-C of the launcher, every test
            server's teardown) idled 0 to 5 s, 2.5 s on average, before the drain began. The handler also sets an
            asyncio event the watchdog waits on (upstream's 5 s look stays as the fallback); the original
            watchdog then runs unchanged (drain, ShutdownReq, kill of the process tree).
  upstream: present in sglang 0.5.23 (tokenizer_manager.py, sigterm_watchdog: `await asyncio.sleep(5)`);
            not reported upstream.
  removal:  when SGLang wakes its watchdog on the signal; SGLANG_HS_DISABLE_PATCHES=sigterm_watchdog turns it
            off (tests/unit/test_sigterm_watchdog.py compares the two).

cpu_gloo_groups
  why:      with --tp > 1 on the CPU engine every parallel group asks for a PyNccl communicator, whose
            constructor fails on a CPU device ("Expected a cuda device, but got: cpu"), so no CPU server
            with more than one rank starts. The coordinator's CPU paths never use it: all-reduce goes
            to SGLang's shared-memory kernel (AMX / arm64 only) or else to torch.distributed on the
            group's gloo group, which is what runs here. Only `use_pynccl` changes, only for CPU groups.
            The one coordinator method with no CPU branch, `reduce_scatterv` (used by DP attention with
            expert parallel, ep size = dp size = tp size, to return the MoE output to each DP group:
            layers/moe/utils.py should_use_dp_reduce_scatterv), then fails on the missing communicator
            (AttributeError at warm-up); for a group without PyNccl and a CPU tensor it goes to SGLang's
            own `_deterministic_reduce_scatterv` (all-reduce of a copy, then this rank's rows).
  upstream: present in sglang 0.5.23 (parallel_state.py, init_model_parallel_group: use_pynccl is
            off only for NPU, XPU and mooncake; GroupCoordinator.reduce_scatterv calls
            pynccl_comm.change_state unconditionally); not reported upstream by us yet.
  removal:  when the pinned sglang turns PyNccl off for CPU groups and gives reduce_scatterv a CPU
            branch; tests/e2e/test_multi_rank.py starts a --tp 2 CPU server and a --tp 2 --dp 2
            --enable-dp-attention --ep-size 2 one, which fail without it.

torch_native_cpu_pad
  why:      with data-parallel attention every step pads each group's batch to a common size, and on CPU
            `ForwardBatch._pad_inputs_to_size` calls `attn_backend.get_cpu_graph_seq_len_fill_value()`,
            defined in 0.5.23 only by the Intel AMX backend (value 1); without AMX the CPU engine runs
            torch_native and DP attention fails at its first step (AttributeError). Same method, same value.
  upstream: present in sglang 0.5.23 (forward_batch_info.py, _pad_inputs_to_size; torch_native_backend.py
            has no such method); not reported upstream by us yet.
  removal:  when TorchNativeAttnBackend defines the method; tests/e2e/test_multi_rank.py's DP-attention
            + EP server fails at its warm-up without it.

torch_native_extend
  why:      a chunk of a chunked prefill (and any extend after a cached prefix) pads its queries to the
            request's whole length and runs a causal seq_len x seq_len attention, keeping the chunk's rows:
            each chunk costs a full attention over everything before it, so a prompt costs its length
            cubed over the chunk size (8,192 tokens in 512-token chunks: 250 s on 2 cores, the last chunk
            38 s). The chunk's queries attend alone under the causal mask aligned to their positions: the
            same rows (bit-equal on test shapes), extend x seq_len work. Encoder lengths, non-causal and
            sliding-window attention go to the original. Under DP attention a batch padded to a larger
            group's (ForwardBatch._original_batch_size) gives its padding requests zeros: an EAGLE draft's
            extend pads each with a whole draft's tokens after no prefix but seq len 1 ("a request of 1 keys
            extends 4 tokens", the scheduler dead at the first padded draft extend before).
  upstream: present in sglang 0.5.23 (torch_native_backend.py, _run_sdpa_forward_extend:
            per_req_query_redudant); not reported upstream by us yet.
  removal:  when the backend attends only the new queries; tests/e2e/test_long_context.py (32K-token
            prompts in small chunks) does not finish in its time without it.

moe_native_ep
  why:      with --ep-size > 1 the standard dispatcher marks the experts held by other ranks with the drop
            sentinel -1; without AMX the CPU engine runs `moe_forward_native`, which scatters the ids into
            a count table and fails on -1, so no EP server answers a request. SGLang's function runs per
            top-k column on the rows whose entry is local (weight 1: the expert's output as SGLang computes
            it), the outputs times their weights summed in the weights' dtype and cast once; -1 entries are
            never computed; the other ranks add theirs in the all-reduce. tests/unit/test_moe_native_ep.py:
            two ranks' outputs sum to the unsplit function's.
  upstream: present in sglang 0.5.23 (layers/moe/fused_moe_native.py, moe_forward_native: cnts.scatter_
            on topk_ids; token_dispatcher/standard.py keeps -1); not reported upstream by us yet.
  removal:  when moe_forward_native honours the drop sentinel; tests/e2e/test_multi_rank.py's DP-attention
            + EP server fails at its warm-up without it.

hc_full_streams
  why:      DeepSeek-V4's residual is hc_mult streams per token; SGLang's DSpark capture (the V4 overlay's
            default) stores their mean. --hs-hc-streams full keeps every stream for drafters that want them,
            through the same capture sites (every V4 forward path calls mhc_stream_mean into a slot of the
            packer made in the forward), so no upstream forward is copied. Original functions in ORIGINALS.
  upstream: present in sglang 0.5.23 (srt/models/deepseek_v4.py DeepseekV4Model.forward and
            _forward_layers_hc_pre_from_prev; kernels/ops/layernorm/mhc.py mhc_stream_mean).
  removal:  when SGLang can capture the full streams itself; tests/unit/test_hc_streams.py checks the
            packed layout against HF float32 streams, tests/gpu/test_v4_capture_gpu.py end to end.

dsa_torch_native
  why:      DeepSeek-V3.2 (and any DeepSeek-family config carrying `index_topk`, which SGLang serves with DSA)
            cannot run on the CPU engine: `Indexer.forward_native` raises "Indexer has no native (pure-torch)
            path" and `forward_cpu` falls back to it; and the torch_native backend takes no `topk_indices`
            (TypeError), so even a working indexer would meet dense attention. The patch computes the
            indexer as HF transformers' DeepseekV32Indexer does (index keys kept per layer at their KV
            slots, so prefix-cache hits, later chunks and decode see them), and the MLA attention masks
            every key the indexer did not select, as HF's DeepseekV32Attention does. Without a
            `topk_indices` the backend runs unchanged. Only the CPU engine's float32 path: the Hadamard
            rotation and FP8 index keys of the CUDA kernels are not reproduced (HF skips them too). Under DP
            attention a group's IDLE batch (padded rows, no requests, no extend lengths: upstream's fields are
            None) selects nothing and attends to nothing (zeros), as dsv4_torch_native does.
  upstream: present in sglang 0.5.23 (srt/layers/attention/dsa/dsa_indexer.py forward_native;
            torch_native_backend.py forward_extend/forward_decode have no **kwargs); not reported upstream.
  removal:  when SGLang gives the indexer a native path and the torch_native backend a sparse one;
            tests/e2e/test_model_family.py serves the tiny V3.2 (index_topk 11 below its prompts' lengths;
            "v32-tp2", and "v32-dp2" under DP attention) and judges every row against HF float32, which fails
            without it (the server does not start) and with a planted top-k or dense-attention bug;
            tests/unit/test_dsa_dp_idle.py, the IDLE batch.

dsa_cpu_server_args
  why:      SGLang 0.5.23 resolves a DSA config (srt/arg_groups/model_hook.py, handle_model_specific_adjustments;
            overrides.py _dsa_kv_cache_dtype_default, _dsa_split_backend_resolution) as if every platform but
            NPU and XPU were a GPU: `torch.cuda.get_device_capability()` fails on the CPU engine ("Found no
            NVIDIA driver") and the defaults are FP8 KV cache, DSA kernels, the "dsa" backend and 64-token
            pages. In CPU mode the capability query answers (0, 0) during that one call, the two GPU passes
            are skipped, and a provider declared after upstream's sets attention_backend torch_native and
            page_size 1 for configs SGLang treats as DSA (is_deepseek_dsa).
  upstream: present in sglang 0.5.23; not reported upstream.
  removal:  when SGLang resolves DSA configs for the CPU engine; the V3.2 server of
            tests/e2e/test_model_family.py does not start without it.

spec_verify_torch_native
  why:      a speculative worker (NGRAM here; EAGLE's verify is the same pass) verifies its drafts with one
            forward of the target over draft_token_num tokens per request, each seeing the request's prefix
            and, among the drafts, its ancestors and itself (spec_info.custom_mask). 0.5.23's torch_native
            backend has no such path: forward_extend reads extend_prefix_lens, which a verify batch does
            not carry (AttributeError at the server's warm-up), and would attend causally. The wrapper
            handles TARGET_VERIFY only (KV written as upstream, then scaled_dot_product_attention per
            request with the prefix visible and the tree mask, QLEN or FULL layout); every other mode goes
            to the original. Under DP attention the verify batch is padded to the largest group's, the mask
            covering the batch's own requests (ForwardBatch._original_batch_size): the padding's rows are zeros
            (before: "a custom mask of 16 entries for 2 requests of 4 drafts", the scheduler dead). Greedy outputs
            of an NGRAM server equal HF's and every captured row matches HF float32
            (tests/e2e/test_speculative.py, its EAGLE server under DP attention; tests/unit/test_spec_verify_tree.py).
  upstream: present in sglang 0.5.23 (torch_native_backend.py has no target-verify branch; the CPU
            speculative path is written for the Intel AMX backend); not reported upstream by us yet.
  removal:  when TorchNativeAttnBackend verifies trees itself; test_speculative's server fails its
            warm-up without it.

dsa_spec_verify
  why:      DeepSeek-V3.2 is served with its MTP layer as the draft (EAGLE/NEXTN); every decode step is then a verify
            pass over draft_token_num rows per request, which carries no extend lengths, so dsa_torch_native's
            indexer has no request list for it and spec_verify_torch_native refuses its `topk_indices`
            (NotImplementedError at the warm-up). In TARGET_VERIFY the indexer stores each row's index key at its slot
            and each draft row selects its index_topk keys among req_to_token[req, :seq_len + n] that the tree mask
            (spec_info.custom_mask, both layouts) lets it see, and the attention reads only those, within the same
            mask (dsa_torch_native's indexer and sparse attention, handed the verify's spans). SGLang's GPU DSA backend
            gives verify row j seq_len + j + 1 keys (dsa_backend.py init_forward_metadata, seqlens_expanded), which
            is the tree mask for a chain; trees are refused at launch (server/speculative_capture.py
            dsa_speculative_served). The draft's own indexer (V3.2's MTP layer has one; SGLang's
            DeepseekV3ForCausalLMNextN runs it, no index_share_for_mtp_iteration for V3.2) runs in its draft-extend
            pass, an extend dsa_torch_native serves, and with --speculative-num-steps N > 1 in each of the N - 1
            draft decode steps (a DECODE batch whose forward-context backend is eagle_cpu_draft's step backend,
            marked hs_draft_step): there each draft row selects among that backend's spans (the request's prefix
            and its own branch's drafts so far), which the step backend's sparse attention then reads; without it
            dsa_torch_native's decode path would read the committed prefix only (its causal spans by seq_lens).
  upstream: present in sglang 0.5.23 (torch_native_backend.py: no verify branch, no topk_indices; dsa_indexer.py
            forward_native raises); not reported upstream.
  removal:  with dsa_torch_native and spec_verify_torch_native (when SGLang's torch_native backend verifies DSA);
            tests/e2e/test_model_family.py's "v32-tp2" server (V3.2 with its MTP draft) does not start without it,
            and its rows fail the judge from the first verify row on (0.84 to 1.4 off) with the verify's indexer
            ignoring the tree mask, its top-k one short, or a verify's first row left unwritten (its slot keeping a
            freed slot's old row); tests/unit/test_dsa_spec_verify.py checks each draft row's selection and
            attention against plain torch, trees included, and each draft decode step's (the only guard of the
            draft-step branch: the tiny MTP layer's attention output is zero, so what it reads changes no
            proposal).

eagle_cpu_draft
  why:      EAGLE/NEXTN drafts (DeepSeek's MTP layer) on the CPU engine: the draft takes the target's
            embedding and LM head through set_embed_and_head, which ends with torch.cuda.empty_cache() and
            torch.cuda.synchronize() (RuntimeError without a CUDA driver); on a CPU device the same
            rebinding runs without them. The draft's extend pass needs an attention backend from
            DraftBackendFactory, whose map has none for torch_native ("EAGLE is not supported in attention
            backend torch_native"): the single (non-container) backend it builds gets SGLang's own
            TorchNativeAttnBackend for the draft runner. With --speculative-num-steps > 1 the draft also
            needs a multi-step decode backend (create_decode_backend: "EAGLE is not supported in decode
            attention backend torch_native"); the container it builds (stamps_children) gets
            TorchNativeMultiStepDraftBackend: one TorchNativeAttnBackend subclass per draft step, whose
            decode writes the step's KV at the slots EagleWorkerV2.draft_forward hands it and attends each
            branch's query (request b, branch t, step i) over the prefix and the slots seq_len + t * steps
            + 0..i, the layout SGLang's Triton/FlashInfer multi-step backends read
            (cache_locs.generate_draft_decode_kv_indices, page size 1; per_step_draft_out_cache_loc). Page
            sizes > 1, sliding-window drafts and --speculative-draft-window-size are refused
            (NotImplementedError at start-up or at the first draft step). A DSA draft (DeepSeek-V3.2's MTP
            layer) hands the step its indexer's `topk_indices`: the step attends over those keys among the same
            spans (dsa_torch_native.sparse_attention; dsa_spec_verify runs that indexer over the spans).
  upstream: present in sglang 0.5.23 (deepseek_v2.py set_embed_and_head; speculative/draft_utils.py: no
            torch_native entry in either backend map; the CPU multi-step backend it has is Intel AMX's);
            not reported upstream by us yet.
  removal:  when both have CPU paths; tests/e2e/test_speculative.py's EAGLE server (MTP, 3 steps) and
            tests/e2e/test_model_family.py's "v32-tp2" (V3.2's MTP, 3 steps) do not start without it ("EAGLE is not supported in decode attention backend torch_native");
            tests/unit/test_eagle_cpu_draft.py checks each step's attention against a plain-torch reference,
            and is the only guard of it: the tiny test drafts propose the same tokens whatever their attention
            reads (MTP: o_proj zero; EAGLE-3: one-hot on keys of the same token), so a step reading one draft
            too many still passes test_speculative's EAGLE3 tests with the same accept counts.

dsv4_torch_native
  why:      SGLang 0.5.23 serves DeepSeek-V4 on CUDA only: its attention is the FlashMLA "dsv4" backend over
            DeepSeekV4TokenToKVPool (FP8, 256-token pages, CUDA kernels), its hyper-connections TileLang/Triton
            kernels (`hc_split_sinkhorn` has no CPU path), and MQALayer.__init__ asks the CPU rope factory for a
            table that asserts a YaRN rope_scaling, which a sliding layer's plain RoPE has none of. On the CPU
            engine V4 gets SGLang's plain MHA pool (one KV head of head_dim, model dtype, token pages: the model
            config already says MHA), MQALayer.forward computes HF's DeepseekV4Attention for a sliding layer (the
            config's sliding_window, sinks, value = key, conjugate RoPE on the output, grouped wo_a) over the
            request's keys read through req_to_token, and hc_pre/hc_post/hc_head compute HF's
            DeepseekV4HyperConnection / stream mix / DeepseekV4HyperHead. A ratio-128 layer (HCA) keeps its
            compressor's per-token kv and gate at the KV slots (a per-layer store on the pool object) and recomputes
            HF DeepseekV4HCACompressor's block keys per step, attended with the window keys under one sink softmax.
            A ratio-4 layer (CSA) does the same with HF's overlapping DeepseekV4CSACompressor, and its indexer (its
            own compressor's sources in a second store) keeps each query's index_topk best closed blocks (HF
            DeepseekV4Indexer); SGLang's load-time permutation of an overlapping compressor's ape is undone. Other
            ratios (V4.1's 1 and 2) raise NotImplementedError at their first forward; the launcher refuses them.
  upstream: present in sglang 0.5.23 (srt/models/deepseek_v4.py MQALayer.forward, DeepseekV4DecoderLayerBase.hc_pre,
            DeepseekV4Model.hc_head; mem_cache/kv_cache_configurator.py _build_dsv4_kv_pool); not reported upstream.
  removal:  when SGLang serves V4 on its CPU engine; tests/e2e/test_v4_cpu.py serves tiny_model's "v4-swa" and
            "v4-csa" and judges every row against HF float32 (the server does not start without it; a
            window one key wider, a dropped sink, an HCA block visible one position early, its ape ignored or the
            CSA indexer keeping one block fewer fails the judge);
            tests/unit/test_dsv4_cpu_patches.py checks each piece against HF.

dsv4_cpu_spec
  why:      DeepSeek-V4 decodes speculatively with its MTP layer (EAGLE/NEXTN, DeepseekV4ForCausalLMNextN). On the CPU
            engine V4's attention is dsv4_torch_native's, which enumerates each request's (prefix, new tokens) span
            from extend_prefix_lens / decode seq_lens: a TARGET_VERIFY batch has neither (AttributeError at the
            warm-up's first verify). A chain of drafts (--speculative-eagle-topk 1: draft i at position seq_len + i,
            seeing the prefix and the drafts before it, which the patch checks against SGLang's custom mask, QLEN or
            FULL layout) is the span (seq_len, draft_token_num), attended causally with the window, the CSA/HCA
            blocks and the indexer as a prefill chunk. Nothing is rolled back for rejected drafts: the patch keeps no
            compressor state (a block is recomputed per step from per-token sources at req_to_token[req, :position],
            and positions past the accepted length are written anew by the next pass). The draft's set_embed_and_head
            (V4's own, not DeepseekV2's that eagle_cpu_draft wraps) ends with torch.get_device_module().empty_cache()
            and .synchronize(): RuntimeError without a CUDA driver; on a CPU tensor the rebinding runs without them.
            Draft trees raise NotImplementedError at the first verify; the launcher refuses V4 with any other
            algorithm or shape than EAGLE/NEXTN with N steps, top-k 1, N + 1 draft tokens first
            (launch_server.speculative_refusal). The draft's decode steps (N > 1) are one-token spans at their
            positions (its draft slots req_to_token[req, seq_len + i]; its layer is sliding-window only). A DSpark
            verify pass (DFlashVerifyInput, dsv4_cpu_dspark) is the same chain of gamma + 1 tokens, but the worker
            hands a backend without make_forward_metadata_from_raw_verify seq_lens_cpu with the window added: its
            prefix is that less the window, checked against the window's positions (dspark_prefixes).
  upstream: present in sglang 0.5.23 (deepseek_v4.py set_embed_and_head; V4's verify runs only in the CUDA "dsv4"
            backends over DeepSeekV4TokenToKVPool's compress-state pools); not reported upstream.
  removal:  with dsv4_torch_native; tests/e2e/test_v4_cpu.py's csa-full server (speculative) does not start without
            it, and test_speculative_verify_passes_over_the_compressed_blocks judges every verify row against HF
            float32 with drafts rejected over closing CSA and HCA blocks; tests/unit/test_dsv4_cpu_spec.py.

dsv4_cpu_dspark
  why:      DeepSeek-V4 decodes speculatively with its DSpark draft (--speculative-algorithm DSPARK, SGLang's
            DSparkWorkerV2 and DeepseekV4ForCausalLMDSpark). Its kernels take their torch reference on CPU tensors
            (kernels/ops/speculative/dspark/dispatch.py), but three pieces have no CPU path: the worker builds the
            draft runner with the "dsv4" backend for a V4 draft (FlashMLA, asserts head_dim 512: the start-up
            fails), DSparkAttention.forward asserts DeepSeekV4TokenToKVPool and stores through its fused SWA writer,
            and TargetHiddenKvInjector calls the dense drafts' write_target_hidden_kv signature for a pool without
            that writer (TypeError at the first prefill). The draft gets torch_native and SGLang's plain MHA pool
            (as the target, dsv4_torch_native); its attention (each block row over the context window's injected
            keys, max(0, prefix - SWA_WINDOW) .. prefix - 1, and over its whole block, with the layer's sink) and
            the injection (main_norm(main_proj(states)), each stage's wkv, kv_norm and RoPE, written at the slots;
            after a verify only each request's first commit_lens rows, upstream's commit gate, so a rejected draft's
            target state never reaches the draft's KV) are plain torch. DSparkWorkerV2._forward_decode records
            batch.seq_lens on the device's current stream: "unknown parameter type" for a CPU tensor; record_stream
            is a no-op on a CPU tensor (CPU work is synchronous), the original for any other. A sampled request's
            verify (temperature > 0: AcceptSampling) launches reject_sampling's Triton kernel even from its torch
            reference ("0 active drivers": the scheduler dies at the first such pass); dspark_accept's
            chain_speculative_sampling_triton takes chain_speculative_sampling_cpu for CPU tensors, the kernel's
            chain rule (coin * q(d) < p(d), the bonus from the target's row or max(p - q, 0)) token by token. The
            verify pass's spans are dsv4_cpu_spec's (dspark_prefixes); the launcher refuses DSPARK for other models,
            on a GPU, on several ranks and without --speculative-draft-model-path. Applied only on a DSPARK server
            (the launcher sets SGLANG_HS_SPECULATIVE_ALGORITHM; NEEDED_WHEN), so no other server's record_stream is
            touched.
  upstream: present in sglang 0.5.23 (speculative/dspark_components/dspark_worker_v2.py, dspark_kv_inject.py,
            models/deepseek_v4_dspark.py); not reported upstream.
  removal:  with dsv4_torch_native; tests/e2e/test_v4_cpu.py's DSpark server (v4_dspark) does not start without it,
            and test_dspark_verify_passes_keep_only_committed_rows judges every row of greedy and sampled requests
            against HF float32, the greedy tokens against HF's greedy ones and each greedy pass's accepted drafts
            against the draft's markov chain; tests/unit/test_dsv4_cpu_dspark.py checks the commit gate, the draft
            attention's reach, the verify window's prefix and the sampled accept (against upstream's kernel under
            TRITON_INTERPRET=1) piece by piece (the e2e test cannot see the draft's KV: its markov head dominates).

dsv4_cpu_moe
  why:      DeepSeek-V4's experts clamp their SwiGLU (swiglu_limit). The shared expert's clamp is a JIT CUDA kernel
            (kernels/ops/activation/silu_and_mul_clamp.py: the build fails on the CPU engine at the first
            forward); the CPU engine's routed experts (fused_moe_native.moe_forward_native) apply a plain SiluAndMul
            and ignore moe_runner_config.swiglu_limit, silently unclamped. Both compute HF's
            silu(gate.clamp(max=l)) * up.clamp(-l, l) on CPU tensors; a limit beside another activation or a
            gemm1_alpha is refused at the forward (NotImplementedError), never dropped. Not covered: SGLang's AMX
            path (fused_experts_cpu, CPUs with AMX tiles; none here) passes no swiglu_limit.
  upstream: present in sglang 0.5.23; not reported upstream.
  removal:  when both have CPU paths that honour the limit; tests/unit/test_dsv4_cpu_patches.py (a limit that bites)
            and tests/e2e/test_v4_cpu.py (the server fails its warm-up without the shared-expert half).

dsv4_cpu_server_args
  why:      SGLang 0.5.23 resolves DeepseekV4ForCausalLM for its CUDA kernels (arg_groups/model_overrides/deepseek_v4.py:
            the "dsv4" backend, 256-token pages, hybrid SWA pools; overrides.py _deepseek_v4_kv_cache_dtype: FP8 or
            bf16 KV only). On the CPU engine a provider declared after upstream's sets torch_native, page size 1
            and disable_hybrid_swa_memory, and the KV dtype pass leaves "auto" (the model's dtype). CPU_ENV (the
            TileLang/DeepGEMM/fused mHC kernels and the fused hash top-k off, so load_weights skips the CUDA mHC
            prewarm) is put into the environment of serve.py's process when a V4 config resolves (the override),
            so the scheduler processes it spawns read it (SGLang reads some of it when its deepseek_v4 module is
            imported); a V2/V3 server's environment stays as it was. speculative_hook._handle_dspark (DSPARK's
            resolution) raises in its first line for any device but CUDA, NPU and XPU: on CPU it runs with a view of
            the arguments whose `device` reads "cuda" (read only for that check and its NPU branches), so the rest
            (draft path, steps 1, top-k 1, gamma from the draft config, the verify window) resolves as upstream.
  upstream: present in sglang 0.5.23; not reported upstream.
  removal:  when SGLang resolves V4 for its CPU engine; tests/e2e/test_v4_cpu.py's server does not start without it.

dsv4_cpu_tp
  why:      with --tp > 1 the CPU engine's ModelRunner.load_model runs adjust_config_with_unaligned_cpu_tp, which
            pads a model's KV heads to a multiple of the TP size (and its query heads with them). DeepSeek-V4's
            attention is an MQA: one KV head every attention-TP rank keeps whole, the query heads split over the ranks
            (MqaAttentionBase asserts num_key_value_heads == 1); the padding makes it 2 KV heads and 8 query heads
            at --tp 2, and the model fails to build (that assertion). For a V4 config the wrapper runs SGLang's
            function (its MoE intermediate padding included) and puts the two head counts back; a V4 whose query
            heads or o_groups the attention-TP size does not divide is refused (as the launcher refuses it; SGLang
            passes the whole TP size, the heads split over attention TP: TP / DP under DP attention). The attention's
            own TP split is dsv4_torch_native's: this rank's query heads and sinks, and upstream's
            MqaAttentionBase._project_wo_b (wo_b row parallel, all-reduced over the attention-TP group).
  upstream: present in sglang 0.5.23 (configs/update_config.py adjust_config_with_unaligned_cpu_tp, called from
            model_executor/model_runner.py ModelRunner.load_model when the device is cpu); not reported upstream.
  removal:  when the CPU engine leaves an MQA's single KV head unpadded; tests/e2e/test_v4_cpu.py's csa-tp2 server
            (--tp 2) does not start without it.

dp_controller_idle_wait
  why:      SGLang's DP controller (every --dp server's sglang::data_parallel_controller process) takes requests off
            its socket with NOBLOCK receives and loops straight back when none is there: it spins a whole core for
            the server's life, busy or idle. --sleep-on-idle (which the launcher gives the CPU engine) stops only the
            schedulers' spinning (IdleSleeper). On this 2-core machine the controller of test_speculative's DP
            server took 78% of a core for the 514 s it lived, out of the schedulers' and the tests' share. With
            --sleep-on-idle the loop drains the socket as upstream's does, then waits on a zmq poller over it (as
            IdleSleeper does: a request wakes it at once, a look every second feeds the soft watchdog). Applied
            only on a server with a DP controller (--dp or --attn-dp-size above 1: the launcher sets
            SGLANG_HS_DP_CONTROLLER; NEEDED_WHEN).
  upstream: present in sglang 0.5.23 (managers/data_parallel_controller.py event_loop); not reported upstream.
  removal:  when SGLang's --sleep-on-idle covers the DP controller; tests/unit/test_dp_controller_idle_wait.py runs
            the loop on real zmq sockets and counts its passes (a spinning loop makes millions while it waits).

cpu_inplace_all_reduce
  why:      SGLang registers its custom ops for one dispatch key (utils/common.py direct_register_custom_op: CUDA on
            this platform), so `sglang::inplace_all_reduce` has no CPU kernel. DP attention gathers integer tensors
            with it (layers/dp_attention.py _dp_gather_via_all_reduce), and DeepSeek-V4 gathers its token ids so at
            every forward under DP attention (DeepseekV4Model._forward_impl, input_ids_global for the hash-routed
            layers): a V4 --enable-dp-attention server fails at its warm-up ("Could not run
            'sglang::inplace_all_reduce' with arguments from the 'CPU' backend"). The op's body written out (the
            named group's GroupCoordinator._all_reduce_in_place: a gloo all-reduce on CPU) becomes its CPU kernel
            (not the op's Python name, which SGLANG_KERNEL_API_LOGLEVEL wraps around the op itself).
  upstream: present in sglang 0.5.23 (utils/common.py direct_register_custom_op; layers/dp_attention.py
            _dp_gather_via_all_reduce); not reported upstream.
  removal:  when SGLang registers its communication ops for the CPU key; tests/e2e/test_v4_cpu.py's DP-attention
            server fails its warm-up without it.

kimi_k25_language_model
  why:      SGLang's KimiK25ForConditionalGeneration builds its language model by calling the
            `DeepseekV3ForCausalLM` its module imported from deepseek_v2, so the registry override (by
            architecture name) never reaches it; without the rebinding the wrapper serves upstream's
            class and nothing is captured. Scoped to the wrapper overlay's `super().__init__()`
            (sglang_hs/server/models/kimi_k25.py), which also checks it got the overlay's class.
  upstream: present in sglang 0.5.23 (srt/models/kimi_k25.py: module-level import, called in
            KimiK25ForConditionalGeneration.__init__); not reported upstream by us yet.
  removal:  if the wrapper resolves its language model through the registry (or takes the class as
            an argument); tests/unit/test_override_resolution.py checks the binding inside the
            constructor and tests/e2e/test_model_family.py serves Kimi-K2.5 with capture.

Who applies them: the overlay model's constructor (sglang_hs/server/models/deepseek_v2.py), i.e. exactly the
processes that build the model, before any forward; warmup_rid, parallel_sampling and sigterm_watchdog, which
concern the HTTP server process, and dsa_cpu_server_args and dsv4_cpu_server_args, needed before that process resolves the
server arguments, are applied by sglang_hs/server/serve.py; cpu_gloo_groups, needed before a scheduler builds its
parallel groups (long before the model), by `apply_spawned()`, which sglang_hs/server/serve.py runs when a
spawned SGLang process re-imports it as `__mp_main__` (with dsv4_cpu_tp, needed before the scheduler loads the
model, and dp_controller_idle_wait, for the DP controller, a spawned process that builds no model). A patch that
NEEDED_WHEN names applies only where its setting says this server needs it (dsv4_cpu_dspark,
dp_controller_idle_wait). Not a
`sglang.srt.plugins` entry point: SGLang logs and swallows exceptions raised by plugins, and would run ours in
every SGLang process of the environment, plain `sglang serve` runs included.
"""
from __future__ import annotations

import threading

from sglang_hs import envs

_lock = threading.Lock()
_applied: dict = {}


# The CPU engine's patches, in the order they are applied: spec_verify_torch_native wraps
# TorchNativeAttnBackend.forward_extend after dsa_torch_native has, so a verify batch meets it first; dsa_spec_verify
# wraps both (the indexer and forward_extend) after them, so a DSA verify batch meets it first.
CPU_PATCHES = ("mla_torch_native", "cpu_gloo_groups", "dsv4_cpu_tp", "cpu_inplace_all_reduce", "torch_native_cpu_pad",
               "torch_native_extend", "moe_native_ep", "dsa_torch_native", "spec_verify_torch_native",
               "dsa_spec_verify", "eagle_cpu_draft", "dsv4_torch_native", "dsv4_cpu_spec", "dsv4_cpu_moe",
               "dsv4_cpu_dspark")


# CPU patches only some servers need, and the setting (envs.py; the launcher sets it) that says this one does
NEEDED_WHEN = {"dsv4_cpu_dspark": lambda: envs.SGLANG_HS_SPECULATIVE_ALGORITHM == "DSPARK",
               "dp_controller_idle_wait": lambda: envs.SGLANG_HS_DP_CONTROLLER}


def apply() -> dict:
    """Apply the patches this process needs; idempotent. Returns {name: original} for tests."""
    with _lock:
        for name in CPU_PATCHES:
            _apply_cpu(name)
        if envs.SGLANG_HS_DUMP_DIR and "capture_hooks" not in _applied:
            from sglang_hs.server.patches import capture_hooks

            _applied["capture_hooks"] = capture_hooks.apply()
        if envs.SGLANG_HS_DUMP_DIR and envs.SGLANG_HS_RECORD_PART_BYTES and "hold_finished_kv" not in _applied:
            from sglang_hs.server.patches import hold_finished_kv

            _applied["hold_finished_kv"] = hold_finished_kv.apply()
        return dict(_applied)


def _apply_cpu(name: str) -> None:
    """A CPU-engine patch, once, unless SGLANG_HS_DISABLE_PATCHES names it or this server does not need it."""
    if envs.SGLANG_HS_CPU_MODE and name not in envs.SGLANG_HS_DISABLE_PATCHES and name not in _applied \
            and NEEDED_WHEN.get(name, lambda: True)():
        import importlib

        _applied[name] = importlib.import_module(f"sglang_hs.server.patches.{name}").apply()


def apply_spawned() -> dict:
    """The patches a spawned SGLang process needs before its scheduler builds the parallel groups
    and loads the model (sglang_hs/server/serve.py runs this in every such process); idempotent."""
    with _lock:
        _apply_cpu("cpu_gloo_groups")
        _apply_cpu("dsv4_cpu_tp")
        _apply_cpu("dp_controller_idle_wait")
        return dict(_applied)
