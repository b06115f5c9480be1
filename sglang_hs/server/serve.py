"""The server process the launcher supervises: SGLang's own launch path plus sglang-hs's checks.

Not meant to be run by hand: `python -m sglang_hs.launch_server` starts it with the environment the
settings module (envs.py) reads. SGLang spawns its scheduler and detokenizer processes with
multiprocessing `spawn`, and those re-import this module as `__mp_main__`: module-level code here
must stay side-effect free but for the faulthandler registration below, which they then inherit, so
the launcher can ask any of them for its Python stacks (SIGUSR1) when start-up stalls, and the runtime
patches a spawned process needs before its scheduler builds the parallel groups (CPU mode only).
"""
import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)
if __name__ == "__mp_main__":  # a spawned SGLang process: patch what its scheduler runs before the model
    from sglang_hs.server.patches import apply_spawned

    apply_spawned()


# Speculative algorithms whose verify pass is the target's own forward over the draft tokens, at KV slots
# the store follows (docs/serving.md#speculative-decoding); the others are refused in one line.
SPECULATIVE_SUPPORTED = ("NGRAM", "EAGLE", "NEXTN", "EAGLE3", "DSPARK")


def _speculative_refusal(algorithm):
    name = str(algorithm or "").upper()
    if not name or name in SPECULATIVE_SUPPORTED:
        return None
    return (f"--speculative-algorithm {name}: capture under this algorithm is not supported yet (supported: "
            f"{', '.join(SPECULATIVE_SUPPORTED)}); serve it without --hs-dump-dir or drop the draft")


def _resolved_speculative_refusal(cfg):
    """speculative_capture.refusal on the setting SGLang resolved: what a --config YAML, SGLang's defaults or a
    spelling the launcher does not read gave, which the launcher's check of the command line did not see."""
    algorithm = getattr(cfg, "speculative_algorithm", None)
    if not algorithm or _speculative_refusal(algorithm):
        return None
    from sglang_hs.server import speculative_capture
    from sglang_hs.server.capture_spec import check_architecture
    from sglang_hs.tools.launch_server import read_model_config

    config = read_model_config(cfg.model_path, bool(getattr(cfg, "trust_remote_code", False)))
    arch = check_architecture(config.get("architectures"), where=f"{cfg.model_path}/config.json", config=config)
    return speculative_capture.refusal(speculative_capture.from_server_args(cfg, arch)) or None


def check_server_args(cfg) -> None:
    """Refuse SGLang settings capture cannot run with (cfg: SGLang's resolved view of ServerArgs).

    The store is filled by forward passes, one row per KV slot: whatever puts KV into a slot another
    way (loaded back from host memory, storage or a peer) would leave that slot's rows stale, so each
    such feature is refused. Audited against SGLang 0.5.23 and left allowed, since none puts KV into a
    slot without a forward of this server: --enable-streaming-session and --enable-session-radix-cache
    (they hold KV this server computed, like the radix cache); --enable-pd-role-switch (acts only under
    --disaggregation-mode); --enable-kv-cache-sharding, --disaggregation-decode-retraction-backup host_pool
    and --disaggregation-decode-host-receive-threshold (SGLang allows them only with --disaggregation-mode);
    --enable-linker-mla-dedup (needs the external linker) and --enable-page-major-kv-layout (needs
    --enable-unified-memory); --enable-memory-saver (it releases the KV pool, never fills it);
    --kv-canary (checks KV, writes canaries only); SWA and Mamba pool flags (DeepSeek-V2/V3 have neither
    pool); weight offload and loading flags (--cpu-offload-gb, --offload-*, --kt-*, remote weight
    loaders: weights, not KV); multimodal caches (--enable-prefix-mm-cache, --enable-mm-global-cache:
    encoder embeddings, not KV); --decoupled-spec-role (nothing in 0.5.23 consumes it but its IPC config).
    """
    from sglang_hs import envs
    from sglang_hs.server.capture_spec import CaptureConfigError

    if not envs.SGLANG_HS_DUMP_DIR:
        return
    refusals = [
        (getattr(cfg, "pp_size", 1) or 1) > 1
        and "--pp-size > 1 (pipeline parallel): capture needs every layer on one rank; use --tp",
        getattr(cfg, "enable_two_batch_overlap", False)
        and "--enable-two-batch-overlap: two-batch overlap skips aux capture in its MoE layers; drop it",
        _speculative_refusal(getattr(cfg, "speculative_algorithm", None)),
        _resolved_speculative_refusal(cfg),
        # SGLang's capture-only JSON path (--enable-return-aux-hidden-states) names its convention with
        # --speculative-algorithm and resets that to None: EAGLE3's is served beside capture, the others'
        # would take the model's capture layers over
        (getattr(cfg, "aux_hidden_state_capture", None) or "eagle3") != "eagle3"
        and f"--enable-return-aux-hidden-states with --speculative-algorithm "
            f"{str(getattr(cfg, 'aux_hidden_state_capture', '')).upper()}: its layer convention is not supported "
            "beside capture (EAGLE3's is); drop one",
        getattr(cfg, "enable_torch_compile", False)
        and "--enable-torch-compile: the capture copy is not a registered custom op yet; drop it (CUDA graphs stay)",
        (getattr(cfg, "dp_size", 1) or 1) > (getattr(cfg, "attn_dp_size", 1) or 1)  # DP attention is allowed
        and "--dp-size > 1 without DP attention: replicas would open the same store files; use --enable-dp-attention",
        (getattr(cfg, "attn_cp_size", 1) or 1) > 1
        and "--attn-cp-size > 1 (context parallel): its extend path bypasses the overlay's forward; use --tp",
        # KV reaching a slot without a forward pass (its rows in the store would be stale):
        getattr(cfg, "disaggregation_decode_enable_offload_kvcache", False)
        and "--disaggregation-decode-enable-offload-kvcache: offloaded KV is loaded back without a forward; drop it",
        (getattr(cfg, "disaggregation_mode", "null") or "null") != "null"
        and "--disaggregation-mode: a PD decode server gathers prompt KV it never computed; serve without PD",
        getattr(cfg, "enable_hierarchical_cache", False)
        and "--enable-hierarchical-cache: HiCache loads KV back from host memory; use the default radix cache",
        getattr(cfg, "hicache_storage_backend", None)
        and "--hicache-storage-backend: KV loaded from storage skips the forward; use the default radix cache",
        getattr(cfg, "enable_lmcache", False)
        and "--enable-lmcache: LMCache loads KV from its store; use the default radix cache",
        getattr(cfg, "enable_flexkv", False)
        and "--enable-flexkv: FlexKV loads KV back from CPU, SSD or remote tiers; use the default radix cache",
        getattr(cfg, "radix_cache_backend", None)
        and "--radix-cache-backend: a plug-in cache may load KV without a forward; use the default radix cache",
        getattr(cfg, "enable_unified_cache_external_linker", False)
        and "--enable-unified-cache-external-linker: KV loaded from an external store; use the default radix cache",
        getattr(cfg, "enable_hisparse", False)
        and "--enable-hisparse: hierarchical sparse attention swaps KV in from host memory; drop it",
        getattr(cfg, "enable_unified_memory", False)
        and "--enable-unified-memory: its pool translates KV slot ids and moves KV between pages; drop it",
        (getattr(cfg, "dcp_size", 1) or 1) > 1
        and "--dcp-size > 1 (decode context parallel): KV slots are widened and split over ranks; use --tp",
        # Not a stale slot but an unnamed teacher: a request's rows would be those of the base model with
        # its adapter applied, and nothing in a record says which adapter (or none) that was.
        getattr(cfg, "enable_decoder_swa_bounded_replay", False)
        and "--enable-decoder-swa-bounded-replay (DeepSeek-V4.1; SGLang turns it on by default on CUDA): layers past "
            "the last KV-source layer run over each request's last SWA window only, so earlier tokens get no rows; "
            "turn it off",
        getattr(cfg, "enable_lora", False)
        and "--enable-lora: a record would not say which LoRA adapter computed its rows; serve the target without adapters",
        # Its own event loop processes prefill and decode results on two streams and never runs the intake
        # hook the finish hand-over's ordering relies on (finisher.submit, mark_iteration): not checked
        getattr(cfg, "enable_pdmux", False)
        and "--enable-pdmux: its event loop and two result streams are not checked with sglang-hs's finish path; "
            "drop it",
    ]
    for message in refusals:
        if message:
            raise CaptureConfigError(f"unsupported with --hs-dump-dir: {message}")


def cpu_torch_compile(env, cfg) -> str:
    """CPU mode: give the server's processes envs.CPU_TORCHDYNAMO_DISABLE when SGLang serves float32 (cfg: its
    resolved view of ServerArgs, so a dtype SGLang forces, such as Mistral Large 3's bfloat16, counts) and the
    environment sets no TORCHDYNAMO_DISABLE; returns the line the server logs. Set here, before SGLang spawns its
    scheduler processes, which inherit it. In float32 SGLang's torch.compile'd helpers and the eager ones compute
    in the same precision. In bfloat16 its compiled MoE top-k keeps the router's sigmoid in float32 inside its
    kernel (as SGLang's Triton gate does) where eager would round it to bfloat16 and pick other experts at near
    ties, so other dtypes compile; so does a server asked for --enable-torch-compile."""
    from sglang_hs import envs

    given = env.get("TORCHDYNAMO_DISABLE")
    if given is not None:
        return f"TORCHDYNAMO_DISABLE={given} (from the environment)"
    dtype = str(getattr(cfg, "dtype", None))
    if dtype not in ("float32", "float") or getattr(cfg, "enable_torch_compile", False):
        why = "--enable-torch-compile" if dtype in ("float32", "float") else f"dtype {dtype}"
        return f"torch.compile on ({why}; sglang-hs runs SGLang's compiled helpers eagerly in float32 only)"
    env["TORCHDYNAMO_DISABLE"] = envs.CPU_TORCHDYNAMO_DISABLE
    return (f"TORCHDYNAMO_DISABLE={envs.CPU_TORCHDYNAMO_DISABLE} (set by sglang-hs for float32: SGLang's torch.compile'd "
            "helpers run eagerly, in the same precision, not built at each process's first forward; "
            "TORCHDYNAMO_DISABLE=0 compiles them)")


NODE_READY = "[sglang-hs] node {node} of {nnodes}: schedulers ready"


def announce_node_ready(server_args) -> None:
    """A node of rank > 0 (SGLang --nnodes) runs schedulers only, no HTTP server, and SGLang logs no
    "ready" line for it: once its schedulers are ready (Engine._launch_subprocesses waits for them, then
    starts the follower metadata server) say so, for the launcher's supervisor (supervisor.PHASES)."""
    from sglang.srt.entrypoints import engine

    original = engine.start_follower_grpc_server

    def start_follower_grpc_server(*args, **kwargs):
        print(NODE_READY.format(node=server_args.node_rank, nnodes=server_args.nnodes), file=sys.stderr, flush=True)
        return original(*args, **kwargs)

    engine.start_follower_grpc_server = start_follower_grpc_server


def main(argv) -> int:
    from sglang.launch_server import run_server
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_hs.server.capture_spec import CaptureConfigError

    from sglang_hs import envs
    from sglang_hs.server.patches import parallel_sampling, sigterm_watchdog, warmup_rid

    load_plugins()
    if "sigterm_watchdog" not in envs.SGLANG_HS_DISABLE_PATCHES:
        sigterm_watchdog.apply()  # this process's SIGTERM handler: the shutdown starts at once, not up to 5 s later
    if envs.SGLANG_HS_CPU_MODE and "dsa_cpu_server_args" not in envs.SGLANG_HS_DISABLE_PATCHES:
        from sglang_hs.server.patches import dsa_cpu_server_args

        dsa_cpu_server_args.apply()  # before resolution: DSA configs on the CPU engine
    if envs.SGLANG_HS_CPU_MODE and "dsv4_cpu_server_args" not in envs.SGLANG_HS_DISABLE_PATCHES:
        from sglang_hs.server.patches import dsv4_cpu_server_args

        dsv4_cpu_server_args.apply()  # before resolution: DeepSeek-V4 configs on the CPU engine
    if envs.SGLANG_HS_DUMP_DIR:
        warmup_rid.apply()  # this process serves HTTP: SGLang's warm-up request gets a recognisable rid
        parallel_sampling.apply()  # and the prefix request of an n > 1 request is tagged: no record
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    if envs.SGLANG_HS_TEST_SAME_HOST_NODES and (server_args.node_rank or 0) > 0:
        import sglang.srt.server_args as sa  # PortArgs.init_new checks node 0's ports on this same host

        sa.wait_port_available = lambda *a, **k: True
    try:
        check_server_args(resolving_view(server_args))
    except CaptureConfigError as e:
        print(f"sglang-hs: error: {e}", file=sys.stderr, flush=True)
        return 2
    if envs.SGLANG_HS_CPU_MODE:
        print(f"[sglang-hs] CPU mode: {cpu_torch_compile(os.environ, resolving_view(server_args))}", file=sys.stderr,
              flush=True)
    if (server_args.node_rank or 0) > 0:
        announce_node_ready(server_args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
