"""python -m sglang_hs.plan [--model-path M] [--hs-layers IDS] (--data FILE | --samples N --mean-tokens L |
                          --concurrent N [--request-tokens L])

What a capture and an extraction will need, before anything runs: bytes per token, the store and output
ring the server will make in its dump dir (sglang_hs/server/store/writer.py: a store of KV-slots x rows x hidden x
dtype bytes and a ring per writer, one writer per attention DP group; the ring as the launcher sizes it,
at least twice one record at the context length), and the disk the output takes per format in bf16 and
FP8 (sglang_hs/extract/sinks/), against what this machine has free: the dump dir's filesystem
(/dev/shm), the output's, and the GPUs torch sees. What does not fit is named with the flags that would
make it fit. --data counts the tokens exactly (tokenized as the extraction CLI does); --samples with
--mean-tokens estimates. --concurrent N (with --request-tokens L, each request's prompt + max_new_tokens;
default the context length) sizes for N such requests in flight at once: the ring admission needs for them
together (twice each one's worst-case record), and the store's KV slots (N x L; --max-total-tokens, which
SGLang's KV pool must hold too). --json prints the figures as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import List, Optional

PROG = "python -m sglang_hs.plan"
GPU_DEFAULT_RING = 1 << 30  # envs.DEFAULT_RING_BYTES
CPU_DEFAULT_RING = 256 << 20  # launch_server.CPU_DEFAULT_RING_SIZE
CPU_DEFAULT_SLOTS = 4096  # launch_server.CPU_DEFAULT_MAX_TOTAL_TOKENS
# Per file, beyond the rows (measured on files the sinks write; tests/unit/test_plan.py checks them):
SAFETENSORS_HEADER = 340  # JSON header with our metadata, about (the scales' entry: 90 more)
SPECFORGE_OVERHEAD = 2240  # torch.save's zip entries and pickle, about (the rows saved as one storage, as the CLI does)
ARROW_PER_TOKEN = 16  # speculators' dataset table: input_ids and loss_mask, int64
ARROW_PER_ROW = 32


class PlanError(RuntimeError):
    pass


# The row sizes of published checkpoints, so `--model-path ID` plans them offline (a folder or a config.json
# is read instead). From their config.json: DeepSeek-V3.2 is V3's shape; DeepSeek-V4 ("Pro") 7168 x 61
# layers and V4-Flash 4096 x 43, both with hc_mult 4 residual streams (MindFormers' and NeMo Automodel's
# DeepseekV4Config defaults, which follow the released configs).
KNOWN_CONFIGS = {
    "deepseek-ai/DeepSeek-V3.2": {"architectures": ["DeepseekV32ForCausalLM"], "hidden_size": 7168,
                                  "num_hidden_layers": 61, "max_position_embeddings": 163840,
                                  "torch_dtype": "bfloat16", "index_topk": 2048},
    "deepseek-ai/DeepSeek-V4-Pro": {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 7168,
                                    "num_hidden_layers": 61, "hc_mult": 4, "max_position_embeddings": 1048576,
                                    "torch_dtype": "bfloat16"},
    "deepseek-ai/DeepSeek-V4-Flash": {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 4096,
                                      "num_hidden_layers": 43, "hc_mult": 4, "max_position_embeddings": 1048576,
                                      "torch_dtype": "bfloat16"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("--model-path", default=None, help="a checkpoint folder or its config.json (default: the "
                                                       "embedded tiny model)")
    p.add_argument("--hs-layers", default=None, metavar="IDS", help="as the launcher's (default: the checkpoint's drafter layers, else [2, n//2, n-3])")
    p.add_argument("--no-hs-last", action="store_true", help="without the final state (the extraction CLI "
                                                             "always captures it)")
    p.add_argument("--hs-last", default="post-norm", choices=("post-norm", "pre-norm", "both"),
                   help="the server's --hs-last (default: one final state, as the extraction CLI starts it; both: "
                        "one more row per token)")
    p.add_argument("--hs-hc-streams", default=None, choices=("mean", "full"),
                   help="DeepSeek-V4 (hyper-connections): the launcher's (default mean: one row per layer; full: "
                        "hc_mult rows per layer)")
    p.add_argument("--data", default=None, metavar="FILE", help="the extraction's --data: tokens counted exactly")
    p.add_argument("--max-samples", type=int, default=None, metavar="N", help="with --data: the first N records")
    p.add_argument("--samples", type=int, default=None, metavar="N", help="without --data: this many samples")
    p.add_argument("--mean-tokens", type=float, default=None, metavar="L", help="without --data: of L tokens")
    p.add_argument("--concurrent", type=int, default=None, metavar="N",
                   help="requests in flight at once: the ring and store (KV slots) they need together")
    p.add_argument("--request-tokens", type=int, default=None, metavar="L",
                   help="with --concurrent: each request's prompt + max_new_tokens (default: the context length)")
    p.add_argument("--output", default=".", metavar="DIR", help="where the files will go (its free disk)")
    p.add_argument("--hs-dump-dir", default="/dev/shm", metavar="DIR", help="where the store and ring will go")
    p.add_argument("--dtype", default=None, help="the server's --dtype (default: the checkpoint's)")
    p.add_argument("--context-length", type=int, default=None, help="the server's (default: the config's)")
    p.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                   help="KV slots per writer: the store's rows (default: 4096 on the CPU engine; on GPUs "
                        "SGLang sizes the pool from free memory: give it to know the store)")
    p.add_argument("--page-size", type=int, default=1, help="the server's KV page size (default 1): the store has "
                                                             "a page of slots beyond the pool (SGLang's padding)")
    p.add_argument("--hs-ring-size", default=None, metavar="SIZE", help="as the launcher's")
    p.add_argument("--hs-max-record-tokens", type=int, default=None, metavar="N",
                   help="as the launcher's: the ring need only hold records of N tokens, not one at the context")
    p.add_argument("--hs-record-part-size", default=None, metavar="SIZE",
                   help="as the launcher's: records of more row bytes leave the ring in parts, so the ring need hold "
                        "one part of each (all its token ids), not the record")
    p.add_argument("--dp-size", type=int, default=1, help="with --enable-dp-attention: writers")
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--tp-size", "--tp", type=int, default=None, help="the server's (default: --dp-size); with "
                                                                    "--nnodes, where the writers run")
    p.add_argument("--nnodes", type=int, default=1, help="SGLang's --nnodes: /dev/shm is sized per node, for "
                                                         "the node with the most writers")
    p.add_argument("--device", default=None, help="cpu for the CPU engine (default: cuda when torch sees one)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def _config(model_path: Optional[str]) -> dict:
    from sglang_hs.tools import tiny_model

    if model_path in KNOWN_CONFIGS and not os.path.exists(model_path):
        return dict(KNOWN_CONFIGS[model_path])
    path = model_path or tiny_model.ensure()
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    else:
        from sglang_hs.tools.launch_server import CaptureConfigError, read_model_config

        if not os.path.isdir(path) and (os.path.isabs(path) or path.startswith(".")):
            raise PlanError(f"--model-path: {path} is neither a checkpoint folder nor a config.json")
        try:
            cfg = read_model_config(path, trust_remote_code=False)
        except CaptureConfigError as e:
            raise PlanError(str(e)) from None
        except (OSError, ValueError) as e:  # a hub id that is malformed, unknown or offline
            raise PlanError(f"--model-path: cannot read the config of {path}: {str(e).splitlines()[0]}") from None
    return cfg.get("text_config", cfg) if "text_config" in cfg else cfg


def _free(path: str) -> Optional[int]:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _gpus() -> List[dict]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append({"name": torch.cuda.get_device_name(i), "free": free, "total": total})
        return out
    except Exception:  # noqa: BLE001 - no driver: no GPUs
        return []


def token_counts(data: str, model_path: Optional[str], context, max_samples: Optional[int]) -> List[int]:
    """Tokens per sample the extraction will capture (prompt-only records at full length; skipped records
    left out), tokenized as the extraction CLI does; `context`: a context length or RequestLimits."""
    from transformers import AutoTokenizer

    from sglang_hs.tools import tiny_model
    from sglang_hs.extract.dataset import Preparer, SkipSample, read_records

    path = model_path or tiny_model.ensure()
    if os.path.isfile(path):
        path = os.path.dirname(path)
    prep = Preparer(AutoTokenizer.from_pretrained(path), context)
    out = []
    for index, record in read_records(data):
        if max_samples is not None and index >= max_samples:
            break
        try:
            out.append(len(prep(index, record).input_ids))
        except SkipSample:
            pass
    return out


def file_bytes(T: int, P: int, H: int, elem: int, kind: str) -> int:
    """One sample file of T tokens. kind: specforge, safetensors, fp8, fp8-per-layer."""
    ids = 16 * T  # input_ids / token_ids and loss_mask, int64
    if kind == "specforge":
        return T * P * H * elem + ids + SPECFORGE_OVERHEAD
    if kind == "safetensors":
        return T * P * H * elem + ids + SAFETENSORS_HEADER
    scales = 4 * T * (P if kind == "fp8-per-layer" else 1)
    return T * P * H + scales + ids + SAFETENSORS_HEADER + 90


# the numeric flags and what each takes: (flag, attribute, least value, what it is)
NUMBERS = (("--samples", "samples", 1, "samples"), ("--mean-tokens", "mean_tokens", 1, "tokens"),
           ("--max-samples", "max_samples", 0, "samples"), ("--context-length", "context_length", 1, "tokens"),
           ("--max-total-tokens", "max_total_tokens", 1, "KV slots"), ("--page-size", "page_size", 1, "tokens"),
           ("--concurrent", "concurrent", 1, "requests"), ("--request-tokens", "request_tokens", 1, "tokens"),
           ("--dp-size", "dp_size", 1, "ranks"), ("--tp-size", "tp_size", 1, "ranks"), ("--nnodes", "nnodes", 1, "nodes"),
           ("--hs-max-record-tokens", "hs_max_record_tokens", 1, "tokens"))


def check_numbers(ns) -> None:
    """A one-line PlanError for a numeric flag that is not a finite number at or above its least value (inf
    gave a traceback, a negative value negative sizes)."""
    for flag, attr, least, what in NUMBERS:
        v = getattr(ns, attr)
        if v is not None and not (math.isfinite(v) and v >= least):
            raise PlanError(f"{flag}: a number of {what} >= {least}, got {v}")


def node_writers(ns) -> List[int]:
    """Writers on each node of --nnodes (capture_spec.node_dp_ranks: a DP attention group's writer runs
    where its attention-TP rank 0 does; without DP attention, one writer, on node 0)."""
    from sglang_hs.server.capture_spec import node_dp_ranks

    dp = ns.dp_size if ns.enable_dp_attention else 1
    tp = ns.tp_size or dp
    if ns.nnodes < 1 or tp % ns.nnodes:
        raise PlanError(f"--nnodes {ns.nnodes}: must divide --tp-size ({tp}), as SGLang splits the TP ranks evenly "
                        "over the nodes")
    if dp < 1 or tp % dp:
        raise PlanError(f"--dp-size {dp}: must divide --tp-size ({tp}) with --enable-dp-attention")
    return [len(node_dp_ranks(tp, dp, ns.nnodes, r)) for r in range(ns.nnodes)]


def plan(ns) -> dict:
    from sglang_hs.server import layer_source
    from sglang_hs.server.capture_spec import CaptureSpec, hc_mult_of, parse_layer_ids
    from sglang_hs.tools.launch_server import parse_size
    from sglang_hs.server.store.admission import ring_floor
    from sglang_hs.server.store.ring import HEADER_BYTES, _align

    check_numbers(ns)
    cfg = _config(ns.model_path)
    try:
        # as the launcher: the layers the checkpoint's drafter reads (server/layer_source.py), else the default
        found = None if ns.hs_layers else layer_source.checkpoint_layers(cfg, ns.model_path or "the tiny model")
        ids = parse_layer_ids(ns.hs_layers) if ns.hs_layers else found and found["layers"]
        spec = CaptureSpec.resolve(ids, None if ns.no_hs_last else ns.hs_last, cfg["num_hidden_layers"],
                                   cfg["hidden_size"], hc_mult=hc_mult_of(cfg), streams=ns.hs_hc_streams)
    except ValueError as e:
        raise PlanError(str(e)) from None
    P, H = spec.rows_per_token, spec.hidden_size
    dtype = str(ns.dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    elem = 4 if dtype in ("float32", "float") else 2
    ctx = ns.context_length or cfg.get("max_position_embeddings") or 4096
    gpus = _gpus() if ns.device != "cpu" else []
    cpu = not gpus
    writers_by_node = node_writers(ns)
    writers = max(writers_by_node)  # /dev/shm is per node: the node with the most writers
    conc = concurrent_needs(ns, int(ctx), P, H, elem)
    pool = ns.max_total_tokens or (conc["kv_slots"] if conc else CPU_DEFAULT_SLOTS if cpu else None)
    slots = pool + ns.page_size if pool else None  # kv_index_translator.capture_token_capacity
    store = slots * P * H * elem if slots else None
    ring = parse_size(ns.hs_ring_size) if ns.hs_ring_size else (CPU_DEFAULT_RING if cpu else GPU_DEFAULT_RING)
    record_tokens = min(int(ctx), ns.hs_max_record_tokens or int(ctx))  # the ring's floor, as the launcher's
    need = ring_floor(record_tokens, P, H, elem, part_bytes=_part_bytes(ns))
    ring_grown = not ns.hs_ring_size and ring < need
    ring = max(ring, need, conc["ring_bytes"] if conc else 0) if not ns.hs_ring_size else ring
    if conc:  # how many of them the ring and the KV pool take at once
        conc["at_once_ring"] = min(conc["requests"], ring // conc["ring_bytes_each"])
        conc["at_once_kv"] = min(conc["requests"], pool // conc["tokens"])
    ring = HEADER_BYTES + _align(ring)  # the ring's file: its header, then the records
    if ns.data:
        from sglang_hs.extract.limits import RequestLimits

        # what the extraction sends: SGLang's own limits for this context and KV pool (extract/limits.py)
        counts = token_counts(ns.data, ns.model_path, RequestLimits.of_context(int(ctx), pool), ns.max_samples)
        samples, tokens, exact = len(counts), sum(counts), True
    elif conc and not ns.samples and not ns.mean_tokens:  # the files of those N requests
        counts = None
        samples, tokens, exact = conc["requests"], conc["requests"] * conc["tokens"], False
    else:
        if not ns.samples or not ns.mean_tokens:
            raise PlanError("--data, or --samples and --mean-tokens, or --concurrent say how much will be captured")
        counts = None
        samples, tokens, exact = ns.samples, int(ns.samples * ns.mean_tokens), False

    F = spec.num_aux + spec.last  # a file holds the layers and one final state, whatever the server captures

    def total(kind):
        e = 2 if kind == "specforge" else elem  # --format specforge is written in bf16 whatever the server's dtype
        if counts is not None:
            return sum(file_bytes(T, F, H, e, kind) for T in counts)
        return file_bytes(tokens, F, H, e, kind) + (samples - 1) * file_bytes(0, F, H, e, kind)

    arrow = ARROW_PER_TOKEN * tokens + ARROW_PER_ROW * samples
    files = {"specforge bf16": total("specforge"), "safetensors bf16": total("safetensors"),
             "safetensors fp8": total("fp8"), "safetensors fp8-per-layer": total("fp8-per-layer")}
    out = {"model": cfg.get("architectures", ["?"])[0], "layers": list(spec.layers), "last": spec.last,
           "hidden_size": H, "hc_mult": spec.hc_mult, "rows_per_layer": spec.rows_per_layer, "dtype": dtype,
           "bytes_per_token": P * H * elem, "bytes_per_token_fp8": P * H + 4,
           "context_length": int(ctx), "ring_floor_tokens": record_tokens, "writers": writers, "nnodes": ns.nnodes, "writers_by_node": writers_by_node,
           "kv_slots_per_writer": slots,
           "store_bytes_per_writer": store, "ring_bytes_per_writer": ring, "ring_needed_for_one_record": need,
           "ring_grown_to_context": ring_grown, "concurrent": conc,
           "dump_dir": ns.hs_dump_dir, "dump_dir_free": _free(ns.hs_dump_dir),
           "output": ns.output, "output_free": _free(ns.output), "gpus": gpus,
           "samples": samples, "tokens": tokens, "tokens_exact": exact,
           "disk_sample_files": files,  # the sample files alone; disk: with speculators' table
           "disk": {k: v + (arrow if k.startswith("safetensors") else 0) for k, v in files.items()}}
    if elem == 4:  # the server's dtype is not bf16: the default keeps it, --save-dtype bf16 halves it
        for key in ("disk", "disk_sample_files"):
            out[key] = {(k if k.startswith("specforge") else k.replace(" bf16", f" {dtype}")): v
                        for k, v in out[key].items()}
    out["problems"] = problems(out)
    return out


def _part_bytes(ns) -> int:
    """--hs-record-part-size in bytes (0: records whole)."""
    if getattr(ns, "hs_record_part_size", None) is None:
        return 0
    from sglang_hs.tools.launch_server import parse_size

    return parse_size(ns.hs_record_part_size, "--hs-record-part-size")


def concurrent_needs(ns, ctx: int, P: int, H: int, elem: int) -> Optional[dict]:
    """--concurrent N requests of --request-tokens L at once: the ring admission reserves for them (twice each
    one's worst-case record of L - 1 rows, admission.py) and the KV slots they hold (N x L); None without it."""
    from sglang_hs.server.store.admission import ring_floor

    if ns.concurrent is None:
        if ns.request_tokens is not None:
            raise PlanError("--request-tokens needs --concurrent (how many such requests run at once)")
        return None
    L = ns.request_tokens or ctx
    if L > ctx:
        raise PlanError(f"--request-tokens: {L} tokens exceed the context length of {ctx}; raise --context-length")
    each = ring_floor(L - 1, P, H, elem, part_bytes=_part_bytes(ns))
    return {"requests": ns.concurrent, "tokens": L, "record_bytes": each // 2, "ring_bytes_each": each,
            "ring_bytes": ns.concurrent * each, "kv_slots": ns.concurrent * L,
            "store_bytes": ns.concurrent * L * P * H * elem}


def _human(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def problems(f: dict) -> List[str]:
    out = []
    shm_need = f["writers"] * ((f["store_bytes_per_writer"] or 0) + f["ring_bytes_per_writer"])
    if f["dump_dir_free"] is not None and shm_need > f["dump_dir_free"]:
        ring_room = f["dump_dir_free"] // f["writers"] - (f["store_bytes_per_writer"] or 0)
        fix = (f"--hs-ring-size {max(ring_room, 0) // 2**20}MiB" if ring_room >= f["ring_needed_for_one_record"]
               else f"a smaller --max-total-tokens or --context-length, or more room (docker: --shm-size "
                    f"{math.ceil(shm_need / 2**30)}g)")
        out.append(f"store + ring: {_human(shm_need)} do not fit the {_human(f['dump_dir_free'])} free in "
                   f"{f['dump_dir']}: {fix}")
    c = f.get("concurrent")
    if c and c["at_once_ring"] < c["requests"]:
        out.append(f"ring: {c['requests']} requests of {c['tokens']:,} tokens at once need "
                   f"{_human(c['ring_bytes'])} of ring (twice each one's {_human(c['record_bytes'])} record), "
                   f"--hs-ring-size holds {c['at_once_ring']} at once (admission holds the rest"
                   + (", or refuses them: not one fits" if not c["at_once_ring"] else "")
                   + f"): --hs-ring-size {math.ceil(c['ring_bytes'] / 2**30)}GiB")
    if c and c["at_once_kv"] < c["requests"]:
        out.append(f"KV slots: {c['requests']} requests of {c['tokens']:,} tokens at once hold {c['kv_slots']:,}, "
                   f"--max-total-tokens {f['kv_slots_per_writer'] - 1:,} holds {c['at_once_kv']} at once: "
                   f"--max-total-tokens {c['kv_slots']} (a store of {_human(c['store_bytes'])})")
    free = f["output_free"]
    if free is not None:
        for kind, need in f["disk"].items():
            if need > free:
                fits = [k for k, v in f["disk"].items() if v <= free]
                n = int(f["samples"] * free / need) if need else 0
                hint = (f"--format {fits[0].split()[0]}" + (f" --save-dtype {fits[0].split()[1]}"
                                                            if "fp8" in fits[0] else "") if fits else "")
                out.append(f"--format {kind}: {_human(need)} do not fit the {_human(free)} free at {f['output']}: "
                           + (f"{hint}, or " if hint else "")
                           + f"--max-samples {n}, or --shard I/{math.ceil(need / free)} over as many disks")
    return out


def render(f: dict) -> str:
    hc = (f" x {f['rows_per_layer']} streams each" if f.get("rows_per_layer", 1) > 1 else
          f" (mean of {f['hc_mult']} streams)" if f.get("hc_mult", 1) > 1 else "")
    L = [f"{f['model']}: layers {f['layers']}{hc}{' + the final state' if f['last'] else ''}, hidden {f['hidden_size']}, "
         f"{f['dtype']}: {f['bytes_per_token']:,} bytes per token ({f['bytes_per_token_fp8']:,} in FP8)",
         f"data: {f['samples']:,} samples, {f['tokens']:,} tokens ({'counted' if f['tokens_exact'] else 'estimated'})",
         f"dump dir {f['dump_dir']} ({_human(f['dump_dir_free'])} free), per writer x {f['writers']}"
         + (f" on each node with writers (writers per node: {f['writers_by_node']}; /dev/shm is per node)"
            if f["nnodes"] > 1 else "") + ":"]
    if f["store_bytes_per_writer"] is None:
        L.append("  store: KV slots x bytes per token: SGLang sizes the KV pool from GPU memory at start; pass "
                 "--max-total-tokens to know it (1M slots: " + _human(1e6 * f["bytes_per_token"]) + ")")
    else:
        L.append(f"  store: {_human(f['store_bytes_per_writer'])} ({f['kv_slots_per_writer']:,} KV slots)")
    L.append(f"  ring:  {_human(f['ring_bytes_per_writer'])}" + (
        f" (grown to hold one {f['ring_floor_tokens']:,}-token record twice)" if f["ring_grown_to_context"] else ""))
    c = f.get("concurrent")
    if c:
        L.append(f"  {c['requests']} requests of {c['tokens']:,} tokens at once: ring {_human(c['ring_bytes'])} "
                 f"(twice each one's {_human(c['record_bytes'])} record; this ring holds {c['at_once_ring']} at once), "
                 f"store {_human(c['store_bytes'])} ({c['kv_slots']:,} KV slots, --max-total-tokens; the pool holds "
                 f"{c['at_once_kv']} at once)")
    for g in f["gpus"]:
        L.append(f"GPU {g['name']}: {_human(g['free'])} free of {_human(g['total'])}")
    L.append(f"output {f['output']} ({_human(f['output_free'])} free):")
    for kind, n in f["disk"].items():
        L.append(f"  --format {kind:<26} {_human(n)}")
    L += [f"does not fit: {p}" for p in f["problems"]] or ["everything fits"]
    return "\n".join(L)


def main(argv: Optional[List[str]] = None) -> int:
    from sglang_hs.server.capture_spec import CaptureConfigError

    ns = build_parser().parse_args(argv)
    try:
        f = plan(ns)
    except (PlanError, ValueError, OSError, CaptureConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(f, indent=1) if ns.json else render(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
