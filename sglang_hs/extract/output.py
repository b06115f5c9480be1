"""What an extraction (cli.py) and a harvest (harvest.py) check and write besides the sample files: the
output folder (made and checked), the final state the format trains on (checked against the server's),
the run's counts (Stats) and its summary line, manifest.json, and the trainer's command and run config."""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import List, Optional, Tuple

from sglang_hs.server.capture_spec import final_states, last_choice
from sglang_hs.extract.checkpoint_names import (SPECULATORS_VERIFIER, checkpoint_keys, speculators_renames,
                                                 write_speculators_verifier)
from sglang_hs.extract.errors import PROG, ExtractError

SKIPS_LISTED = 1000  # the first skipped records the manifest lists (with where they are and why); all are counted
SKIPS_PRINTED = 20  # the first skipped records the run reports as they come


class Stats:
    def __init__(self) -> None:
        self.done = self.tokens = self.bytes = self.resumed = self.verified = 0
        self.verify_max_diff = 0.0
        self.skipped: "collections.Counter[str]" = collections.Counter()
        self.skipped_records: List[dict] = []  # the first SKIPS_LISTED: where each is (line, rid...) and why
        self.failed: List[Tuple[int, str]] = []
        self.foreign = 0
        self.t0 = time.monotonic()
        self.t1 = None  # when the run loop ended (the summary excludes server start and stop)
        self.cpu0, self.cpu1 = time.process_time(), None  # this process's CPU seconds over the same span

    def skip(self, reason: str, detail: str, place: str, **where) -> Optional[str]:
        """Count a skipped record (`place`: where it is, in words; `where`: the same for the manifest, e.g. its
        sample index and line, or its rid); the line to report it with, for the first SKIPS_PRINTED."""
        self.skipped[reason] += 1
        n = sum(self.skipped.values())
        if n <= SKIPS_LISTED:
            self.skipped_records.append({**where, "reason": reason, "detail": detail})
        if n > SKIPS_PRINTED:
            return None
        more = (f" (the next skips are only counted; manifest.json lists the first {SKIPS_LISTED})"
                if n == SKIPS_PRINTED else "")
        return f"[extract] skipped {place}: {reason}" + (f": {detail}" if detail else "") + more

    def summary(self) -> dict:
        wall = (self.t1 or time.monotonic()) - self.t0
        return {"samples_written": self.done, "samples_already_done": self.resumed, "skipped": dict(self.skipped),
                "skipped_records": self.skipped_records,
                "failed": [{"index": i, "error": e} for i, e in self.failed], "tokens": self.tokens,
                "bytes": self.bytes, "verified": self.verified, "verify_max_logprob_diff": round(self.verify_max_diff, 5),
                "wall_s": round(wall, 2),
                "client_cpu_s": round((self.cpu1 or time.process_time()) - self.cpu0, 2),
                "samples_per_s": round(self.done / wall, 3) if wall else 0.0,
                "tokens_per_s": round(self.tokens / wall, 1) if wall else 0.0,
                "foreign_records_dropped": self.foreign}


def print_summary(stats: Stats, out_dir: str) -> None:
    s = stats.summary()
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(s["skipped"].items())) or "none"
    print(f"[extract] {s['samples_written']} samples written ({s['samples_already_done']} already done), "
          f"skipped: {skipped}; failed: {len(s['failed'])}; {s['tokens']} tokens, {s['bytes'] / 1e6:.1f} MB in "
          f"{s['wall_s']:.1f}s ({s['samples_per_s']:.2f} samples/s, {s['tokens_per_s']:.0f} tokens/s); "
          f"verified {s['verified']} (max logprob difference {s['verify_max_logprob_diff']:.4f}); output {out_dir}", file=sys.stderr, flush=True)


def prepare_output(out_dir: str, gid: Optional[int]) -> None:
    """--output made, or checked, as the dump dir is (fsutil.ensure_output_dir): this user's folder, not a
    symlink, 0700 (0750 of --output-group); another user's folder (a world-writable tmpfs lets anyone make
    one first) is refused in one line."""
    from sglang_hs.fsutil import ensure_output_dir

    try:
        ensure_output_dir(out_dir, gid)
    except (OSError, ValueError) as e:
        raise ExtractError(str(e)) from None


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


def draft_config(manifest: dict) -> dict:
    """Draft-model config fields for these layers, in SGLang's EAGLE-3 id convention."""
    layers = manifest["layer_ids"]
    note = ("SGLang's set_eagle3_layers_to_capture adds 1 to every id when the first id is 1 (SpecForge "
            "writes [1, n//2-1, n-4] for HF output_hidden_states [2, n//2, n-3]); otherwise ids are used as "
            "given. These ids make SGLang capture exactly HF output_hidden_states "
            f"{layers}, the rows in these files.")
    if layers[0] == 2:
        ids = [i - 1 for i in layers]
    elif layers[0] != 1:
        ids = list(layers)
    else:
        ids, note = None, ("no EAGLE-3 id list makes SGLang capture a first layer of 1 (HF output_hidden_states"
                           "[1]): it adds 1 when the first id is 1; capture other layers to serve this draft")
    out = {}
    if manifest.get("hc_mult", 1) > 1:  # DeepSeek-V4: SGLang 0.5.23 serves DSpark drafters for it, not EAGLE-3
        ids = None
        note = ("SGLang 0.5.23 serves DeepSeek-V4 drafters through DSpark (DeepseekV4ForCausalLM has no "
                "set_eagle3_layers_to_capture): dspark_config.target_layer_ids are its dspark_layers_to_capture, "
                "captured after layer j (the state entering layer j+1, the stream mean), so they make SGLang "
                f"capture exactly HF output_hidden_states {layers} (.mean(-2))")
        if manifest.get("hc_streams") == "full":
            note += ("; these files hold every stream (hc_mult rows per id), SGLang's DSpark capture serves their "
                     "mean only")
        out["dspark_config"] = {"target_layer_ids": manifest.get("dspark_layer_ids")}
        out.update(hc_mult=manifest["hc_mult"], hc_streams=manifest.get("hc_streams", "mean"),
                   rows_per_layer=manifest.get("rows_per_layer", 1))
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            **out, "target_hidden_size": manifest["hidden_size"], "sglang_id_convention": note,
            # `speculators train --target-layer-ids` takes the aux ids only (HF output_hidden_states
            # indices, space-separated): the final state is the file's last row, never one of these ids
            "speculators_layer_ids": list(layers)}


SPECFORGE_CONFIG = "specforge_train.json"
DRAFT_VOCAB_SIZE = 32000  # the EAGLE-3 drafts' usual draft vocabulary (speculators' converter default)


def specforge_config(out_dir: str, manifest: dict) -> dict:
    """A `specforge train --config` run config (SpecForge 0.2.0's schema) for the files in `out_dir`: an
    offline EAGLE-3 run on them, the target's lm_head and embeddings from the served checkpoint, samples
    up to the server's context length."""
    cfg = {"model": {"target_model_path": manifest["model_path"], "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": out_dir},
           "training": {"strategy": "eagle3"},
           "output_dir": out_dir.rstrip(os.sep) + "-specforge"}
    if manifest.get("context_len"):
        cfg["data"]["max_length"] = int(manifest["context_len"])
    cfg["model"].update(checkpoint_keys(manifest["model_path"]))
    return cfg


def training_command(out_dir: str, manifest: dict, fmt: str, save_dtype: Optional[str]) -> List[str]:
    """The trainer's command line for the files of this run (argv; SpecForge's reads SPECFORGE_CONFIG)."""
    if fmt == "specforge":
        return ["specforge", "train", "--config", os.path.join(out_dir, SPECFORGE_CONFIG)]
    verifier = manifest["model_path"]
    if speculators_renames(verifier):  # written beside the files by print_training_command
        verifier = os.path.join(out_dir, SPECULATORS_VERIFIER)
    cmd = ["speculators", "train", "--speculator-type", "eagle3", "--verifier-name-or-path", verifier,
           "--data-path", out_dir, "--target-layer-ids", *map(str, manifest["layer_ids"]),
           "--hidden-states-backend", "fp8" if (save_dtype or "").startswith("fp8") else "file",
           "--hidden-states-dtype", "bfloat16"]
    vocab = manifest.get("vocab_size")
    if vocab and vocab > DRAFT_VOCAB_SIZE:  # token_freq.pt in --data-path: the draft head's most frequent tokens
        cmd += ["--draft-vocab-size", str(DRAFT_VOCAB_SIZE)]
    return cmd


def print_training_command(out_dir: str, manifest: dict, fmt: str, save_dtype: Optional[str],
                           gid: Optional[int] = None) -> None:
    """Say how to train on the files just written (SpecForge: with the run config written beside them)."""
    import shlex

    if not manifest["last"]:
        return
    if fmt == "specforge":
        with open(os.path.join(out_dir, SPECFORGE_CONFIG), "w") as f:
            json.dump(specforge_config(out_dir, manifest), f, indent=1)
    else:
        shim = os.path.join(out_dir, SPECULATORS_VERIFIER)
        try:
            if write_speculators_verifier(out_dir, manifest["model_path"], gid):
                print(f"[extract] {manifest['model_path']} names its lm_head (head.weight) or embedding as DeepSeek-V4 "
                      "does, which speculators 0.9.0 does not find (it would take the embedding as lm_head): its "
                      f"verifier is {shim}, those tensors renamed", file=sys.stderr, flush=True)
        except OSError as e:  # a full disk: the files are complete, the trainer's verifier is not
            print(f"[extract] warning: cannot write {shim} ({e}), which the command below names as speculators' "
                  "verifier: free space and rerun the extraction with --resume", file=sys.stderr, flush=True)
    cmd = " ".join(shlex.quote(a) for a in training_command(out_dir, manifest, fmt, save_dtype))
    trainer = "SpecForge 0.2.0" if fmt == "specforge" else "speculators 0.9.0"
    print(f"[extract] train with {trainer}:\n  {cmd}", file=sys.stderr, flush=True)


def model_vocab_size(model_path: str) -> Optional[int]:
    """The served checkpoint's vocabulary size (config.json, a wrapper's text_config, or Mistral's params.json);
    None when it cannot be read (a hub name, or no path: not the current folder's config.json)."""
    if not model_path:
        return None
    for name, keys in (("config.json", ("vocab_size",)), ("config.json", ("text_config", "vocab_size")),
                       ("params.json", ("vocab_size",))):
        try:
            with open(os.path.join(model_path, name)) as f:
                value = json.load(f)
            for k in keys:
                value = value[k]
            return int(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _stored_dtype(save_dtype: Optional[str], server_dtype: str) -> str:
    if save_dtype is None:
        return server_dtype
    return {"bf16": "bfloat16", "fp8": "float8_e4m3fn (a float32 scale per token)",
            "fp8-per-layer": "float8_e4m3fn (a float32 scale per token and layer)"}[save_dtype]


def write_manifest(out_dir: str, server_manifest: dict, ns, stats: Stats, sink, status: str,
                   dataset: Optional[dict] = None) -> None:
    from sglang_hs.version import SGLANG_VERSION, __version__

    m = server_manifest
    doc = {
        "status": status, "format": sink.name, "sglang_hs_version": __version__, "sglang_version": SGLANG_VERSION,
        "model_path": m["model_path"], "architecture": m["architecture"], "dtype": m["dtype"],
        "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_hidden_layers"], "layer_ids": m["layer_ids"],
        "last_hidden_state": m["last"], "hf_output_hidden_states_index": m["hf_output_hidden_states_index"],
        "convention": m["convention"], "draft_model_config": draft_config(m),
        # DeepSeek-V4: how its hc_mult streams became rows (capture_spec.HC_CONVENTION)
        **{k: m[k] for k in ("hc_mult", "hc_streams", "rows_per_layer", "hc_convention", "dspark_layer_ids") if k in m},
        "data": (os.path.abspath(ns.data) if os.path.exists(ns.data) else ns.data) if ns.data else None,
        "from_dump": os.path.abspath(ns.from_dump) if ns.from_dump else None,
        "save_dtype": ns.save_dtype, "stored_dtype": _stored_dtype(ns.save_dtype, m["dtype"]),
        "shard": ns.shard or "0/1", "regenerate": ns.regenerate, "command": [PROG.split()[-1], *sys.argv[1:]],
        "samples_on_disk": sink.existing(), **stats.summary(),
    }
    if m["last"]:
        doc["last_states"] = list(final_states(m))  # the final states the server captured
        doc["final_state_stored"] = sink.final_state  # the one in these files
        doc["train_command"] = training_command(out_dir, m, sink.name, ns.save_dtype)
    if sink.name == "safetensors":
        doc["speculators_dataset_rows"] = (dataset or {}).get("rows")  # None: not written by this run
        # speculators' train --hidden-states-backend: the file backend reads FP8 files without their scales
        doc["speculators_hidden_states_backend"] = "fp8" if (ns.save_dtype or "").startswith("fp8") else "file"
    from sglang_hs.fsutil import write_private_file

    write_private_file(out_dir, "manifest.json", json.dumps(doc, indent=1).encode(), getattr(sink, "share_gid", None))
