"""The status files' freshness contract (sglang_hs/server/overlay_status.py) and the waits that settle on
it (sglang_hs/status.py): a snapshot is written every tick with a seq and the time it was taken before
its figures, `unaccounted` never drops before the outcome it waits for is counted, and `settled` never
returns a snapshot older than the moment it is asked about."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from sglang_hs import status
from sglang_hs.server import overlay_status
from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.server.overlay_status import OverlayStatus


@pytest.fixture
def fast_flush(monkeypatch):
    monkeypatch.setattr(overlay_status, "FLUSH_INTERVAL_S", 0.02)


@pytest.fixture
def overlay(tmp_path, fast_flush):
    made = []

    def make(**sources):
        s = OverlayStatus(str(tmp_path), "DeepseekV3ForCausalLM", CaptureSpec.resolve([1], True, 4, 8))
        s.sources.update(sources)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def _file(tmp_path):
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("overlay-")]
    return json.loads(path.read_text())


def test_every_tick_writes_a_newer_snapshot_even_when_nothing_changed(overlay, tmp_path):
    overlay(writer={"records": 0})
    first = status.wait(str(tmp_path), lambda x: "writer" in x, timeout=30)["files"][0]
    deadline = time.monotonic() + 30
    while (now := _file(tmp_path))["seq"] < first["seq"] + 3:
        assert time.monotonic() < deadline, now
        time.sleep(0.01)
    assert now["as_of_ns"] > first["as_of_ns"] and now["writer"] == first["writer"]
    assert now["unaccounted"] == 0 and "writer_id" not in now


class _Timed(dict):
    """Counters that note when they are read (dict(x) of a dict subclass with its own keys() calls it)."""

    def __init__(self, reads, **kw):
        super().__init__(**kw)
        self.reads = reads

    def keys(self):
        self.reads.append(time.monotonic_ns())
        return super().keys()

    def __iter__(self):
        return iter(self.keys())


def test_as_of_is_taken_before_unaccounted_and_unaccounted_before_the_figures(overlay, tmp_path):
    """The order that makes `unaccounted == 0` mean every outcome is in the figures: the time, then
    unaccounted, then the counters (a plant reading unaccounted after the counters fails here)."""
    figures, counted = [], []
    s = overlay(writer=_Timed(figures, records=1))
    s.unaccounted = lambda: (counted.append(time.monotonic_ns()), 0)[1]
    snap = status.wait(str(tmp_path), lambda x: bool(counted) and bool(figures), timeout=30)
    s.stop()
    assert counted and figures
    assert snap["as_of_ns"] <= min(t for t in counted if t >= snap["as_of_ns"]) <= \
        min(t for t in figures if t >= snap["as_of_ns"])
    pairs = list(zip(counted[-len(figures):], figures)) if len(figures) <= len(counted) else []
    assert pairs and all(c <= f for c, f in pairs), (counted, figures)


def test_settled_waits_for_a_snapshot_newer_than_asked_and_nothing_unaccounted(overlay, tmp_path, monkeypatch):
    pending = [2]
    counters = {"records": 0}
    s = overlay(writer=counters)
    s.unaccounted = lambda: pending[0]
    with pytest.raises(status.NotSettled, match="unaccounted 2"):
        status.settled(str(tmp_path), timeout=0.3)

    # a starved flusher: the thread writes nothing for a while; the file on disk says nothing is pending,
    # but it is older than the moment asked about, so settled must not take it
    pending[0] = 0
    status.settled(str(tmp_path), timeout=30)
    gate, parked = threading.Event(), threading.Event()
    flush = s._flush
    monkeypatch.setattr(s, "_flush", lambda: (parked.set(), gate.wait(), flush())[2])
    assert parked.wait(30)  # the thread is stuck before its next write (the old forms read the file at once)
    stale = _file(tmp_path)
    counters["records"] = 5  # published after that file was written
    t = time.monotonic_ns()
    got = []
    waiter = threading.Thread(target=lambda: got.append(status.settled(str(tmp_path), since_ns=t, timeout=30)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got, "settled returned a snapshot older than since_ns"
    gate.set()
    waiter.join(30)
    assert got and got[0]["writer"]["records"] == 5 and got[0]["as_of_ns"] > t > stale["as_of_ns"]


def test_until_is_judged_on_fresh_snapshots_only(overlay, tmp_path):
    counters = {"records": 0}
    overlay(writer=counters)
    threading.Timer(0.2, lambda: counters.update(records=3)).start()
    snap = status.settled(str(tmp_path), until=lambda x: x["writer"]["records"] >= 3, timeout=30)
    assert snap["writer"]["records"] == 3
    with pytest.raises(status.NotSettled, match="records 3") as e:
        status.settled(str(tmp_path), until=lambda x: x["writer"]["records"] > 3, timeout=0.3)
    assert e.value.snapshot["writer"]["records"] == 3


def test_aggregate_sums_processes_and_leaves_out_the_dead(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    now = time.monotonic_ns()
    for pid, records, fill in ((os.getpid(), 3, 0.2), (os.getppid(), 4, 0.7), (int(dead), 100, 0.9)):
        (tmp_path / f"overlay-{pid}.json").write_text(json.dumps({
            "pid": pid, "seq": records, "as_of_ns": now + records, "unaccounted": 1,
            "writer": {"records": records, "gather_s": 0.5}, "admission": {"held_now": 1},
            "forwards": {"DECODE": records}, "rows": {}, "recent_rids": [f"r{records}", "shared"],
            "output_ring_fill": fill}))
    (tmp_path / ".overlay-1.json.abcd.tmp").write_text("{")  # a rewrite in flight: never read
    snap = status.read(str(tmp_path))
    assert sorted(snap["pids"]) == sorted([os.getpid(), os.getppid()])
    assert snap["writer"] == {"records": 7, "gather_s": 1.0} and snap["admission"] == {"held_now": 2}
    assert snap["forwards"] == {"DECODE": 7} and snap["unaccounted"] == 2 and snap["output_ring_fill"] == 0.7
    assert snap["as_of_ns"] == now + 3 and set(snap["recent_rids"]) == {"r3", "r4", "shared"}
    assert status.read(str(tmp_path / "nowhere"))["files"] == []


# --- unaccounted: never down before the outcome is counted ---------------------------------------------

class _Ring:
    capacity = 1 << 30

    def __init__(self, free):
        self.free = free

    def free_bytes(self):
        return self.free


def _tokenized(rid):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(5, 13)), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=2), return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


def test_admission_counts_held_and_admitted_requests_until_their_outcome():
    from sglang_hs.server.store.admission import AdmissionControl

    ring = _Ring(free=1 << 30)
    adm = AdmissionControl(ring, 4, 16, 2, 64)
    adm.filter([_tokenized("a"), _tokenized("b")])
    assert adm.unaccounted() == 2
    ring.free = 0
    adm.filter([_tokenized("c")])
    assert adm.unaccounted() == 3 and adm.stats["held_now"] == 1
    ticket = adm.finish("a")
    assert adm.unaccounted() == 3  # finishing: its record is not published yet
    adm.release_reservation("a", ticket)
    adm.release("b")
    assert adm.unaccounted() == 1
    ring.free = 1 << 30
    adm.filter([])
    assert adm.unaccounted() == 1 and adm.stats["held_now"] == 0  # c admitted: a ticket now


def test_a_request_failed_by_the_admission_timeout_is_counted_before_it_stops_being_held(monkeypatch):
    from sglang_hs.server.store.admission import AdmissionControl

    adm = AdmissionControl(_Ring(free=0), 4, 16, 2, 64, timeout=0.01)
    adm.filter([_tokenized(f"h{i}") for i in range(3)])
    assert adm.unaccounted() == 3
    seen = []
    refuse = adm._refuse

    def watched(req, message, code):  # what the status thread could read at any moment of the refusal
        seen.append(adm.unaccounted() + adm.stats["failed"])
        out = refuse(req, message, code)
        seen.append(adm.unaccounted() + adm.stats["failed"])
        return out

    monkeypatch.setattr(adm, "_refuse", watched)
    adm.held_since = {rid: t - 1.0 for rid, t in adm.held_since.items()}  # held for a second: past the limit
    adm.filter([])
    assert adm.stats["failed"] == 3 and adm.unaccounted() == 0
    assert min(seen) >= 3, seen  # a refused request was never in neither count


def test_a_dropped_record_is_counted_before_its_ticket_goes(tmp_path):
    """FinishWorker.poll: the error's `dropped` is raised before on_done releases the request's ticket."""
    from sglang_hs.server.store.finisher import FinishWorker
    from sglang_hs.server.store.writer import CaptureWriter

    spec = CaptureSpec.resolve([1], True, 4, 16)
    writer = CaptureWriter(str(tmp_path), spec, 256, torch.float32, 1 << 14)  # 256 rows: 32 KB
    seen = []
    worker = FinishWorker(writer, on_done=lambda rid, ticket: seen.append(writer.stats["dropped"]))
    try:
        worker.submit("too-big", list(range(256)), torch.arange(256))
        worker.drain()
    finally:
        worker.close()
    assert writer.stats["dropped"] == 1 and seen == [1]


# --- /metrics: the snapshot's figures, its seq last ----------------------------------------------------

def test_metrics_export_a_snapshot_and_metrics_after_waits_for_its_seq(tmp_path):
    from prometheus_client import start_http_server

    from sglang_hs.server.metrics import CaptureMetrics

    m = CaptureMetrics(writer_id=3)
    server, thread = start_http_server(0, addr="127.0.0.1")
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        snap = {"seq": 7, "unaccounted": 2, "writer": {"records": 5, "rows": 40, "finish_pending": 1},
                "admission": {"held_now": 1, "skipped_not_sampled": 2}, "output_ring_fill": 0.25}
        m.refresh(snap)
        got = status.metrics_after(url, {"files": [dict(snap, writer_id=3)]}, timeout=10)
        assert got["sglang_hs:status_seq_total"] == 7 and got["sglang_hs:status_gauges_seq"] == 7
        assert got["sglang_hs:records_published_total"] == 5
        assert got["sglang_hs:requests_unaccounted"] == 2 and got["sglang_hs:admission_held"] == 1
        assert got["sglang_hs:requests_not_captured_total"] == 2 and got["sglang_hs:output_ring_fill_ratio"] == 0.25
        with pytest.raises(status.NotSettled, match="status seq 8"):
            status.metrics_after(url, {"files": [dict(snap, seq=8)]}, timeout=0.2)
    finally:
        server.shutdown()


def test_a_missing_record_is_given_up_once_a_later_status_has_nothing_in_flight(overlay, tmp_path):
    """sglang_hs.extract.samples.record_overdue, the extraction CLI's and the live dataset's verdict on a
    record not there after its reply: still to come while the server has requests in flight or has written
    no snapshot since the reply; given up once a snapshot after the reply has nothing in flight."""
    from sglang_hs.extract import samples

    assert samples.record_overdue(str(tmp_path), time.monotonic()) is None  # no server status: wait (the grace)
    assert "120s after the reply" in samples.record_overdue(str(tmp_path), time.monotonic() - 121)
    pending = [1]
    s = overlay(writer={"records": 0})
    s.unaccounted = lambda: pending[0]
    t_reply = time.monotonic()
    status.wait(str(tmp_path), lambda x: True, since_ns=int(t_reply * 1e9), timeout=30)
    assert samples.record_overdue(str(tmp_path), t_reply) is None  # in flight: it may still come
    pending[0] = 0
    status.settled(str(tmp_path), since_ns=int(t_reply * 1e9), timeout=30)
    assert "every request it answered published" in samples.record_overdue(str(tmp_path), t_reply)


def test_a_job_handed_over_without_a_ticket_is_unaccounted_until_its_outcome_is_counted(tmp_path, monkeypatch):
    """A request whose ticket a reconcile dropped (SGLang held it somewhere the reconcile did not look) is
    still published by the finish worker: the status's unaccounted counts that job from its hand-over until
    its record is counted (it read 0 meanwhile, and settled could return before the record was in the ring)."""
    from sglang_hs.server.patches import capture_hooks
    from sglang_hs.server.store.admission import AdmissionControl
    from sglang_hs.server.store.finisher import FinishWorker
    from sglang_hs.server.store.writer import CaptureWriter

    writer = CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], True, 4, 16), 64, torch.float32, 1 << 20)
    gate, inner = threading.Event(), writer.publish_gathered
    writer.publish_gathered = lambda *a, **k: (gate.wait(30), inner(*a, **k))[1]
    worker = FinishWorker(writer)
    monkeypatch.setattr(capture_hooks, "_admission", AdmissionControl(_Ring(1 << 30), 2, 16, 4, 64))
    monkeypatch.setattr(capture_hooks, "_finisher", worker)
    try:
        worker.submit("no-ticket", [1, 2, 3], torch.arange(3), ticket=None)
        worker.poll()
        assert capture_hooks._unaccounted() == 1 and writer.stats["records"] == 0
        gate.set()
        worker.drain()
        assert capture_hooks._unaccounted() == 0 and writer.stats["records"] == 1
    finally:
        gate.set()
        worker.close()


def test_requests_sglang_holds_before_its_waiting_queue_are_known_to_the_reconcile(monkeypatch):
    """The reconcile drops the tickets of rids the scheduler no longer knows; SGLang's colocated-batch input
    blocker and the EPD multimodal receiver hold admitted requests before the waiting queue."""
    from types import SimpleNamespace as NS

    from sglang_hs.server.patches import capture_hooks

    s = NS(waiting_queue=[NS(rid="w")], _deferred_input_requests=[], grammar_manager=None, running_batch=None,
           last_batch=None, chunked_req=None, input_blocker=NS(_pending_reqs=[NS(rid="blocked"), NS(batch=[
               NS(rid="b1"), NS(rid="b2")])]), mm_receiver=NS(waiting_list=[NS(rid="mm")]))
    monkeypatch.setattr(capture_hooks, "_scheduler", s)
    monkeypatch.setattr(capture_hooks, "_finisher", None)
    assert {"w", "blocked", "b1", "b2", "mm"} <= capture_hooks._known_rids()


def test_metrics_after_waits_for_each_writer_of_a_dp_attention_server():
    """Under DP attention each group's writer exports its own seq (label `writer`): metrics_after waits until every
    writer of the snapshot shows its seq, in one read, and names the ones behind. Before, it refused any snapshot
    of more than one writer (ValueError), so no test or user could settle /metrics on a DP-attention server."""
    import http.server
    import threading

    text = {"body": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = text["body"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def exported(seq0, seq1):
        return "".join(f'sglang_hs:status_seq_total{{writer="{w}"}} {s}\nsglang_hs:status_gauges_seq{{writer="{w}"}} {s}\n'
                       f'sglang_hs:records_published_total{{writer="{w}"}} {10 + w}\n'
                       for w, s in ((0, seq0), (1, seq1)))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    snap = {"files": [{"seq": 5, "writer_id": 0, "writer": {}}, {"seq": 4, "writer_id": 1, "writer": {}},
                      {"seq": 9, "pid": 3}]}  # a rank without a writer: not waited for
    try:
        text["body"] = exported(5, 3)  # writer 1 behind (its own seq; the sum, 8, would pass both)
        with pytest.raises(status.NotSettled, match=r"status seq 4 of writer 1 \(counters at 3, gauges at 3\)"):
            status.metrics_after(url, snap, timeout=0.2)
        text["body"] = exported(5, 4)
        got = status.metrics_after(url, snap, timeout=5)
        assert got["sglang_hs:records_published_total"] == 21  # summed over the writers, as metrics() does
        assert status.metrics_after(url, snap, timeout=5, by=("writer",))[
            ("sglang_hs:records_published_total", "1")] == 11
        one = {"files": [{"seq": 4, "writer_id": 1, "writer": {}}]}  # writer 1's file alone: its own seq, not 0's
        text["body"] = exported(5, 3)
        with pytest.raises(status.NotSettled, match=r"status seq 4 of writer 1"):
            status.metrics_after(url, one, timeout=0.2)
        with pytest.raises(ValueError, match="distinct writer ids"):
            status.metrics_after(url, {"files": [{"seq": 1, "writer": {}}, {"seq": 1, "writer": {}}]}, timeout=1)
    finally:
        server.shutdown()
