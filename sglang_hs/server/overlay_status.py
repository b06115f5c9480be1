"""A small status file the overlay keeps in the dump dir: proof, from the serving process, that the
overlay class served the requests with capture on.

`<dump_dir>/overlay-<pid>.json`: class, pid, capture spec, forward steps and their real rows per
forward mode, the aux shape last seen, the last request ids served, and the writer's and admission
control's counters. Steps are counted by the ModelRunner.forward hook (sglang_hs/server/patches/
capture_hooks.py), which runs for every step the scheduler makes, whether its model ran eagerly or a
CUDA graph replayed it, and never for graph capture or warm-up passes, which call the model directly.
Rewritten atomically by a daemon thread every FLUSH_INTERVAL_S, never from the forward itself.

A busy machine may run that thread late, so a snapshot says how fresh it is (sglang_hs/status.py reads and
waits on them): `seq` (+1 per write of this process), `as_of_ns` (time.monotonic_ns(), CLOCK_MONOTONIC,
one clock for every process of the machine, taken BEFORE anything else is read, so every counter is at
least that fresh) and `unaccounted` (read next: requests admission control holds or has admitted whose
outcome is not yet in the counters, 0 on a rank without a writer). Each outcome's counter (records,
markers, dropped, failed, skipped_*, markers_dropped) is raised before the request stops being
unaccounted, so a snapshot with `unaccounted` 0 has every outcome of the requests answered before
`as_of_ns`, and their records are in the output ring.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.fsutil import write_private_file

FLUSH_INTERVAL_S = 0.5
LOG_INTERVAL_S = 60.0
RECENT_RIDS = 256


class OverlayStatus:
    def __init__(self, dump_dir: str, class_name: str, spec: CaptureSpec) -> None:
        self.dump_dir = dump_dir
        self.name = f"overlay-{os.getpid()}.json"
        self._lock = threading.Lock()
        self._data = {
            "class": class_name,
            "module": "sglang_hs.server.models.deepseek_v2",
            "pid": os.getpid(),
            "capture": spec.describe(),
            "forwards": collections.Counter(),
            "rows": collections.Counter(),
            "last_aux_shape": None,
            "recent_rids": collections.OrderedDict(),  # an ordered set of the last RECENT_RIDS request ids
        }
        self.sources = {}  # name -> dict of counters kept elsewhere (the writer, admission control)
        self.ring_fill = None  # () -> unread fraction of the output ring, on a writer rank
        self.unaccounted = lambda: 0  # () -> requests not yet accounted for (AdmissionControl.unaccounted)
        self.writer_id = None  # this process's writer (its DP attention rank), once it is a writer rank
        self.listeners = []  # called with each snapshot written (the Prometheus metrics)
        self._seq = 0
        self._stopped = threading.Event()
        self._flush()
        self._thread = threading.Thread(target=self._run, name="sglang-hs-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop rewriting the file (tests; a server's thread ends with its process)."""
        self._stopped.set()
        self._thread.join(timeout=10)

    def record(self, mode: str, rows: int, rids) -> None:
        """One forward step of the scheduler (ModelRunner.forward, whether the model ran eagerly or a CUDA
        graph was replayed): its mode, its real rows (no graph padding) and its request ids."""
        with self._lock:
            self._data["forwards"][mode] += 1
            self._data["rows"][mode] += rows
            recent = self._data["recent_rids"]
            for rid in rids or ():  # O(1) each: this runs in every step
                if rid not in recent:
                    recent[rid] = None
                    if len(recent) > RECENT_RIDS:
                        recent.popitem(last=False)

    def saw_aux(self, aux_shape: tuple) -> None:
        """The packed aux shape of an eager overlay forward (padded rows included; a replay runs none)."""
        self._data["last_aux_shape"] = list(aux_shape)

    def _run(self) -> None:
        last_log = time.monotonic()
        while not self._stopped.wait(FLUSH_INTERVAL_S):
            try:
                snapshot = self._flush()
            except FileNotFoundError:  # the dump dir is gone (a test's, or a server being torn down)
                return
            for listener in list(self.listeners):
                try:
                    listener(snapshot)
                except Exception as e:  # noqa: BLE001 - metrics must never take the status file down
                    self.listeners.remove(listener)
                    print(f"[sglang-hs] warning: {listener!r} failed and is switched off: {e!r}", file=sys.stderr,
                          flush=True)
            if self.sources and time.monotonic() - last_log >= LOG_INTERVAL_S:
                last_log = time.monotonic()
                self._log_line()

    def _log_line(self) -> None:
        """One line a minute: what was captured and published, and how admission is doing."""
        w, a = self.sources.get("writer", {}), self.sources.get("admission", {})
        staged = (f"staged {w['staged_rows']} rows (scatter {w['scatter_s']:.2f}s, scheduler waited "
                  f"{w['stage_wait_s']:.2f}s in all); " if "staged_rows" in w else "")
        fill = f"output ring {100 * self.ring_fill():.0f}% full; " if self.ring_fill else ""
        print(f"[sglang-hs] published {w.get('records', 0)} records, {w.get('rows', 0)} rows, "
              f"{w.get('bytes', 0) / 1e9:.3f} GB (gather {w.get('gather_s', 0.0):.2f}s in all); {staged}{fill}"
              f"admission waits {a.get('admission_waits', 0)}, held now {a.get('held_now', 0)}, "
              f"failed {a.get('failed', 0)}; dropped {w.get('dropped', 0)}", file=sys.stderr, flush=True)

    def _flush(self) -> dict:
        """Write one snapshot (every tick, so `as_of_ns` tells its age) and return it. Order matters: the
        time first, then `unaccounted`, then the counters (module docstring)."""
        self._seq += 1
        head = {"seq": self._seq, "as_of_ns": time.monotonic_ns()}
        head["unaccounted"] = int(self.unaccounted())
        with self._lock:  # a snapshot only: the scheduler's record() waits on this lock
            payload = {k: (list(v) if isinstance(v, collections.OrderedDict) else
                           dict(v) if isinstance(v, dict) else v) for k, v in self._data.items()}
        payload.update(head)
        if self.writer_id is not None:
            payload["writer_id"] = self.writer_id
        payload.update({name: dict(counters) for name, counters in self.sources.items()})
        if self.ring_fill is not None:
            payload["output_ring_fill"] = round(self.ring_fill(), 4)
        write_private_file(self.dump_dir, self.name, json.dumps(payload, default=dict).encode())
        return payload
