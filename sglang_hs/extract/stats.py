"""A run's counts (Stats: files written, skipped with where and why, failed, bytes, time) and the one summary line
it ends with; shared by the --data run and the harvest, written into manifest.json by manifest.py."""
from __future__ import annotations

import collections
import sys
import time
from typing import List, Optional, Tuple

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

    def end(self) -> None:
        """The run loop ended: the summary's time and CPU stop here."""
        self.t1, self.cpu1 = time.monotonic(), time.process_time()

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

