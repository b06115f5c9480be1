"""python -m sglang_hs.selftest [launcher flags]

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
  --hs-copy ...    the other copy strategy than the reference's (staging when you gave none)
  sglang-json      SGLang's capture-only JSON path, chunked prefill and radix cache off (it returns
                   only the last chunk and the uncached suffix otherwise); aux layers only

Every configuration must give identical token ids and row counts, and values within bf16 tolerance of
the reference: median relative row error <= 0.02, >= 95% of rows within 0.05, and each row much closer
to its own reference row than to its neighbour's (which pins positions). bf16 MoE routing near-ties
flip an expert for an odd token, hence the share rather than a maximum. Exit 0 when all pass.
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
MEDIAN_TOL, ROW_TOL, ROW_SHARE = 0.02, 0.05, 0.95
WHOLE_PROMPT_CHUNK = "1024"  # longer than every self-test prompt: no chunking ("-1" breaks the CPU engine)
NEIGHBOUR_FACTOR = 3.0  # own-row median error must be this much below the off-by-one error


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
    from sglang_hs.server_process import ServerProcess

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
    from sglang_hs.server_process import ServerProcess

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


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each row (the last dim) against the reference row."""
    got, ref = got.float(), ref.float()
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)


def compare(got: List[Capture], ref: List[Capture]) -> Tuple[bool, dict]:
    same_ids = all(g.token_ids == r.token_ids for g, r in zip(got, ref))
    same_rows = all(g.aux.shape == r.aux.shape for g, r in zip(got, ref))
    row = {"requests": len(got), "rows": sum(g.aux.shape[0] for g in got), "ids": same_ids and same_rows}
    if not row["ids"]:
        return False, {**row, **{k: float("nan") for k in ("median", "max", "share", "neighbour")}}
    errs, shifted = [], []
    for g, r in zip(got, ref):
        parts = [(g.aux, r.aux)] + ([(g.last, r.last)] if g.last is not None and r.last is not None else [])
        for a, b in parts:
            errs.append(row_errors(a, b).flatten())
            if a.shape[0] > 1:
                shifted.append(row_errors(a[1:], b[:-1]).flatten())
    e = torch.cat(errs)
    row["median"], row["max"] = e.median().item(), e.max().item()
    row["share"] = (e <= ROW_TOL).float().mean().item()
    row["neighbour"] = torch.cat(shifted).median().item() if shifted else float("inf")
    ok = row["median"] <= MEDIAN_TOL and row["share"] >= ROW_SHARE and (
        row["neighbour"] >= NEIGHBOUR_FACTOR * max(row["median"], 1e-3))
    return ok, row


def print_table(rows: List[Tuple[str, bool, dict]]) -> None:
    head = f"{'configuration':<28} {'requests':>8} {'rows':>6} {'ids+counts':>10} {'median err':>10} " \
           f"{'max err':>8} {'rows<=' + str(ROW_TOL):>9} {'off-by-one':>10}  result"
    print(head)
    print("-" * len(head))
    for name, ok, r in rows:
        print(f"{name:<28} {r['requests']:>8} {r['rows']:>6} {'same' if r['ids'] else 'DIFFER':>10} "
              f"{r['median']:>10.4f} {r['max']:>8.4f} {100 * r['share']:>8.1f}% {r['neighbour']:>10.3f}  {'PASS' if ok else 'FAIL'}")


def configurations(sglang_args: List[str]) -> List[Tuple[str, List[str]]]:
    from sglang_hs.launch_server import _flag_value, cuda_available

    configs = [("chunked-16", ["--chunked-prefill-size", "16"]),
               ("plain-scheduler", ["--chunked-prefill-size", WHOLE_PROMPT_CHUNK, "--disable-radix-cache",
                                    "--disable-overlap-schedule"])]
    if _flag_value(sglang_args, "--device") not in (None, "cuda") or not cuda_available():
        return configs  # no CUDA graphs on the CPU engine
    return configs + [("no-cuda-graph", ["--disable-cuda-graph"])]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    from sglang_hs.capture_spec import CaptureConfigError
    from sglang_hs.launch_server import split_argv
    from sglang_hs.server_process import ServerStartError

    try:
        ns, sglang_args = split_argv(argv)
    except CaptureConfigError as e:
        print(f"sglang-hs selftest: error: {e}", file=sys.stderr)
        return 2
    if ns.hs_dump_dir:
        print("sglang-hs selftest: error: --hs-dump-dir is chosen by the self-test (a fresh folder per "
              "configuration); leave it out", file=sys.stderr)
        return 2
    hs_args = _hs_flags(ns)
    prompts = _prompts_for(sglang_args)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    workdir = tempfile.mkdtemp(prefix="sglang-hs-selftest-", dir=base)
    results: List[Tuple[str, bool, dict]] = []
    try:
        ref_runs, manifest = run_capture("reference", hs_args + sglang_args, prompts, ("cold", "warm"), workdir)
        ref = ref_runs["cold"]
        results.append(("reference, warm radix cache", *compare(ref_runs["warm"], ref)))
        for name, extra in configurations(sglang_args):
            runs, _ = run_capture(name, hs_args + sglang_args + extra, prompts, ("cold",), workdir)
            results.append((name, *compare(runs["cold"], ref)))
        other = "direct" if ns.hs_copy == "staging" else "staging"
        runs, _ = run_capture(f"copy-{other}", _hs_flags(ns, copy=other) + sglang_args, prompts, ("cold",), workdir)
        results.append((f"--hs-copy {other}", *compare(runs["cold"], ref)))
        json_caps = run_json(sglang_args, manifest["layer_ids"], manifest["hidden_size"], prompts, workdir)
        aux_only = [Capture(c.token_ids, c.aux, None) for c in ref]
        results.append(("sglang-json (aux layers)", *compare(json_caps, aux_only)))
    except (ServerStartError, RuntimeError, requests.RequestException, TimeoutError) as e:
        print(f"sglang-hs selftest: error: {e}\n(server logs: {workdir})", file=sys.stderr)
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


def _hs_flags(ns, copy: Optional[str] = None) -> List[str]:
    """The user's --hs-* flags (but the dump dir) back as arguments; `copy` overrides --hs-copy."""
    out = ["--hs-layers", ns.hs_layers] if ns.hs_layers is not None else []
    out += ["--hs-last"] if ns.hs_last else []
    copy = copy or ns.hs_copy
    out += ["--hs-copy", copy] if copy else []
    if copy == "staging" and ns.hs_staging_rows is not None:
        out += ["--hs-staging-rows", str(ns.hs_staging_rows)]
    for flag, value in (("--hs-ring-size", ns.hs_ring_size), ("--hs-admission-timeout", ns.hs_admission_timeout),
                        ("--hs-startup-timeout", ns.hs_startup_timeout)):
        if value is not None:
            out += [flag, str(value)]
    return out


def _prompts_for(argv: List[str]) -> List[List[int]]:
    from sglang_hs import tiny_model
    from sglang_hs.launch_server import _flag_value, _has_flag, read_model_config

    model = _flag_value(argv, "--model-path", "--model") or tiny_model.ensure()
    config = read_model_config(model, _has_flag(argv, "--trust-remote-code"))
    return make_prompts(int(config.get("vocab_size", 32000)))


if __name__ == "__main__":
    sys.exit(main())
