"""What a capturing server has published, read from outside it: its status files aggregated into one
snapshot, and waits that settle on published state instead of on the clock.

Every scheduler process of a server started with --hs-dump-dir rewrites `<dump dir>/overlay-<pid>.json`
every 0.5 s from a thread of its own (sglang_hs/server/overlay_status.py), which a loaded machine may run
seconds late: a file read once, or after a sleep, may be older than the requests it is asked about. So
every snapshot says how fresh it is:

    seq          +1 per write of that process
    as_of_ns     time.monotonic_ns() when it was taken (CLOCK_MONOTONIC: one clock for every process of
                 the machine), before any of its figures was read: every figure is at least that fresh
    unaccounted  requests its admission control holds or has admitted whose outcome (a record, a marker,
                 a drop, a skip without a marker, an admission failure) is not counted yet

`settled(dump_dir, since_ns)` returns the first snapshot, aggregated over the server's live processes, in
which every process wrote after `since_ns` and nothing is unaccounted: each request answered before
`since_ns` has its outcome in the counters, and its record or marker is in the output ring, so one
`reader.poll()` after it is a valid check that no record is coming:

    from sglang_hs.status import settled
    t = time.monotonic_ns()                       # after the replies you care about
    s = settled("/dev/shm/hs", since_ns=t)        # raises NotSettled (a TimeoutError) showing the last one
    s["writer"]["records"], s["admission"]["skipped_not_sampled"], s["unaccounted"] == 0

`wait(dump_dir, until)` waits for any condition on a fresh snapshot (requests held right now, a ring that
fills), `metrics(url)` reads SGLang's /metrics (prometheus_client's own parser) and `metrics_after(url,
snapshot)` waits until /metrics shows that snapshot's figures or later ones (the counters' and the gauges'
status seq, sglang_hs/server/metrics.py).

An aggregated snapshot has the keys of one file; `writer`, `admission`, `forwards` and `rows` are summed
over the processes (one writer per data-parallel attention group), `output_ring_fill` is the fullest
ring, `recent_rids` the union, `as_of_ns` the oldest, `unaccounted` the sum; `files` holds each process's
own snapshot, `seq` maps each pid to its seq. Files of processes that are gone are left out.
"""
from __future__ import annotations

import glob
import json
import os
import time
from typing import Callable, Dict, List, Optional

POLL_S = 0.05
SUMMED = ("writer", "admission", "forwards", "rows")


class NotSettled(TimeoutError):
    """The status did not reach what was waited for in time; `snapshot` is the last one read (or None)."""

    def __init__(self, message: str, snapshot: Optional[dict]) -> None:
        super().__init__(message)
        self.snapshot = snapshot


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process (a share-group reader looking at the server's dir)
        return True
    return True


def files(dump_dir: str) -> List[dict]:
    """Each live scheduler process's own snapshot (its overlay-<pid>.json), in pid order."""
    out = []
    for path in sorted(glob.glob(os.path.join(str(dump_dir), "overlay-*.json"))):
        try:
            with open(path) as f:
                snap = json.load(f)
        except (OSError, ValueError):  # removed meanwhile (a server stopping); written by rename: never torn
            continue
        if isinstance(snap, dict) and _alive(int(snap.get("pid", 0) or 0)):
            out.append(snap)
    return sorted(out, key=lambda s: s["pid"])


def aggregate(snaps: List[dict]) -> dict:
    """One snapshot of several processes' (module docstring)."""
    out: dict = dict(snaps[0]) if snaps else {}
    for key in SUMMED:
        total: Dict[str, float] = {}
        for s in snaps:
            for name, value in (s.get(key) or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[name] = total.get(name, 0) + value
        if any(key in s for s in snaps):
            out[key] = total
    fills = [s["output_ring_fill"] for s in snaps if s.get("output_ring_fill") is not None]
    if fills:
        out["output_ring_fill"] = max(fills)
    recent: dict = {}
    for s in snaps:
        recent.update(dict.fromkeys(s.get("recent_rids") or ()))
    out.update(recent_rids=list(recent), files=list(snaps), pids=[s["pid"] for s in snaps],
               seq={s["pid"]: s.get("seq", 0) for s in snaps},
               as_of_ns=min((s.get("as_of_ns", 0) for s in snaps), default=0),
               unaccounted=sum(s.get("unaccounted", 0) for s in snaps))
    return out


def read(dump_dir: str) -> dict:
    """The server's snapshot as it is now, aggregated (`files` empty when no process of it is alive)."""
    return aggregate(files(dump_dir))


def summary(snap: Optional[dict]) -> str:
    """One line of what a snapshot says (for error messages)."""
    if not snap or not snap.get("files"):
        return "no status file of a live server process"
    w, a = snap.get("writer", {}), snap.get("admission", {})
    age = (time.monotonic_ns() - snap["as_of_ns"]) / 1e9
    return (f"oldest file {age:.1f}s old, seq {snap['seq']}, unaccounted {snap['unaccounted']}, records "
            f"{w.get('records')}, markers {w.get('markers')}, dropped {w.get('dropped')}, finish_pending "
            f"{w.get('finish_pending')}, held_now {a.get('held_now')}, failed {a.get('failed')}, ring fill "
            f"{snap.get('output_ring_fill')}")


def wait(dump_dir: str, until: Callable[[dict], bool], since_ns: Optional[int] = None, timeout: float = 60.0,
         what: str = "the condition") -> dict:
    """The first aggregated snapshot whose every file was written after `since_ns` (default: now) and for
    which `until(snapshot)` is true; NotSettled after `timeout` seconds, showing the last one read."""
    since_ns = time.monotonic_ns() if since_ns is None else since_ns
    deadline = time.monotonic() + timeout
    last = None
    while True:
        snaps = files(dump_dir)
        if snaps and all(s.get("as_of_ns", 0) > since_ns for s in snaps):
            last = aggregate(snaps)
            if until(last):
                return last
        elif snaps:
            last = aggregate(snaps)
        if time.monotonic() > deadline:
            raise NotSettled(f"sglang-hs: the status in {dump_dir} did not show {what} within {timeout:.0f}s: "
                             f"{summary(last)}", last)
        time.sleep(POLL_S)


def settled(dump_dir: str, since_ns: Optional[int] = None, until: Optional[Callable[[dict], bool]] = None,
            timeout: float = 60.0) -> dict:
    """The first aggregated snapshot newer than `since_ns` (default: now) with nothing unaccounted and
    `until(snapshot)` true (module docstring); NotSettled after `timeout`, showing the last one."""
    return wait(dump_dir, lambda s: s["unaccounted"] == 0 and (until is None or until(s)), since_ns, timeout,
                "nothing unaccounted" + ("" if until is None else " and the condition"))


def in_flight(dump_dir: str, timeout: float = 5.0) -> Optional[int]:
    """The `unaccounted` requests of a snapshot written after this call (requests whose record or marker may
    still come); None when no process of a server is alive there (at once: no live process has a status file)
    or none wrote within `timeout`."""
    if not files(dump_dir):
        return None
    try:
        return wait(dump_dir, lambda s: True, timeout=timeout)["unaccounted"]
    except NotSettled:
        return None


def metrics(url: str, prefix: str = "sglang_hs:", by: tuple = ()) -> Dict:
    """SGLang's /metrics of the server at `url`: each sample whose name starts with `prefix` (counters keep
    their `_total`), summed over its labels but those named in `by` (then the key is (name, *their
    values)), read by prometheus_client's own text parser."""
    return _summed(_scrape(url), prefix, by)


def _scrape(url: str) -> list:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(f"{url.rstrip('/')}/metrics", timeout=60)
    r.raise_for_status()
    return [sample for family in text_string_to_metric_families(r.text) for sample in family.samples]


def _summed(samples: list, prefix: str, by: tuple) -> Dict:
    out: Dict = {}
    for sample in samples:
        if sample.name.startswith(prefix) and not sample.name.endswith("_created"):
            key = (sample.name, *(sample.labels.get(k) for k in by)) if by else sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return out


def metrics_after(url: str, snap: dict, timeout: float = 60.0, by: tuple = ()) -> Dict:
    """metrics(url, by=by) once /metrics shows the figures of snapshot `snap` (a status file's, or an
    aggregated one) or later ones: for each writer in it (one per DP-attention group), the counters' and the
    gauges' seq of its `writer` label (`sglang_hs:status_seq_total`, `sglang_hs:status_gauges_seq`) both >=
    that writer's seq in `snap`, in one read of /metrics."""
    writers = [s for s in snap.get("files", [snap]) if "writer" in s]
    want = {str(s.get("writer_id", 0)): s["seq"] for s in writers}
    if not writers or len(want) != len(writers):
        raise ValueError(f"sglang-hs: metrics_after takes a snapshot of writers with distinct writer ids, got "
                         f"{sorted(str(s.get('writer_id')) for s in writers)}")
    deadline = time.monotonic() + timeout
    seqs = ("sglang_hs:status_seq_total", "sglang_hs:status_gauges_seq")
    while True:
        samples = _scrape(url)
        per_writer = _summed(samples, "sglang_hs:status_", ("writer",))
        # each writer's own seq (a snapshot without a writer id is writer 0's): another writer's never stands in
        at = {w: [per_writer.get((name, w), 0.0) for name in seqs] for w in want}
        behind = {w: a for w, a in at.items() if min(a) < want[w]}
        if not behind:
            return _summed(samples, "sglang_hs:", by)
        if time.monotonic() > deadline:
            raise NotSettled(f"sglang-hs: /metrics of {url} did not reach status seq "
                             + ", ".join(f"{want[w]} of writer {w} (counters at {a[0]:.0f}, gauges at {a[1]:.0f})"
                                         for w, a in sorted(behind.items()))
                             + f" within {timeout:.0f}s", snap)
        time.sleep(POLL_S)
