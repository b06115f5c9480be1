"""User latency while harvesting from live traffic, the reader stopped mid-load: does a user ever wait
on the reader? Four ways to serve the same request stream, side by side in ONE run:

  a_off           the launcher without --hs-dump-dir: plain serving, no capture (the yardstick)
  b_skip_drain    --hs-capture opt-in --hs-capture-sample 0.1 --hs-when-behind skip, a reader process
                  draining the output ring all along
  c_skip_stopped  the same server, the reader process SIGSTOPped once a quarter of the requests are
                  served; a ring small enough (--ring) that its unread records fill it, so requests
                  the sample picks afterwards find no room: they must be served anyway, without
                  capture, counted as reader_behind (read from /metrics,
                  docs/monitoring.md#when-requests-are-not-captured); the reader is SIGCONTed
                  after the run and must catch up with every record, none torn
  d_hold_stopped  --hs-capture all --hs-when-behind hold (the extraction default) with the reader stopped
                  the same way: requests are held in SGLang's queue once the ring is full. Bounded:
                  `--hold-deadline` seconds after the stop no new request is sent; the requests held
                  then (sglang_hs:admission_held) and those still in flight are reported, the reader
                  resumes and how long the held ones then take is reported too (never in the latency
                  percentiles, which cover the requests served before the deadline)

The stream: `--requests` requests from `--concurrency` closed-loop clients, mixed lengths (prompts of
32-512 tokens, 8-32 new tokens, greedy, ignore_eos), one in three an OpenAI chat completion, the rest
/generate, all streamed (time to first token = the first SSE chunk; total = the last), drawn from
`--seed`. Its shape (kinds, lengths, order) is the same for every way and repetition; the tokens are
drawn afresh per (repetition, way), so no server's radix cache has seen a prompt before. Three servers
(one per configuration; b and c share one) start at once and serve all repetitions; each repetition
runs the four ways in a rotated order (idle servers sleep, so each is woken first). Per way and
repetition: p50/p90/p99 of time to first token and of total latency, requests/s and generated tokens/s,
and the capture counters; the summary gives the median over repetitions with min-max, and each
percentile's ratio to a_off in the same repetition (median, min-max). Writes bench_harvest.csv (per
way and repetition), bench_harvest_requests.csv (per request), bench_harvest_summary.csv and
bench_harvest.png. Everything under /dev/shm is removed at the end, on Ctrl-C and SIGTERM too.

The servers run with OMP_WAIT_POLICY=PASSIVE (`--omp-wait-policy`): on a CPU shared with more runnable
threads than cores, libgomp's default spin-wait made the plain server's torch worker thread spin instead
of sleeping (almost no voluntary context switches, against ~570k in a capturing server, whose extra
threads running torch ops apparently throttle libgomp's spinning), and its decode steps ~15x slower
than the capturing servers': an artefact of the CPU engine on an oversubscribed machine that would be
charged to "capture off". The same policy for all three servers compares serving, not spinning.

    python benchmarks/bench_harvest.py --out benchmarks/results [--requests 40] [--concurrency 8] [--reps 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, List, Optional

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import _pyplot, machine, save_figure, stop_servers, write_csv, write_summary  # noqa: E402
from sglang_hs.tools.server_process import ServerProcess  # noqa: E402

WAYS = ("a_off", "b_skip_drain", "c_skip_stopped", "d_hold_stopped")
SERVER_OF = {"a_off": "off", "b_skip_drain": "skip", "c_skip_stopped": "skip", "d_hold_stopped": "hold"}
PROMPT_LENS, CHAT_LENS, NEW_TOKENS = (32, 64, 128, 256, 512), (32, 64, 128, 256), (8, 16, 32)
CONTEXT = 600  # > the longest prompt + answer (and chat template); the ring must hold 2 records of it
PCTS = (50, 90, 99)


# -- the request stream --
@dataclass
class Req:
    kind: str  # "generate" | "chat"
    prompt_len: int
    max_new: int
    ids: Optional[List[int]] = None
    text: Optional[str] = None


def stream_shape(seed: int, n: int) -> List[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = "chat" if i % 3 == 2 else "generate"
        out.append(Req(kind, rng.choice(CHAT_LENS if kind == "chat" else PROMPT_LENS), rng.choice(NEW_TOKENS)))
    return out


def fill_tokens(shape: List[Req], rng: random.Random, tok) -> List[Req]:
    """The same shape with fresh tokens; a chat prompt is the text of random token ids (about as many
    tokens again, plus the chat template)."""
    out = []
    for r in shape:
        ids = [rng.randint(5, tok.vocab_size - 1) for _ in range(r.prompt_len)]
        out.append(Req(r.kind, r.prompt_len, r.max_new, ids=ids if r.kind == "generate" else None,
                       text=tok.decode(ids) if r.kind == "chat" else None))
    return out


# -- the client --
def send(session: requests.Session, url: str, req: Req, rid: str):
    """Stream one request; returns (seconds to the first chunk, seconds to the last)."""
    if req.kind == "chat":
        path = "/v1/chat/completions"
        body = {"model": "default", "messages": [{"role": "user", "content": req.text}], "max_tokens": req.max_new,
                "temperature": 0, "ignore_eos": True, "stream": True, "rid": rid}
    else:
        path = "/generate"
        body = {"input_ids": req.ids, "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": req.max_new, "temperature": 0, "ignore_eos": True}}
    t0, first = time.perf_counter(), None
    with session.post(url + path, json=body, stream=True, timeout=(10, 600)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:"):
                continue
            if line.strip() == b"data: [DONE]":
                break
            if b'"error"' in line[:40]:
                raise RuntimeError(line.decode(errors="replace")[:300])
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0


def run_load(url: str, reqs: List[Req], rids: List[str], concurrency: int,
             trigger_at: Optional[int] = None, on_trigger: Optional[Callable[[], None]] = None,
             deadline_s: Optional[float] = None, on_deadline: Optional[Callable[[], dict]] = None) -> dict:
    """`concurrency` closed-loop clients send `reqs` in order. Once `trigger_at` requests are served,
    `on_trigger()` runs (the reader is stopped); `deadline_s` seconds later no new request is sent and
    `on_deadline()` runs (it reads the counters and resumes the reader); the requests in flight then are
    waited for and flagged as not served before the deadline."""
    lock, state = threading.Lock(), {"next": 0, "done": 0, "trigger_t": None, "stop": False}
    results: List[Optional[dict]] = [None] * len(reqs)

    def client():
        session = requests.Session()
        while True:
            with lock:
                i = state["next"]
                if state["stop"] or i >= len(reqs):
                    return
                state["next"] += 1
            sent = time.perf_counter()
            try:
                ttft, total = send(session, url, reqs[i], rids[i])
                row = {"ok": True, "ttft_s": ttft, "total_s": total}
            except Exception as e:  # noqa: BLE001 - reported per request, and the run goes on
                row = {"ok": False, "error": repr(e)[:200], "total_s": time.perf_counter() - sent}
            row.update(sent=sent - t_start, finished=time.perf_counter() - t_start)
            results[i] = row
            with lock:
                state["done"] += 1
                fire = trigger_at is not None and state["done"] == trigger_at
            if fire:
                on_trigger()
                state["trigger_t"] = time.perf_counter()

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    at_deadline = {}
    while any(t.is_alive() for t in threads):
        trig = state["trigger_t"]
        if deadline_s is not None and trig is not None and not state["stop"] and time.perf_counter() - trig > deadline_s:
            with lock:
                state["stop"] = True
            t_dead = time.perf_counter() - t_start
            at_deadline = {"deadline_at_s": t_dead, "in_flight_at_deadline": sum(
                1 for i in range(state["next"]) if results[i] is None)}
            at_deadline.update(on_deadline())
        time.sleep(0.05)
    wall = max((r["finished"] for r in results if r), default=0.0)
    trig = state["trigger_t"]
    return {"results": results, "wall_s": wall, "t_start": t_start, "trigger_s": trig - t_start if trig else None,
            **at_deadline}


# -- the reader that comes and goes --
def _drain(dump: str, counts) -> None:
    """A reader process: takes every record and marker as they come and drops them."""
    import torch

    from sglang_hs.reader import HiddenStateReader

    torch.set_num_threads(1)
    reader = HiddenStateReader(dump, recycle_memory=True, wait=600)
    counts[2] = 1  # open
    while True:
        markers = reader.markers
        n = reader.poll()
        for rid in reader.ready_rids():
            reader.pop_ready(rid)
        counts[0] += n - (reader.markers - markers)
        counts[1] = reader.markers
        if not n:
            time.sleep(0.002)


class ReaderProcess:
    def __init__(self, dump: str) -> None:
        ctx = mp.get_context("spawn")
        self.counts = ctx.RawArray("q", 3)  # records, markers, open; lock-free: the process gets SIGSTOPped
        self.proc = ctx.Process(target=_drain, args=(dump, self.counts), daemon=True)
        self.proc.start()

    @property
    def records(self) -> int:
        return self.counts[0]

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.is_alive():
            self.resume()
            self.proc.terminate()
            self.proc.join(10)


# -- the server's counters (docs/monitoring.md#metrics) --
def hs_metrics(url: str) -> Counter:
    """sglang_hs:* figures from /metrics, summed over writers; not-captured ones keyed by reason."""
    out: Counter = Counter()
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith("sglang_hs:") or "_created" in line.split(" ")[0]:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{")[0][len("sglang_hs:"):]
        reason = re.search(r'reason="([^"]+)"', name_labels)
        out[name + (f"[{reason.group(1)}]" if reason else "")] += float(value)
    return out


def steady_metrics(url: str, seconds: float = 5) -> Counter:
    """/metrics once two reads 0.6 s apart agree (it is refreshed every 0.5 s): the warm-up requests are
    counted before the measure."""
    deadline, m = time.monotonic() + seconds, hs_metrics(url)
    while time.monotonic() < deadline:
        time.sleep(0.6)
        m, prev = hs_metrics(url), m
        if m == prev:
            break
    return m


def not_captured(m: Counter) -> float:
    return sum(v for k, v in m.items() if k.startswith("requests_not_captured_total["))


def settled(url: str, before: Counter, n: int, seconds: float = 15) -> Counter:
    """/metrics once every one of the `n` requests is counted as captured or not (it is refreshed twice a
    second, and a record is published by the finish worker just after its answer)."""
    deadline = time.monotonic() + seconds
    while True:
        m = hs_metrics(url)
        got = (m["records_published_total"] - before["records_published_total"]) + not_captured(m) - not_captured(before)
        if got >= n or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def delta(after: Counter, before: Counter) -> dict:
    return {"captured": int(after["records_published_total"] - before["records_published_total"]),
            "not_sampled": int(after["requests_not_captured_total[not_sampled]"]
                               - before["requests_not_captured_total[not_sampled]"]),
            "skipped_reader_behind": int(after["requests_not_captured_total[reader_behind]"]
                                         - before["requests_not_captured_total[reader_behind]"]),
            "markers_dropped": int(after["skip_markers_dropped_total"] - before["skip_markers_dropped_total"]),
            "records_dropped": int(after["records_dropped_total"] - before["records_dropped_total"])}


def wait_caught_up(reader: ReaderProcess, url: str, seconds: float = 60) -> bool:
    """The reader has taken every record the server published (checked after it resumes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not reader.proc.is_alive():  # a torn record would have made it raise
            raise RuntimeError(f"the reader process exited with {reader.proc.exitcode}")
        if reader.records >= hs_metrics(url)["records_published_total"]:
            return True
        time.sleep(0.2)
    return False


# -- one way, one repetition --
def pct(xs, p) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def measure(way, server, reader, reqs, rep, args) -> tuple:
    rids = [f"hv{rep}-{way[0]}-{i}" for i in range(len(reqs))]
    for i in range(2):  # an idle server sleeps (--sleep-on-idle): wake it before timing
        requests.post(server.url + "/generate", json={"input_ids": [7] * 16, "rid": f"hv-warm-{way}-{rep}-{i}",
                                                       "sampling_params": {"max_new_tokens": 2}}, timeout=120)
    capture = way != "a_off"
    before = steady_metrics(server.url) if capture else Counter()
    stopped = way in ("c_skip_stopped", "d_hold_stopped")
    extra: dict = {}

    def at_deadline():
        m = hs_metrics(server.url)
        out = {"held_at_deadline": int(m["admission_held"]), "ring_fill_at_deadline": round(m["output_ring_fill_ratio"], 3)}
        reader.resume()
        extra["resumed"] = time.perf_counter()
        return out

    load = run_load(server.url, reqs, rids, args.concurrency,
                    trigger_at=len(reqs) // 4 if stopped else None, on_trigger=reader.stop if stopped else None,
                    deadline_s=args.hold_deadline if way == "d_hold_stopped" else None, on_deadline=at_deadline)
    res = load["results"]
    row = {"machine": machine(), "way": way, "rep": rep, "requests": len(reqs), "concurrency": args.concurrency}
    if way == "d_hold_stopped":
        served = [r for r in res if r and r["ok"] and r["finished"] <= load.get("deadline_at_s", float("inf"))]
        late = [r for r in res if r and r["finished"] > load.get("deadline_at_s", float("inf"))]
        row.update(sent=sum(1 for r in res if r), served_before_deadline=len(served),
                   held_at_deadline=load.get("held_at_deadline"), in_flight_at_deadline=load.get("in_flight_at_deadline"),
                   ring_fill_at_deadline=load.get("ring_fill_at_deadline"),
                   reader_stopped_at_s=round(load["trigger_s"], 2) if load["trigger_s"] is not None else None,
                   held_served_s_after_resume=round(load["t_start"] + max(r["finished"] for r in late)
                                                    - extra["resumed"], 2) if late and "resumed" in extra else None)
        wall = load.get("deadline_at_s", load["wall_s"])
    else:
        served = [r for r in res if r and r["ok"]]
        wall = load["wall_s"]
    row["failed"] = sum(1 for r in res if r and not r["ok"])
    row["served"] = len(served)
    for key in ("ttft_s", "total_s"):
        for p in PCTS:
            row[f"{key[:-2]}_p{p}_ms"] = round(1000 * pct([r[key] for r in served], p), 1)
    row["req_per_s"] = round(len(served) / wall, 3) if wall else None
    new_tokens = sum(q.max_new for q, r in zip(reqs, res) if any(r is x for x in served))
    row["gen_tok_per_s"] = round(new_tokens / wall, 1) if wall else None
    if capture:
        after = settled(server.url, before, row["sent"] if "sent" in row else len(reqs))
        row.update(delta(after, before))
        if stopped:
            if way == "c_skip_stopped":
                row["reader_stopped_at_s"] = round(load["trigger_s"], 2) if load["trigger_s"] is not None else None
                row["ring_fill_at_end"] = round(after["output_ring_fill_ratio"], 3)
                reader.resume()
            row["reader_caught_up"] = wait_caught_up(reader, server.url)
            row["records_dropped"] = delta(hs_metrics(server.url), before)["records_dropped"]
    per_request = [{"way": way, "rep": rep, "i": i, "kind": q.kind, "prompt_len": q.prompt_len, "max_new": q.max_new,
                    **({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} if r else {"sent": None})}
                   for i, (q, r) in enumerate(zip(reqs, res))]
    return row, per_request


def warm_up(servers, shape, tok, concurrency) -> None:
    """A first pass of every prompt length at the measured concurrency on each server, not measured: the
    first requests of a fresh CPU server are several times slower (first shapes)."""
    t0 = time.perf_counter()
    kinds = {(q.kind, q.prompt_len): q for q in shape}
    reqs = fill_tokens(list(kinds.values()) * 2, random.Random("warm-up"), tok)
    threads = [threading.Thread(target=run_load, args=(s.url, reqs, [f"hv-warm-{name}-{i}" for i in range(len(reqs))],
                                                       concurrency)) for name, s in servers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"warm-up {time.perf_counter() - t0:.0f}s", flush=True)


# -- summary and plot --
def summarise(rows) -> List[dict]:
    metrics = [f"{k}_p{p}_ms" for k in ("ttft", "total") for p in PCTS] + ["req_per_s", "gen_tok_per_s"]
    base = {r["rep"]: r for r in rows if r["way"] == "a_off"}
    out = []
    for way in WAYS:
        rs = [r for r in rows if r["way"] == way]
        if not rs:
            continue
        s = {"way": way, "reps": len(rs)}
        for m in metrics:
            vals = [r[m] for r in rs if r.get(m) is not None]
            ratios = [r[m] / base[r["rep"]][m] for r in rs if r["rep"] in base and base[r["rep"]].get(m)]
            s[m] = statistics.median(vals) if vals else None
            s[m + "_range"] = f"{min(vals):g}-{max(vals):g}" if vals else ""
            s[m + "_vs_a"] = round(statistics.median(ratios), 3) if ratios else None
            s[m + "_vs_a_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
        for k in ("served", "failed", "captured", "not_sampled", "skipped_reader_behind", "markers_dropped",
                  "records_dropped", "held_at_deadline", "in_flight_at_deadline", "served_before_deadline",
                  "held_served_s_after_resume", "ring_fill_at_end", "reader_caught_up"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                s[k] = "/".join(str(v) for v in vals)  # per repetition
        out.append(s)
    return out


def plot(summary, path, title) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    colors = {"a_off": "#888", "b_skip_drain": "#2a7", "c_skip_stopped": "#27a", "d_hold_stopped": "#c53"}
    width = 0.8 / len(summary)
    for ax, key in zip(axes[:2], ("ttft", "total")):
        for j, s in enumerate(summary):
            xs = [i + (j - (len(summary) - 1) / 2) * width for i in range(len(PCTS))]
            ys = [s[f"{key}_p{p}_ms"] or 0 for p in PCTS]
            lo_hi = [tuple(float(v) for v in s[f"{key}_p{p}_ms_range"].split("-")) if s[f"{key}_p{p}_ms_range"] else (y, y)
                     for p, y in zip(PCTS, ys)]
            err = [[y - lo for y, (lo, _) in zip(ys, lo_hi)], [hi - y for y, (_, hi) in zip(ys, lo_hi)]]
            label = s["way"]
            if s["way"] == "d_hold_stopped":
                label += f" (served before deadline; held {s.get('held_at_deadline', '?')})"
            ax.bar(xs, ys, width, yerr=err, capsize=2, color=colors[s["way"]], label=label)
        ax.set_xticks(range(len(PCTS)))
        ax.set_xticklabels([f"p{p}" for p in PCTS])
        ax.set_ylabel("ms (median over repetitions, bars: min-max)")
        ax.set_title("time to first token" if key == "ttft" else "total latency per request")
        ax.legend(fontsize=7)
    ax = axes[2]
    cols = [f"{k}_p{p}_ms" for k in ("ttft", "total") for p in PCTS]
    for j, s in enumerate(x for x in summary if x["way"] != "a_off"):
        xs = [i + (j - 1) * 0.27 for i in range(len(cols))]
        ax.bar(xs, [s[c + "_vs_a"] or 0 for c in cols], 0.27, color=colors[s["way"]], label=s["way"])
    ax.axhline(1.0, color="#999", lw=0.8)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([c[:-3].replace("_", " ") for c in cols], fontsize=8)
    ax.set_ylabel("latency / a_off's (same repetition), median")
    ax.set_title("ratio to capture off")
    ax.legend(fontsize=7)
    save_figure(plt, fig, path, title)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--requests", type=int, default=40, help="requests per way and repetition")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=float, default=0.1, help="--hs-capture-sample of b and c")
    ap.add_argument("--ring", default="2MiB", help="--hs-ring-size of the capturing servers (small: it must fill)")
    ap.add_argument("--ways", default=",".join(WAYS), help="which of the four ways to run (only their servers start)")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY of the three servers ('' leaves it unset; see the docstring)")
    ap.add_argument("--hold-deadline", type=float, default=10.0,
                    help="d_hold_stopped: seconds after the reader stops before no new request is sent")
    args = ap.parse_args(argv)
    if args.requests < 8:
        ap.error(f"--requests: at least 8 (a quarter is served before the reader stops), got {args.requests}")
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or set(ways) - set(WAYS):
        ap.error(f"--ways: a comma-separated subset of {','.join(WAYS)}, got {args.ways!r}")
    if not 0 < args.sample <= 1:
        ap.error(f"--sample: a fraction in (0, 1], got {args.sample}")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the servers are stopped on the way out
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # the servers inherit it
    from transformers import AutoTokenizer

    from sglang_hs.tools import tiny_model

    tok = AutoTokenizer.from_pretrained(tiny_model.ensure())
    work = tempfile.mkdtemp(prefix="bench-harvest-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    logs = tempfile.mkdtemp(prefix="bench-harvest-logs-")
    common = ["--context-length", str(CONTEXT), "--max-total-tokens", "8192", "--enable-metrics"]
    dumps = {"skip": os.path.join(work, "skip"), "hold": os.path.join(work, "hold")}
    flags = {"off": common,
             "skip": ["--hs-dump-dir", dumps["skip"], "--hs-ring-size", args.ring, "--hs-capture", "opt-in",
                      "--hs-capture-sample", str(args.sample), "--hs-when-behind", "skip", *common],
             "hold": ["--hs-dump-dir", dumps["hold"], "--hs-ring-size", args.ring, "--hs-capture", "all",
                      "--hs-when-behind", "hold", *common]}
    servers, readers, rows, per_request, ok = {}, {}, [], [], False
    try:
        for name, f in flags.items():
            if name in {SERVER_OF[w] for w in ways}:
                servers[name] = ServerProcess(f, log_path=os.path.join(logs, f"{name}.log"))
        t0 = time.perf_counter()
        for s in servers.values():
            s.wait_ready()
        print(f"servers ready in {time.perf_counter() - t0:.0f}s", flush=True)
        readers = {name: ReaderProcess(d) for name, d in dumps.items() if name in servers}
        shape = stream_shape(args.seed, args.requests)
        warm_up(servers, shape, tok, args.concurrency)
        for rep in range(args.reps):
            for k in range(len(ways)):
                way = ways[(k + rep) % len(ways)]
                reqs = fill_tokens(shape, random.Random(f"{args.seed}-{rep}-{way}"), tok)
                server = servers[SERVER_OF[way]]
                row, reqrows = measure(way, server, readers.get(SERVER_OF[way]), reqs, rep, args)
                rows.append(row)
                per_request += reqrows
                print(f"rep {rep} {way:15s} ttft p50/p90/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f}/"
                      f"{row['ttft_p99_ms']:.0f} ms  total {row['total_p50_ms']:.0f}/{row['total_p90_ms']:.0f}/"
                      f"{row['total_p99_ms']:.0f} ms  {row['req_per_s']} req/s  served {row['served']}"
                      + "".join(f"  {k} {row[k]}" for k in ("captured", "not_sampled", "skipped_reader_behind",
                                                             "markers_dropped", "records_dropped", "held_at_deadline",
                                                             "in_flight_at_deadline", "held_served_s_after_resume",
                                                             "reader_caught_up") if k in row), flush=True)
                write_csv(os.path.join(args.out, "bench_harvest.csv"), rows)
                write_csv(os.path.join(args.out, "bench_harvest_requests.csv"), per_request)
        ok = True
    finally:
        for r in readers.values():
            r.close()
        stop_servers(servers, work, logs, ok)
    summary = summarise(rows)
    write_summary(args.out, "bench_harvest", summary,
                  f"\nmedians over {args.reps} repetitions (min-max), ratio to a_off in the same repetition "
                  f"({machine()}):", lambda s: f"{s['way']:15s} " + "  ".join(
                      f"{k} p{p} {s[f'{k}_p{p}_ms']:.0f} ms ({s[f'{k}_p{p}_ms_range']}) x{s[f'{k}_p{p}_ms_vs_a']}"
                      for k in ("ttft", "total") for p in PCTS) + f"  {s['req_per_s']} req/s x{s['req_per_s_vs_a']}")
    plot(summary, os.path.join(args.out, "bench_harvest.png"),
         f"user latency, capture off vs harvesting (sample {args.sample}, skip) with the reader draining / stopped, "
         f"vs hold; {args.requests} requests x {args.reps}, {args.concurrency} in flight; {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
