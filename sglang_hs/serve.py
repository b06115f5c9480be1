"""The server process the launcher supervises: SGLang's own launch path plus sglang-hs's checks.

Not meant to be run by hand: `python -m sglang_hs.launch_server` starts it with the environment the
settings module (envs.py) reads. SGLang spawns its scheduler and detokenizer processes with
multiprocessing `spawn`, and those re-import this module as `__mp_main__`: module-level code here
must stay side-effect free but for the faulthandler registration below, which they then inherit, so
the launcher can ask any of them for its Python stacks (SIGUSR1) when start-up stalls.
"""
import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)


def check_server_args(cfg) -> None:
    """Refuse SGLang settings capture cannot run with (cfg: SGLang's resolved view of ServerArgs)."""
    from sglang_hs import envs
    from sglang_hs.capture_spec import CaptureConfigError

    if not envs.SGLANG_HS_DUMP_DIR:
        return
    refusals = [
        (getattr(cfg, "pp_size", 1) or 1) > 1
        and "--pp-size > 1 (pipeline parallel): capture needs every layer on one rank; use --tp",
        getattr(cfg, "enable_two_batch_overlap", False)
        and "--enable-two-batch-overlap: two-batch overlap skips aux capture in its MoE layers",
        getattr(cfg, "speculative_algorithm", None)
        and "--speculative-algorithm: speculative decoding cannot run with --hs-dump-dir",
        getattr(cfg, "enable_torch_compile", False)
        and "--enable-torch-compile: the capture copy is not a registered custom op yet",
        (getattr(cfg, "dp_size", 1) or 1) > 1
        and "--dp-size > 1: one writer per data-parallel group is not supported yet; use --tp",
        (getattr(cfg, "attn_cp_size", 1) or 1) > 1
        and "--attn-cp-size > 1 (context parallel): its extend path bypasses the overlay's forward",
    ]
    for message in refusals:
        if message:
            raise CaptureConfigError(f"unsupported with --hs-dump-dir: {message}")


def main(argv) -> int:
    from sglang.launch_server import run_server
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_hs.capture_spec import CaptureConfigError

    from sglang_hs import envs
    from sglang_hs.patches import warmup_rid

    load_plugins()
    if envs.SGLANG_HS_DUMP_DIR:
        warmup_rid.apply()  # this process serves HTTP: SGLang's warm-up request gets a recognisable rid
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    try:
        check_server_args(resolving_view(server_args))
    except CaptureConfigError as e:
        print(f"sglang-hs: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
