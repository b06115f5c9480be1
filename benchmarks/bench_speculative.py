"""Capture under speculative decoding (issue 44), side by side in ONE run on the CPU engine:

  a_spec_capture     ALGO + --hs-dump-dir: `--regenerate` extraction (the CLI, --server, safetensors files)
  b_plain_capture    --hs-dump-dir without a draft: the same extraction
  c_spec_plain       ALGO without capture, driven by /generate with the extraction's requests
  d_spec_capture_gen a_spec_capture's server driven like c_spec_plain (a reader drains the ring)
  e_spec_select      ALGO + --hs-dump-dir + --hs-capture-accept-lowest 0.5 (keep the half of recent traffic the
                     draft did worst on), driven like c_spec_plain: what selection on the draft costs users

ALGO (--algorithm): NGRAM (no draft model), or EAGLE3 with the tiny EAGLE-3 draft (sglang_hs/tools/tiny_eagle3.py:
its aux layers captured beside ours; one step, top-1, the setting its published figures were measured with).

Same tiny checkpoint, bf16, greedy, the same conversations (repetitive text, so n-gram drafts get
accepted) with a 96-token reply each; every server sees each prompt set once per rep (fresh prompts each
rep: no radix hits across methods). Reported per rep and as medians: generated tokens/s, the ratios
a/b (what speculative decoding buys an extraction; the replies must be the same tokens) and d/c (what
capture costs a speculative server; goal >= 0.97), and SGLang's accepted drafts per verify (c and d must
agree: capture changes no draft), e/c (selection on vs capture off: users' tokens/s and median request latency).
The generate ways (c, d, e) run in a rotated order, one step on per rep, so that no way is always the one
that runs last. `--generate-only` runs c, d and e only (no extraction, no server b): the figure for users'
latency with selection on, `bench_speculative_selection.*`.
Writes bench_speculative.csv, bench_speculative_summary.csv and
bench_speculative.png (bench_speculative_eagle3.* for EAGLE3).

    python benchmarks/bench_speculative.py --out benchmarks/results [--algorithm NGRAM|EAGLE3] [--reps 3]
        [--samples 8] [--concurrency 4] [--generate-only]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, stop_servers, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess  # noqa: E402

NEW_TOKENS = 96
WORDS = ("one two three four five six seven eight nine ten the cat sat on mat and dog log red blue green "
         "alpha beta gamma delta").split()


def conversations(rng, n):
    """n user turns of a few words repeated (n-gram drafting feeds on repeats)."""
    out = []
    for _ in range(n):
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8)))
        out.append({"conversations": [{"role": "user", "content": (phrase + ". ") * rng.randint(3, 6)},
                                      {"role": "assistant", "content": "replaced by --regenerate"}]})
    return out


def extract(server, dump, data, out, conc) -> dict:
    from sglang_hs.extract.cli import main as run

    rc = run(["--data", data, "--output", out, "--format", "safetensors", "--server", server.url,
              "--hs-dump-dir", dump, "--concurrency", str(conc), "--regenerate", "--max-new-tokens",
              str(NEW_TOKENS), "--no-progress"])
    assert rc == 0, f"the extraction from {server.url} failed ({rc})"
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert not m["failed"], m["failed"][:3]
    return {"seconds": m["wall_s"], "samples": m["samples_written"]}


def generate(server, prompts, conc, dump=None) -> dict:
    """/generate of each prompt (greedy, NEW_TOKENS); with `dump`, a reader thread drains its ring."""
    stop, reader_thread, kept, done_ns = threading.Event(), None, {"records": 0, "markers": 0}, []
    if dump is not None:
        from sglang_hs import HiddenStateReader, status

        def drain():
            with HiddenStateReader(dump) as reader:
                def take():
                    reader.poll()
                    for rid in reader.ready_rids():
                        kept["records"] += reader.pop_ready(rid) is not None
                    kept["markers"] += len(reader.take_markers())

                while not stop.is_set():
                    take()
                    stop.wait(0.01)
                status.settled(dump, since_ns=done_ns[0])  # every reply's record or marker published: a last take
                take()

        reader_thread = threading.Thread(target=drain, daemon=True)
        reader_thread.start()

    def one(ids):
        r = requests.post(f"{server.url}/generate", timeout=900, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
        r.raise_for_status()
        return r.json()

    latencies = []

    def timed(ids):
        t = time.perf_counter()
        out = one(ids)
        latencies.append(time.perf_counter() - t)
        return out

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as pool:
        outs = list(pool.map(timed, prompts))
    seconds = time.perf_counter() - t0
    done_ns.append(time.monotonic_ns())
    stop.set()
    if reader_thread is not None:
        reader_thread.join(120)
        assert not reader_thread.is_alive(), f"the reader of {dump} did not settle"
    meta = [o["meta_info"] for o in outs]
    verifies = sum(m.get("spec_verify_ct", 0) for m in meta)
    return {"seconds": seconds, "samples": len(outs), "outputs": [o["output_ids"] for o in outs],
            "median_latency_s": statistics.median(latencies),
            "kept_records": kept["records"] if dump else None, "markers": kept["markers"] if dump else None,
            "accepted_per_verify": (sum(m.get("spec_num_correct_drafts", 0) for m in meta) / verifies
                                    if verifies else None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--algorithm", choices=("NGRAM", "EAGLE3"), default="NGRAM")
    ap.add_argument("--generate-only", action="store_true",
                    help="ways c, d and e only: users' tokens/s and latency with capture and selection on")
    args = ap.parse_args()
    name = "bench_speculative" + ("" if args.algorithm == "NGRAM" else "_" + args.algorithm.lower())
    name += "_selection" if args.generate_only else ""
    spec = ["--speculative-algorithm", args.algorithm]
    if args.algorithm == "EAGLE3":
        from sglang_hs.tools import tiny_eagle3

        spec += ["--speculative-draft-model-path", tiny_eagle3.ensure(), "--speculative-num-steps", "1",
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-spec-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    files, logs = tempfile.mkdtemp(prefix="bench-spec-files-"), tempfile.mkdtemp(prefix="bench-spec-logs-")
    common = ["--max-total-tokens", "8192", "--chunked-prefill-size", "256"]
    dumps = {"a": os.path.join(work, "a"), "b": os.path.join(work, "b"), "e": os.path.join(work, "e")}
    servers = {
        "a_spec_capture": ServerProcess(["--hs-dump-dir", dumps["a"], "--hs-last", "pre-norm", *spec, *common],
                                        os.path.join(logs, "a.log")),
        "c_spec_plain": ServerProcess([*spec, *common], os.path.join(logs, "c.log")),
        "e_spec_select": ServerProcess(["--hs-dump-dir", dumps["e"], "--hs-last", "pre-norm", *spec, *common,
                                        "--hs-capture-accept-lowest", "0.5"], os.path.join(logs, "e.log")),
    }
    if not args.generate_only:
        servers["b_plain_capture"] = ServerProcess(["--hs-dump-dir", dumps["b"], "--hs-last", "pre-norm", *common],
                                                   os.path.join(logs, "b.log"))
    rows, ok = [], False
    try:
        for s in servers.values():
            s.wait_ready()
        from transformers import AutoTokenizer

        from sglang_hs.tools import tiny_model

        tok = AutoTokenizer.from_pretrained(tiny_model.ensure())
        rng = random.Random(0)
        for rep in range(args.reps):
            convs = conversations(rng, args.samples)
            data = os.path.join(work, f"data-{rep}.jsonl")
            with open(data, "w") as f:
                f.writelines(json.dumps(c) + "\n" for c in convs)
            ids = lambda t: t["input_ids"] if hasattr(t, "keys") else list(t)  # noqa: E731 (BatchEncoding or list)
            # the generate runs use other prompts of the same shape (reversed words): no radix hit on the
            # prefix the extraction runs cached
            other = [ids(tok.apply_chat_template([{"role": "user", "content": " ".join(
                c["conversations"][0]["content"].split()[::-1])}], add_generation_prompt=True, tokenize=True))
                for c in convs]
            res = {}
            for method in () if args.generate_only else ("a_spec_capture", "b_plain_capture"):
                out = os.path.join(files, f"{method}-{rep}")
                res[method] = extract(servers[method], dumps[method[0]], data, out, args.concurrency)
                shutil.rmtree(out, ignore_errors=True)
            ways = [("c_spec_plain", servers["c_spec_plain"], None),
                    ("d_spec_capture_gen", servers["a_spec_capture"], dumps["a"]),
                    ("e_spec_select", servers["e_spec_select"], dumps["e"])]
            for method, server, dump in ways[rep % 3:] + ways[:rep % 3]:  # rotated: none always runs last
                res[method] = generate(server, other, args.concurrency, dump)
            res = {m: res[m] for m in sorted(res)}
            same = res["c_spec_plain"]["outputs"] == res["d_spec_capture_gen"]["outputs"]
            if args.algorithm != "NGRAM":  # a model draft: capture must change no draft (NGRAM's corpora differ)
                same = same and res["c_spec_plain"]["accepted_per_verify"] == res["d_spec_capture_gen"]["accepted_per_verify"]
            for method, r in res.items():
                tokens = r["samples"] * NEW_TOKENS  # --regenerate: every reply runs to NEW_TOKENS (no EOS here)
                rows.append({"rep": rep, "method": method, "samples": r["samples"], "seconds": round(r["seconds"], 3),
                             "gen_tokens_per_s": round(tokens / r["seconds"], 2),
                             "median_latency_s": round(r["median_latency_s"], 3) if "median_latency_s" in r else None,
                             "accepted_per_verify": r.get("accepted_per_verify"), "same_outputs_c_d": same,
                             "kept_records": r.get("kept_records"), "markers": r.get("markers"),
                             "algorithm": args.algorithm})
                print(rows[-1], flush=True)
            write_csv(os.path.join(args.out, f"{name}.csv"), rows)
        ok = True
    finally:
        stop_servers(servers, work, logs, ok)
        shutil.rmtree(files, ignore_errors=True)
    med = {m: statistics.median(r["gen_tokens_per_s"] for r in rows if r["method"] == m)
           for m in dict.fromkeys(r["method"] for r in rows)}
    of = lambda m: [r for r in rows if r["method"] == m]  # noqa: E731 (in rep order)
    per_rep = lambda a, b, k="gen_tokens_per_s": [x[k] / y[k] for x, y in zip(of(a), of(b))]  # noqa: E731
    summary = [{"method": m, "median_gen_tokens_per_s": round(v, 2)} for m, v in med.items()]
    for title, a, b in (("ratio a/b (speculative vs not, extraction)", "a_spec_capture", "b_plain_capture"),
                        ("ratio d/c (capture on vs off, speculative)", "d_spec_capture_gen", "c_spec_plain"),
                        ("ratio e/c (selection on vs capture off, speculative)", "e_spec_select", "c_spec_plain")):
        if not of(a) or not of(b):
            continue
        line = {"method": title, "median": round(statistics.median(per_rep(a, b)), 3), "per_rep": per_rep(a, b)}
        if of(a)[0]["median_latency_s"] is not None:  # generate ways: users' median request latency, a over b
            line["median_latency_ratio"] = round(statistics.median(per_rep(a, b, "median_latency_s")), 3)
            line["latency_ratio_per_rep"] = [round(x, 3) for x in per_rep(a, b, "median_latency_s")]
        summary.append(line)
    write_summary(args.out, name, summary, f"\nmedians ({machine()}):", lambda s: str(s))
    plt = _pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        methods = list(med)
        for i, m in enumerate(methods):
            vals = [r["gen_tokens_per_s"] for r in rows if r["method"] == m]
            ax.scatter([i] * len(vals), vals, color="#27a")
            ax.bar(i, med[m], color="#ccc", zorder=0)
        ax.set_xticks(range(len(methods)), methods, rotation=15, fontsize=8)
        ax.set_ylabel("generated tokens/s (bars: median, dots: reps)")
        save_figure(plt, fig, os.path.join(args.out, f"{name}.png"),
                    f"speculative ({args.algorithm}) vs not, capture on vs off; CPU engine ({machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
