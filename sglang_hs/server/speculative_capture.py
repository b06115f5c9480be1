"""Which speculative settings are served with capture, per architecture: one rule, read from plain values.

The launcher (sglang_hs/tools/launch_server.py) builds a SpeculativeSetting from the command line, before any
model loads; the server process (sglang_hs/server/serve.py check_server_args) builds one from SGLang's resolved
ServerArgs, so settings the command line does not show (a --config YAML, SGLang's defaults, spellings the launcher
does not read) are held to the same rule. Imports no sglang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from sglang_hs.server.capture_spec import DSA_ARCHITECTURES, HC_ARCHITECTURES

# Speculative settings that change a proven chain at run time (adaptive steps) or its draft (multi-layer EAGLE):
# not served with capture for V3.2 or V4, whose CPU draft paths are proven for one fixed chain. (flag, ServerArgs field)
SPECULATIVE_VARIANTS = (("--speculative-adaptive", "speculative_adaptive"),
                        ("--enable-multi-layer-eagle", "enable_multi_layer_eagle"))
# DeepSeek-V4's speculative decoding with capture: its MTP draft (EAGLE/NEXTN) drafting a chain (top-k 1, one token
# per step, num_steps + 1 draft tokens per verify pass) on the CPU engine (sglang_hs/server/patches/dsv4_cpu_spec.py)
V4_SPECULATIVE = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
PROVEN = ("DeepSeek-V2/V3-family MLA models, DeepSeek-V3.2's and DeepSeek-V4's MTP drafts drafting a chain, V3.2 and "
          "V4 on the CPU engine only")

Count = Union[int, str, None]  # a size as given: an int, or the word a command line spelled it with (None: not given)


@dataclass(frozen=True)
class SpeculativeSetting:
    algorithm: str
    arch: str
    cpu: bool
    model_path: Optional[str]
    draft_path: Optional[str] = None
    tp: Count = 1
    dp: Count = 1
    attn_dp: Count = 1  # attention DP groups
    variant: Optional[str] = None  # the first SPECULATIVE_VARIANTS flag in effect
    steps: Count = None
    topk: Count = None
    tokens: Count = None

    @property
    def one_rank(self) -> bool:
        return (self.tp, self.dp, self.attn_dp) == (1, 1, 1)

    @property
    def ranks(self) -> str:
        return f"--tp {self.tp} --dp {self.dp}, {self.attn_dp} attention DP groups"


def count(value: Optional[str]) -> Count:
    """A size read off a command line: the int it spells, else the word as given (None: not given)."""
    return int(value) if value is not None and str(value).isdigit() else value


def _same_path(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def own_mtp_draft(s: SpeculativeSetting) -> bool:
    """The target's own MTP layer drafts: EAGLE/NEXTN with no draft model, or the target's path as it."""
    return s.algorithm.upper() in ("EAGLE", "NEXTN") and (s.draft_path is None or
                                                           _same_path(s.draft_path, s.model_path))


def dsa_speculative_served(s: SpeculativeSetting) -> bool:
    """Whether a DSA model (DeepSeek-V3.2) is served with capture under this speculative setting: its MTP draft
    (EAGLE / NEXTN, no other draft model) drafting a chain (v4_chain_served: N steps, top-k 1, N + 1 draft tokens;
    DeepSeek's production setting is N = 3), which the CPU engine's verify (patches/dsa_spec_verify.py), draft extend
    and multi-step draft decode (patches/eagle_cpu_draft.py) attend sparsely; trees have no CPU path (SGLang's GPU DSA
    verify attends a tree causally by position, not by the tree)."""
    return own_mtp_draft(s) and v4_chain_served(s)


def v4_chain_served(s: SpeculativeSetting) -> bool:
    """N steps, top-k 1, N + 1 draft tokens (N >= 1)."""
    return s.topk == 1 and isinstance(s.steps, int) and s.steps >= 1 and s.tokens == s.steps + 1


def _dspark_refusal(s: SpeculativeSetting, head: str) -> str:
    """V4's own drafter, SGLang's DSparkWorkerV2 (patches/dsv4_cpu_dspark.py)."""
    if not s.one_rank:
        return f"{head} is served on one rank only ({s.ranks}: not yet tested; docs/serving.md#speculative-decoding)"
    bundled = s.model_path and s.draft_path and os.path.realpath(s.draft_path) in (
        os.path.realpath(s.model_path), os.path.realpath(os.path.join(s.model_path, "dspark")))
    if not s.draft_path or bundled:
        got = f": got {s.draft_path}" if s.draft_path else ""
        return (f"{head} needs a draft checkpoint of its own named with --speculative-draft-model-path (a draft "
                f"bundled in the target's checkpoint or its dspark/ subfolder is not yet tested{got})")
    mode = os.environ.get("SGLANG_RAGGED_VERIFY_MODE", "static") or "static"
    # compact's ragged verify windows have no CPU path (dsv4_cpu_spec.dspark_prefixes); cap-accept verifies the whole
    # static window and caps the accept by the confidence head's schedule (DSparkVerifyPlanner), as static does
    if mode not in ("static", "cap-accept"):
        return (f"{head} is served with SGLang's static verify windows only (SGLANG_RAGGED_VERIFY_MODE={mode}: "
                "not yet supported on the CPU engine); unset it or use cap-accept")
    return ""


def refusal(s: SpeculativeSetting) -> str:
    """The one line refusing this speculative setting with capture, or "" where it is served: V2/V3-family MLA
    models (serve.py checks the algorithm); on the CPU engine, without DP and without the SPECULATIVE_VARIANTS,
    DeepSeek-V3.2 with its MTP draft drafting a chain (dsa_speculative_served, --tp allowed), DeepSeek-V4 with
    EAGLE/NEXTN (its MTP layer) drafting a chain (v4_chain_served) on one rank, and DeepSeek-V4 with DSPARK and a
    draft of its own on one rank; the rest not (DSPARK for any other model included)."""
    head = f"--speculative-algorithm {s.algorithm} with {s.arch}: capture under speculative decoding"
    if s.algorithm.upper() == "DSPARK" and s.arch not in HC_ARCHITECTURES:  # SGLang's DSpark drafts for V4 only here
        return (f"{head} is served for DeepSeek-V4's DSpark draft only (docs/serving.md#speculative-decoding); serve "
                "this model without a draft, or without --hs-dump-dir")
    if s.arch not in HC_ARCHITECTURES + DSA_ARCHITECTURES:
        return ""
    if not s.cpu or s.variant:
        why = (f"with {s.variant}" if s.variant else
               "on a GPU (not yet checked there: SGLang's DSA and compressed-state pools)")
        return (f"{head} is not served {why}; it is proven for {PROVEN} (docs/serving.md#speculative-decoding); "
                "serve this model without a draft, or without --hs-dump-dir")
    if s.arch in DSA_ARCHITECTURES:
        if not dsa_speculative_served(s):
            return (f"{head} with DSA's sparse attention is served for the model's MTP draft drafting a chain only "
                    "(--speculative-algorithm EAGLE or NEXTN with --speculative-num-steps N --speculative-eagle-topk 1 "
                    f"--speculative-num-draft-tokens N+1, each given; got {s.steps}, {s.topk}, {s.tokens}; "
                    "docs/serving.md#speculative-decoding); serve it so, without a draft, or without --hs-dump-dir")
        if (s.dp, s.attn_dp) != (1, 1):
            return (f"{head} with DSA is served without data parallelism only (--dp {s.dp}, {s.attn_dp} attention DP "
                    "groups: not yet tested; --tp is; docs/serving.md#speculative-decoding)")
        return ""
    if s.algorithm.upper() == "DSPARK":
        return _dspark_refusal(s, head)
    if own_mtp_draft(s):
        if not s.one_rank:
            return (f"{head} is served on one rank only ({s.ranks}: not yet tested; "
                    "docs/serving.md#speculative-decoding)")
        if v4_chain_served(s):
            return ""
        return (f"--speculative-algorithm {s.algorithm} with {s.arch}: capture is served with its MTP draft drafting a "
                "chain only (--speculative-num-steps N --speculative-eagle-topk 1 --speculative-num-draft-tokens N+1, "
                f"each given; got {s.steps}, {s.topk}, {s.tokens}; docs/serving.md#speculative-decoding)")
    return (f"{head} is proven for {PROVEN} (docs/serving.md#speculative-decoding); serve this model without a "
            "draft, or without --hs-dump-dir")


def from_server_args(cfg, arch: str) -> SpeculativeSetting:
    """The setting SGLang resolved (cfg: its resolving view of ServerArgs) for a model of architecture `arch`."""
    return SpeculativeSetting(
        algorithm=str(cfg.speculative_algorithm), arch=arch, cpu=getattr(cfg, "device", None) == "cpu",
        model_path=getattr(cfg, "model_path", None), draft_path=getattr(cfg, "speculative_draft_model_path", None),
        tp=getattr(cfg, "tp_size", 1) or 1, dp=getattr(cfg, "dp_size", 1) or 1,
        attn_dp=getattr(cfg, "attn_dp_size", 1) or 1,
        variant=next((flag for flag, field in SPECULATIVE_VARIANTS if getattr(cfg, field, False)), None),
        steps=getattr(cfg, "speculative_num_steps", None), topk=getattr(cfg, "speculative_eagle_topk", None),
        tokens=getattr(cfg, "speculative_num_draft_tokens", None))
