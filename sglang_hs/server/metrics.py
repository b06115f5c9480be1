"""Prometheus metrics of the capture, served on SGLang's own `/metrics` (launch with `--enable-metrics`).

SGLang sets PROMETHEUS_MULTIPROC_DIR before it starts the scheduler processes and its HTTP server
aggregates every process's metric files, so metrics created here, in the writer's scheduler process,
appear beside SGLang's `sglang:*` ones. They are refreshed by the overlay's status thread from each
snapshot it writes to the status file (every FLUSH_INTERVAL_S), never from the forward or the scheduler
loop, so they hold exactly that snapshot's figures. SGLang's /metrics reads the counters' file and the
gauges' file of this process one after the other, each from its start: each file has a seq of its own,
made first (so it lies first in its file and is read before the figures after it) and set last, to the
snapshot's `seq`; a /metrics read that shows both at N or more shows every figure of snapshot N or of a
later one (sglang_hs/status.py: metrics_after):

    sglang_hs:status_seq_total            the status file snapshot the counters are from (its seq)
    sglang_hs:status_gauges_seq           the snapshot the gauges are from
    sglang_hs:requests_unaccounted        its `unaccounted`: requests whose outcome is not counted yet

    sglang_hs:records_published_total     finished requests published to the output ring
    sglang_hs:rows_captured_total         token rows in those records
    sglang_hs:bytes_published_total       record bytes written to the output ring
    sglang_hs:gather_seconds_total        time spent gathering and publishing records (the finish worker's
                                          thread; the scheduler's with SGLANG_HS_SYNC_FINISH=1)
    sglang_hs:finish_wait_seconds_total   scheduler-thread time the CPU engine's forward copy waited for
                                          gathers still reading the KV slots it overwrites (finisher.py)
    sglang_hs:store_write_waits_total     forward copies (CPU engine) that waited so; on CUDA the wait is a
                                          stream wait on the GPU and is not counted here
    sglang_hs:device_write_waits_total    CUDA, --hs-copy direct: steps whose forward stream was made to wait
                                          on the GPU for gathers their KV slots may still be read by
    sglang_hs:record_parts_published_total  parts published of records in parts (--hs-record-part-size)
    sglang_hs:record_part_wait_seconds_total  finish-worker time waiting for ring room for those parts
    sglang_hs:records_dropped_total       records refused (should stay 0; each one is logged)
    sglang_hs:rows_moved_total            rows moved with SGLang's KV after speculative verify steps (accepted
                                          drafts to the front of their window; CaptureWriter.move)
    sglang_hs:staged_rows_total           rows shipped through the staging buffer (--hs-copy staging)
    sglang_hs:scatter_seconds_total       scatter-thread time spent putting staged rows into the store
    sglang_hs:stage_wait_seconds_total    scheduler-thread time waiting for a free staging host buffer
    sglang_hs:store_wait_seconds_total    finish-worker time waiting for staged rows to reach the store
    sglang_hs:scatter_wait_seconds_total  scatter-thread time waiting for gathers still reading the slots a
                                          staged chunk overwrites
    sglang_hs:admission_waits_total       scheduler iterations that held requests back
    sglang_hs:admission_failed_total      held requests failed after --hs-admission-timeout
    sglang_hs:requests_not_captured_total{reason}  requests served without capture: not_opted_in,
                                          not_sampled (--hs-capture, --hs-capture-sample), reader_behind
                                          (--hs-when-behind skip while the ring was full), over_budget
                                          (--hs-capture-max-bytes spent), draft_accepted (dropped at the finish:
                                          the draft did well, --hs-capture-accept-below/-lowest, or was sure,
                                          --hs-capture-confidence-below), oversized (a
                                          record that could never fit the ring, --hs-when-behind skip)
    sglang_hs:skip_markers_dropped_total  of those, requests left without a marker record (no ring room)
    sglang_hs:admission_held              requests held right now
    sglang_hs:finish_pending              finished requests handed to the finish worker, not yet published
    sglang_hs:kv_held_requests            finished requests whose KV slots are held until their record is
                                          gathered (--hs-record-part-size), and sglang_hs:kv_held_tokens their slots
    sglang_hs:output_ring_fill_ratio      unread bytes / capacity of the output ring
"""
from __future__ import annotations

import os

COUNTERS = {  # metric name -> (source, key, help)
    "records_published": ("writer", "records", "Finished requests published to the output ring."),
    "rows_captured": ("writer", "rows", "Token rows in the published records."),
    "bytes_published": ("writer", "bytes", "Record bytes written to the output ring."),
    "gather_seconds": ("writer", "gather_s", "Time spent gathering and publishing records (finish worker)."),
    "finish_wait_seconds": ("writer", "write_wait_s",
                            "Scheduler time the CPU forward copy waited for gathers reading the slots it writes."),
    "store_write_waits": ("writer", "write_waits", "Forward copies (CPU engine) that waited for a pending gather."),
    "device_write_waits": ("writer", "device_write_waits",
                           "CUDA direct: steps whose forward stream waited on the GPU for gathers of their slots."),
    "record_parts_published": ("writer", "parts", "Parts published of records in parts (--hs-record-part-size)."),
    "record_part_wait_seconds": ("writer", "part_wait_s",
                                 "Finish-worker time waiting for ring room for records in parts (the reader's pace)."),
    "records_dropped": ("writer", "dropped", "Records refused; each one is logged."),
    "rows_moved": ("writer", "moved_rows", "Rows moved with SGLang's KV after speculative verify steps."),
    "staged_rows": ("writer", "staged_rows", "Rows shipped through the staging buffer (--hs-copy staging)."),
    "scatter_seconds": ("writer", "scatter_s", "Scatter-thread time spent putting staged rows into the store."),
    "stage_wait_seconds": ("writer", "stage_wait_s", "Scheduler time waiting for a free staging host buffer."),
    "store_wait_seconds": ("writer", "store_wait_s", "Finish-worker time waiting for staged rows to reach the store."),
    "scatter_wait_seconds": ("writer", "scatter_wait_s",
                             "Scatter-thread time waiting for gathers reading the slots a chunk overwrites."),
    "admission_waits": ("admission", "admission_waits", "Scheduler iterations that held requests back."),
    "admission_failed": ("admission", "failed", "Held requests failed after the admission timeout."),
    "skip_markers_dropped": ("admission", "markers_dropped",
                             "Requests served without capture and without a marker record (no ring room)."),
}
NOT_CAPTURED_REASONS = ("not_opted_in", "not_sampled", "reader_behind", "beam_search", "input_embeds", "over_budget",
                        "draft_accepted", "oversized")


def enabled() -> bool:
    """True in a server started with --enable-metrics (SGLang exported the multiprocess folder)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class CaptureMetrics:
    def __init__(self, writer_id: int = 0) -> None:
        from prometheus_client import Counter, Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR

        labels = {"writer": str(writer_id)}
        # first of their files, set last (module docstring)
        self._seq = Counter("sglang_hs:status_seq", "The status-file snapshot the counters are from (its seq); "
                            "set last.", list(labels)).labels(**labels)
        self._gauges_seq = Gauge("sglang_hs:status_gauges_seq", "The status-file snapshot the gauges are from; set "
                                 "last.", list(labels), multiprocess_mode="mostrecent").labels(**labels)
        self._seq_seen = 0
        self._counters = {}
        for name, (source, key, doc) in COUNTERS.items():
            self._counters[name] = (source, key, Counter(f"sglang_hs:{name}", doc, list(labels)).labels(**labels))
        self._seen = {name: 0 for name in COUNTERS}
        skipped = Counter("sglang_hs:requests_not_captured", "Requests served without capture, per reason.",
                          [*labels, "reason"])
        for reason in NOT_CAPTURED_REASONS:
            name = f"not_captured:{reason}"
            self._counters[name] = ("admission", f"skipped_{reason}", skipped.labels(reason=reason, **labels))
            self._seen[name] = 0

        def gauge(name, doc):
            return Gauge(f"sglang_hs:{name}", doc, list(labels), multiprocess_mode="mostrecent").labels(**labels)

        self._held = gauge("admission_held", "Requests held right now until the output ring has room.")
        self._pending = gauge("finish_pending", "Finished requests handed to the finish worker, not yet published.")
        self._held_reqs = gauge("kv_held_requests", "Finished requests whose KV slots are held until their record "
                                "is gathered (--hs-record-part-size).")
        self._held_tokens = gauge("kv_held_tokens", "KV slots of those requests.")
        self._fill = gauge("output_ring_fill_ratio", "Unread bytes / capacity of the output ring.")
        self._unaccounted = gauge("requests_unaccounted", "Requests admitted or held whose outcome is not counted yet.")

    def refresh(self, snapshot: dict) -> None:
        """Export one snapshot the status thread wrote (OverlayStatus._flush): its figures, then its seq."""
        for name, (source, key, counter) in self._counters.items():
            value = snapshot.get(source, {}).get(key, 0)
            if value > self._seen[name]:
                counter.inc(value - self._seen[name])
                self._seen[name] = value
        self._held.set(snapshot.get("admission", {}).get("held_now", 0))
        self._pending.set(snapshot.get("writer", {}).get("finish_pending", 0))
        self._held_reqs.set(snapshot.get("writer", {}).get("held_requests", 0))
        self._held_tokens.set(snapshot.get("writer", {}).get("held_tokens", 0))
        self._fill.set(snapshot.get("output_ring_fill") or 0.0)
        self._unaccounted.set(snapshot.get("unaccounted", 0))
        # last: whoever sees them sees the figures above
        if snapshot["seq"] > self._seq_seen:
            self._seq.inc(snapshot["seq"] - self._seq_seen)
            self._seq_seen = snapshot["seq"]
        self._gauges_seq.set(snapshot["seq"])
