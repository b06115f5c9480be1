"""python -m sglang_hs.selftest [--only NAMES] [launcher flags]

Run this on your own node before a long extraction. The same prompts go through the server with
capture on in several configurations, and through SGLang's own capture-only JSON path
(`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`, `return_hidden_states`) on the
same build; then a pass/fail table. Launcher flags (model, parallelism, --hs-layers, ...) apply to every
configuration; the self-test chooses its own dump dir, port and the flags each configuration varies.

Configurations (each a fresh server):
  reference        your flags as given (cold radix cache), then the same prompts again (warm cache)
  chunked-16       --chunked-prefill-size 16: every prompt split into many chunks
  plain-scheduler  chunked prefill (a chunk longer than any prompt), radix cache and the overlap
                   scheduler all off
  no-cuda-graph    --disable-cuda-graph (on a GPU only)
  --hs-copy ...    each other copy strategy than the reference's (direct when you gave none; deferred only
                   on a GPU)
  sglang-json      SGLang's capture-only JSON path, chunked prefill and radix cache off (it returns
                   only the last chunk and the uncached suffix otherwise); aux layers only

--only NAMES (comma-separated: chunked-16, plain-scheduler, no-cuda-graph, copy-direct, copy-staging,
copy-deferred, sglang-json) runs the reference and those configurations only: each configuration starts a
server, which on a large model takes minutes. One that cannot run here (no-cuda-graph or copy-deferred
without CUDA, the reference's own copy strategy, sglang-json for DeepSeek-V4) is said and skipped; when none
of them can, the self-test stops before starting any server.

DeepSeek-V4 (hyper-connection streams): `--hs-hc-streams mean|full` reaches every configuration, and the
sglang-json configuration is skipped (SGLang's capture-only JSON path is EAGLE-3's, which SGLang 0.5.23 does
not serve for V4). On the CPU engine it runs the V4s that sglang-hs's CPU-engine patches serve (compress ratios
0, 4, 128) and refuses the others in one line before starting any server, as it does flags the launcher would
refuse for the model (--hs-hc-streams for a model with one residual stream, --hs-layers out of range).

Every configuration must give identical token ids and row counts, and every row is judged against its
own reference row (relative L2 error): within the dtype's tolerance (bf16 0.05, fp16 0.02, float32
0.001), with a median <= 0.02. Only on a half-precision server may a few rows exceed it: where MoE
routing is a near tie, bf16 (and the batch a token runs in) can pick the other expert for that token
(measured against HF float32 on the tiny model: median row error 0.007-0.010, 4 of 300 rows far off,
one at 0.39). Up to 5% of rows may, each only if it is at least twice as close to its own reference
row as to any other reference row of its record around it that differs from it (its layer at the
tokens before and after, the other layers at its token): another token's, layer's or record's row
fails alone. A float32 server gets no allowance. Exit 0 when all pass.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Tuple

import requests
import torch

NEW_TOKENS = 4
# Relative L2 error allowed per row, by the server's dtype: bf16 runs differ from float32 by a median
# 0.007-0.010 per row, fp16 carries 3 more mantissa bits, float32 servers agree to ~1e-6.
ROW_TOL = {"bfloat16": 0.05, "float16": 0.02, "float32": 1e-3}
MEDIAN_TOL = 0.02
FAR_SHARE = 0.05  # half precision only: rows beyond ROW_TOL (MoE routing near-ties), at most this share
NEIGHBOUR_FACTOR = 2.0  # such a row: at least this much closer to its own reference row than to any other
WHOLE_PROMPT_CHUNK = "1024"  # longer than every self-test prompt: no chunking ("-1" breaks the CPU engine)


@dataclass
class Capture:
    token_ids: List[int]
    aux: torch.Tensor  # [T, K, H]
    last: Optional[torch.Tensor]  # [T, H]


def make_prompts(vocab_size: int, seed: int = 0) -> List[List[int]]:
    """Short and long prompts, two sharing a 30-token prefix with a third, and an exact repeat."""
    rng = random.Random(seed)
    hi = max(10, min(vocab_size, 32000)) - 1

    def draw(n):
        return [rng.randint(5, hi) for _ in range(n)]

    long = draw(70)
    prompts = [draw(5), draw(29), draw(47), long, long[:30] + draw(12), long[:30] + draw(25)]
    return prompts + [list(prompts[2])]


def _generate(url: str, rid: str, ids: List[int], json_path: bool) -> dict:
    body = {"input_ids": ids, "rid": rid,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    if json_path:
        body["return_hidden_states"] = True
    r = requests.post(f"{url}/generate", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"request {rid}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _send_all(url: str, tag: str, prompts, json_path: bool = False) -> List[dict]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_generate, url, f"selftest-{tag}-{i}", p, json_path) for i, p in enumerate(prompts)]
        return [f.result() for f in futures]


def run_capture(name: str, launcher_args: List[str], prompts, passes: Tuple[str, ...], workdir: str):
    """Serve with capture on; returns ({pass: [Capture per prompt]}, manifest)."""
    from sglang_hs.reader import HiddenStateReader
    from sglang_hs.tools.server_process import ServerProcess

    dump = os.path.join(workdir, f"dump-{name}")
    out = {}
    with ServerProcess(["--hs-dump-dir", dump, *launcher_args], os.path.join(workdir, f"{name}.log")) as server:
        print(f"[selftest] {name}: starting ({' '.join(launcher_args) or 'your flags only'})", flush=True)
        server.wait_ready()
        reader = HiddenStateReader(dump)
        for p in passes:
            replies = _send_all(server.url, f"{name}-{p}", prompts)
            caps = []
            for i, (ids, reply) in enumerate(zip(prompts, replies)):
                rec = reader.take(f"selftest-{name}-{p}-{i}", timeout=120)
                caps.append(Capture((ids + reply["output_ids"])[:-1], rec.aux_hidden_states.clone(),
                                    None if rec.last_hidden_state is None else rec.last_hidden_state.clone()))
                if rec.input_ids.tolist() != caps[-1].token_ids:
                    raise RuntimeError(f"{name}: record {i} holds other token ids than the request")
            out[p] = caps
        return out, reader.manifest


def run_json(sglang_args: List[str], layer_ids: List[int], hidden: int, prompts, workdir: str) -> List[Capture]:
    """SGLang's capture-only JSON path. Its EAGLE3 convention adds 1 to every id when the first is 1, so
    a first id of 1 is asked for as [0] + ids and the extra block dropped."""
    from sglang_hs.tools.server_process import ServerProcess

    ask, drop = (layer_ids, 0) if layer_ids[0] != 1 else ([0] + layer_ids, 1)
    args = [*sglang_args, "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *map(str, ask),
            "--disable-radix-cache", "--chunked-prefill-size", WHOLE_PROMPT_CHUNK]
    with ServerProcess(args, os.path.join(workdir, "sglang-json.log")) as server:
        print("[selftest] sglang-json: starting (SGLang's capture-only JSON path)", flush=True)
        server.wait_ready()
        replies = _send_all(server.url, "json", prompts, json_path=True)
    caps = []
    for ids, reply in zip(prompts, replies):
        chunks = reply["meta_info"]["hidden_states"]  # [prompt rows], then one row per decode step
        rows = list(chunks[0]) + [c if isinstance(c[0], float) else c[0] for c in chunks[1:]]
        aux = torch.tensor(rows, dtype=torch.float32).view(len(rows), len(ask), hidden)[:, drop:]
        caps.append(Capture((ids + reply["output_ids"])[:-1], aux, None))
    return caps


def _rows(c: Capture, with_last: bool) -> torch.Tensor:
    """[T, P, H]: the aux layers, then the final state when both sides have it."""
    return torch.cat([c.aux, c.last[:, None]], 1) if with_last else c.aux


def judge_rows(got: torch.Tensor, ref: torch.Tensor, tol: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row of one record ([T, P, H] each): its relative error against its own reference row, and
    whether it is at least NEIGHBOUR_FACTOR times closer to that row than to every other reference row
    around it (its layer at tokens t-1 and t+1, the other layers at token t) that differs from its own
    by more than 4 * tol (closer rows are the same values for this purpose, e.g. the embedding of a
    repeated token). Both [T, P]."""
    got, ref = got.float(), ref.float()
    T, P, _ = ref.shape
    own_dist = (got - ref).norm(dim=-1)
    ref_norm = ref.norm(dim=-1).clamp_min(1e-6)
    nearest = torch.full((T, P), float("inf"))
    others = [(dt, p, p) for dt in (-1, 1) for p in range(P)] + [(0, p, q) for p in range(P) for q in range(P) if q != p]
    for dt, p, q in others:  # got[t, p] against ref[t + dt, q]
        t = torch.arange(max(0, -dt), min(T, T - dt))
        other = ref[t + dt, q]
        differs = (other - ref[t, p]).norm(dim=-1) > 4 * tol * ref_norm[t, p]
        dist = (got[t, p] - other).norm(dim=-1).masked_fill(~differs, float("inf"))
        nearest[t, p] = torch.minimum(nearest[t, p], dist)
    return own_dist / ref_norm, own_dist * NEIGHBOUR_FACTOR <= nearest


def compare(got: List[Capture], ref: List[Capture], dtype: str = "bfloat16") -> Tuple[bool, dict]:
    """Judge every row of `got` against `ref` (see the module docstring); returns (pass, table row)."""
    tol = ROW_TOL.get(dtype, ROW_TOL["bfloat16"])
    allowance = FAR_SHARE if dtype in ("bfloat16", "float16") else 0.0
    same_ids = len(got) == len(ref) and all(g.token_ids == r.token_ids for g, r in zip(got, ref))
    same_rows = same_ids and all(g.aux.shape == r.aux.shape and (g.last is None) == (r.last is None)
                                 and (g.last is None or g.last.shape == r.last.shape) for g, r in zip(got, ref))
    row = {"requests": len(got), "rows": sum(g.aux.shape[0] for g in got), "ids": same_ids and same_rows, "tol": tol}
    if not row["ids"]:
        return False, {**row, "median": float("nan"), "max": float("nan"), "far": 0, "unlike": 0, "allowed": 0}
    errs, closer = [], []
    for g, r in zip(got, ref):
        with_last = g.last is not None and r.last is not None
        e, c = judge_rows(_rows(g, with_last), _rows(r, with_last), tol)
        errs.append(e.flatten())
        closer.append(c.flatten())
    e, c = torch.cat(errs), torch.cat(closer)
    far = e > tol
    row["median"], row["max"] = e.median().item(), e.max().item()
    row["far"], row["unlike"] = int(far.sum()), int((far & ~c).sum())  # beyond tolerance; of those, not closest to own
    row["allowed"] = int(allowance * e.numel())
    ok = row["median"] <= MEDIAN_TOL and row["far"] <= row["allowed"] and row["unlike"] == 0
    return ok, row


def print_table(rows: List[Tuple[str, bool, dict]]) -> None:
    head = f"{'configuration':<28} {'requests':>8} {'rows':>6} {'ids+counts':>10} {'median err':>10} " \
           f"{'max err':>8} {'beyond tol':>12} {'unlike own':>10}  result"
    print(head)
    print("-" * len(head))
    for name, ok, r in rows:
        beyond = f"{r['far']}/{r['allowed']} @{r['tol']:g}"
        print(f"{name:<28} {r['requests']:>8} {r['rows']:>6} {'same' if r['ids'] else 'DIFFER':>10} "
              f"{r['median']:>10.4f} {r['max']:>8.4f} {beyond:>12} {r['unlike']:>10}  {'PASS' if ok else 'FAIL'}")
    print(f"(beyond tol: rows whose relative error exceeds the tolerance / rows allowed to (half precision: "
          f"{100 * FAR_SHARE:.0f}%, MoE routing near-ties); unlike own: of those, rows not {NEIGHBOUR_FACTOR:g}x "
          "closer to their own reference row than to any other around it)")


CONFIG_NAMES = ("chunked-16", "plain-scheduler", "no-cuda-graph", "copy-direct", "copy-staging", "copy-deferred",
                "sglang-json")  # the copy ones: each --hs-copy strategy other than the reference's


def take_only(argv: List[str]) -> Tuple[List[str], Optional[set]]:
    """`--only NAMES` out of `argv`: (the other arguments, the chosen configuration names or None for all).
    ValueError in one line for a missing value or an unknown name."""
    rest, only = [], None
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a == "--only" or a.startswith("--only="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            if "=" not in a:
                next(it, None)
            names = [n.strip() for n in value.split(",") if n.strip()]
            unknown = [n for n in names if n not in CONFIG_NAMES]
            if not names or unknown:
                raise ValueError(f"--only: comma-separated configuration names out of {', '.join(CONFIG_NAMES)}, "
                                 f"got {value!r}")
            only = (only or set()) | set(names)
        else:
            rest.append(a)
    return rest, only


def configurations(sglang_args: List[str]) -> List[Tuple[str, List[str]]]:
    from sglang_hs.tools.argv import flag_value
    from sglang_hs.tools.launch_server import cuda_available

    configs = [("chunked-16", ["--chunked-prefill-size", "16"]),
               ("plain-scheduler", ["--chunked-prefill-size", WHOLE_PROMPT_CHUNK, "--disable-radix-cache",
                                    "--disable-overlap-schedule"])]
    if flag_value(sglang_args, "--device") not in (None, "cuda") or not cuda_available():
        return configs  # no CUDA graphs on the CPU engine
    return configs + [("no-cuda-graph", ["--disable-cuda-graph"])]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        argv, only = take_only(argv)
    except ValueError as e:
        print(f"sglang-hs selftest: error: {e}", file=sys.stderr)
        return 2

    def chosen(name: str) -> bool:
        return only is None or name in only
    from sglang_hs.server.capture_spec import CaptureConfigError
    from sglang_hs.tools.launch_server import split_argv
    from sglang_hs.tools.server_process import ServerStartError

    try:
        ns, sglang_args = split_argv(argv)
    except CaptureConfigError as e:
        print(f"sglang-hs selftest: error: {e}", file=sys.stderr)
        return 2
    if ns.hs_dump_dir:
        print("sglang-hs selftest: error: --hs-dump-dir is chosen by the self-test (a fresh folder per "
              "configuration); leave it out", file=sys.stderr)
        return 2
    try:
        hc = _check_model(ns, sglang_args)
    except CaptureConfigError as e:
        print(f"sglang-hs selftest: error: {e}", file=sys.stderr)
        return 2
    hs_args = _hs_flags(ns)
    from sglang_hs.tools.launch_server import runs_on_cpu

    # (name, table label, launcher flags) of each configuration after the reference, as this run can have them
    plan = [(name, name, hs_args + sglang_args + extra) for name, extra in configurations(sglang_args)]
    plan += [(f"copy-{other}", f"--hs-copy {other}", _hs_flags(ns, copy=other) + sglang_args)
             for other in other_copies(ns.hs_copy, runs_on_cpu(sglang_args))]
    runnable = [name for name, _, _ in plan] + ([] if hc else ["sglang-json"])
    if only is not None:
        if not only & set(runnable):
            print(f"sglang-hs selftest: error: --only {','.join(sorted(only))}: none of these configurations runs "
                  f"with these flags on this machine (here: {', '.join(runnable)})", file=sys.stderr)
            return 2
        for name in sorted(only - set(runnable)):
            print(f"[selftest] --only {name}: skipped (it does not run with these flags on this machine)", flush=True)
    prompts = _prompts_for(sglang_args)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    workdir = tempfile.mkdtemp(prefix="sglang-hs-selftest-", dir=base)
    results: List[Tuple[str, bool, dict]] = []
    try:
        ref_runs, manifest = run_capture("reference", hs_args + sglang_args, prompts, ("cold", "warm"), workdir)
        ref = ref_runs["cold"]
        dtype = manifest["dtype"]  # the server's: each has its own tolerance
        results.append(("reference, warm radix cache", *compare(ref_runs["warm"], ref, dtype)))
        for name, label, args in plan:
            if chosen(name):
                runs, _ = run_capture(name, args, prompts, ("cold",), workdir)
                results.append((label, *compare(runs["cold"], ref, dtype)))
        if hc and only is None:  # DeepseekV4ForCausalLM has no set_eagle3_layers_to_capture
            print("[selftest] sglang-json: skipped (SGLang 0.5.23's capture-only JSON path is EAGLE-3's, which "
                  "DeepSeek-V4 does not serve)", flush=True)
        elif not hc and chosen("sglang-json"):
            json_caps = run_json(sglang_args, manifest["layer_ids"], manifest["hidden_size"], prompts, workdir)
            aux_only = [Capture(c.token_ids, c.aux, None) for c in ref]
            results.append(("sglang-json (aux layers)", *compare(json_caps, aux_only, dtype)))
    except (ServerStartError, RuntimeError, requests.RequestException, TimeoutError) as e:
        if os.listdir(workdir):
            print(f"sglang-hs selftest: error: {e}\n(server logs: {workdir})", file=sys.stderr)
        else:  # no server wrote anything: no folder left behind
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"sglang-hs selftest: error: {e}", file=sys.stderr)
        return 1
    print(f"\nsglang-hs self-test: layers {manifest['layer_ids']}{' + last' if manifest['last'] else ''} "
          f"(HF output_hidden_states {manifest['hf_output_hidden_states_index']}), {manifest['model_path']}; "
          f"every configuration against the reference (cold radix cache, your flags)\n")
    print_table(results)
    ok = all(r[1] for r in results)
    print(f"\n{'PASS' if ok else 'FAIL'}: {sum(r[1] for r in results)} of {len(results)} configurations agree")
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"server logs kept in {workdir}")
    return 0 if ok else 1


def _check_model(ns, sglang_args: List[str]) -> bool:
    """The launcher's checks of the model and capture flags, before any server starts (CaptureConfigError in
    one line: --hs-hc-streams for a model without hyper-connections, a DeepSeek-V4 the CPU-engine patches do
    not serve on the CPU engine). Returns whether the model has hyper-connection streams (DeepSeek-V4)."""
    from sglang_hs.tools import tiny_model
    from sglang_hs.tools.argv import flag_value
    from sglang_hs.tools.launch_server import resolve_capture, runs_on_cpu

    model = flag_value(sglang_args, "--model-path", "--model") or tiny_model.ensure()
    _, _, spec = resolve_capture(ns, sglang_args, model, runs_on_cpu(sglang_args),
                                 v4_hint=": run the self-test on a GPU node")
    return spec.hc_mult > 1


def other_copies(copy: Optional[str], cpu: bool) -> List[str]:
    """The copy strategies the self-test runs besides the reference's (`copy`, direct when None): deferred
    needs CUDA."""
    from sglang_hs import envs

    return [c for c in envs.COPY_STRATEGIES if c != (copy or "direct") and not (cpu and c == "deferred")]


def _hs_flags(ns, copy: Optional[str] = None) -> List[str]:
    """The user's --hs-* flags (but the dump dir) back as arguments; `copy` overrides --hs-copy."""
    out = ["--hs-layers", ns.hs_layers] if ns.hs_layers is not None else []
    out += ["--hs-last", ns.hs_last] if ns.hs_last else []
    out += ["--hs-hc-streams", ns.hs_hc_streams] if ns.hs_hc_streams else []
    copy = copy or ns.hs_copy
    out += ["--hs-copy", copy] if copy else []
    if copy in ("staging", "deferred"):
        out += ["--hs-staging-rows", str(ns.hs_staging_rows)] if ns.hs_staging_rows is not None else []
    if copy == "staging":
        out += ["--hs-scatter-threads", str(ns.hs_scatter_threads)] if ns.hs_scatter_threads is not None else []
    for flag, value in (("--hs-ring-size", ns.hs_ring_size), ("--hs-admission-timeout", ns.hs_admission_timeout),
                        ("--hs-startup-timeout", ns.hs_startup_timeout), ("--hs-gather-threads", ns.hs_gather_threads),
                        ("--hs-max-record-tokens", ns.hs_max_record_tokens)):
        if value is not None:
            out += [flag, str(value)]
    return out


def _prompts_for(argv: List[str]) -> List[List[int]]:
    from sglang_hs.tools import tiny_model
    from sglang_hs.tools.argv import flag_value, has_flag
    from sglang_hs.tools.launch_server import read_model_config

    model = flag_value(argv, "--model-path", "--model") or tiny_model.ensure()
    config = read_model_config(model, has_flag(argv, "--trust-remote-code"))
    return make_prompts(int(config.get("vocab_size", 32000)))


if __name__ == "__main__":
    sys.exit(main())
