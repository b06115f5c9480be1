"""What the server captures, checked against what the run needs before anything is sent or read: the final
state the format trains on (post-norm for SpecForge, pre-norm for speculators), one row per layer id, and the
post-norm state --verify checks lm_head of."""
from __future__ import annotations

import sys

from sglang_hs.server.capture_spec import final_states, last_choice
from sglang_hs.extract.errors import ExtractError


def check_capture(fmt: str, sink, manifest: dict, server: str, verify: bool = False) -> None:
    """Every check of what `server` captures (its `manifest`) against --format `fmt` (its `sink`) and --verify:
    ExtractError, one line, for a capture the run cannot use."""
    check_final_state(fmt, sink, manifest, server)
    check_streams(fmt, manifest, server)
    if verify:
        check_verifiable(manifest)


def check_final_state(fmt: str, sink, manifest: dict, server: str) -> None:
    """Refuse a format that trains on the final hidden state when `server` runs without --hs-last, or
    captures the other final state (post-norm for SpecForge, pre-norm for speculators); warn where the files
    can be written but make no training set."""
    finals = final_states(manifest)
    if finals and sink.final_state not in finals:
        raise ExtractError(f"--format {fmt} trains on the {sink.final_state} final state, but {server} captures "
                           f"the {' and '.join(finals)} one (--hs-last {last_choice(finals)}); restart it with "
                           f"--hs-last {sink.final_state} (or --hs-last both)")
    if sink.needs_last and not manifest["last"]:
        raise ExtractError(f"--format {fmt} needs the final hidden state: {server} runs without --hs-last "
                           "(restart it with --hs-last)")
    if sink.wants_last and not manifest["last"]:
        print(f"[extract] warning: {server} runs without --hs-last: the files hold the aux layers only and no "
              f"{fmt} training set is made of them (speculators trains on the final state too); restart the "
              "server with --hs-last", file=sys.stderr, flush=True)


def check_streams(fmt: str, manifest: dict, server: str) -> None:
    """Refuse DeepSeek-V4's full hyper-connection streams (--hs-hc-streams full: hc_mult rows per layer id) for
    the EAGLE-3 trainers' formats. Both size the draft's fc from the layer count and the target's hidden size
    (SpecForge 0.2.0: 3 x target_hidden_size; speculators 0.9.0: len(--target-layer-ids) x hidden_size), so
    files of K x hc_mult x H per token load and then fail at the first step; and SGLang 0.5.23 serves V4
    drafters on the streams' mean (its DSpark capture), which the default convention stores."""
    per = int(manifest.get("rows_per_layer", 1))
    if per != 1:
        raise ExtractError(f"--format {fmt}: {server} captures DeepSeek-V4's full hyper-connection streams "
                           f"(--hs-hc-streams full, {per} rows of {manifest['hidden_size']} per layer id), and the "
                           f"EAGLE-3 trainers take one row per layer id (SGLang serves V4 drafters on the streams' "
                           f"mean): restart it with --hs-hc-streams mean, or read the streams with HiddenStateReader")


def check_verifiable(manifest: dict) -> None:
    """--verify checks lm_head of the post-norm final state against the server's logprobs: refuse a server
    that does not capture it."""
    if "post-norm" not in final_states(manifest):
        raise ExtractError("--verify needs the post-norm final state (it checks lm_head of it against the "
                           "server's logprobs): run the server with --hs-last both (or --hs-last for --format "
                           "specforge)")
