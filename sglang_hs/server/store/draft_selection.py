"""Harvest on a speculative server, keeping what the draft gets wrong: which finished requests keep their records.

Two policies, on SGLang's accept length of the request (completion tokens per verify step, `spec_accept_length`):

- `--hs-capture-accept-below L`: kept when its accept length is below L;
- `--hs-capture-accept-lowest F` (`--hs-capture-accept-window N`): kept when it is in the lowest fraction F of the
  last N finished requests' accept lengths, its own included: fewer than F x (the window's length) of them are
  below it. Ties go together (a request as low as the lowest F of the window is kept with all its equals), and
  while the window fills the fraction is of the requests seen so far. Every finished request with a verify step
  enters the window, captured or not, opted in or not: "recent traffic" is the server's.

And one on the DSpark draft's own confidence (its confidence head: SGLang's per-draft probability that the draft is
accepted, [gamma] per verify step; SGLang builds the head under SGLANG_RAGGED_VERIFY_MODE cap-accept or compact only):

- `--hs-capture-confidence-below C`: kept when its mean confidence (over every draft of every verify step) is below
  C: the requests the draft itself expected to do poorly on.

Opted-in requests and requests that never reached a verify step (nothing known of the draft) are always kept.
A request dropped by either leaves a marker, reason draft_accepted. Both run at a request's finish, on the
scheduler thread: a deque and a sorted list, O(log N) to find a rank and O(N) memmove to keep the list sorted
(N = 1,000 by default: microseconds)."""
from __future__ import annotations

import bisect
import collections
from typing import Optional


class RecentAccepts:
    """The accept lengths of the last `window` finished requests, and where a new one ranks among them."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window: at least 1 request, got {window}")
        self.window = window
        self._order: "collections.deque[float]" = collections.deque()
        self._sorted: list = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, length: float) -> float:
        """Enter `length` (the oldest leaves a full window); returns the fraction of the window, this one
        included, that is strictly below it."""
        if len(self._order) == self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(length)
        bisect.insort(self._sorted, length)
        return bisect.bisect_left(self._sorted, length) / len(self._sorted)


class DraftSelection:
    """Whether a finished request's record is dropped because its draft did well (the module's policies)."""

    def __init__(self, below: Optional[float] = None, lowest: Optional[float] = None, window: int = 1000,
                 confidence_below: Optional[float] = None) -> None:
        if sum(p is not None for p in (below, lowest, confidence_below)) > 1:
            raise ValueError("one policy at a time: --hs-capture-accept-below, --hs-capture-accept-lowest or "
                             "--hs-capture-confidence-below")
        self.below, self.lowest, self.confidence_below = below, lowest, confidence_below
        self.recent = RecentAccepts(window) if lowest is not None else None

    @property
    def active(self) -> bool:
        return self.below is not None or self.lowest is not None or self.confidence_below is not None

    def did_well(self, length: Optional[float], opted_in: bool, confidence: Optional[float] = None) -> bool:
        """Called once per finished request (aborted ones and warm-ups excluded), in finish order: True when its
        record is to be dropped. `length`: its accept length, None without a verify step; `confidence`: its mean
        draft confidence (mean_confidence), None without a verify step or a confidence head."""
        if self.confidence_below is not None:
            return confidence is not None and not opted_in and confidence >= self.confidence_below
        if length is None:
            return False
        if self.recent is not None:
            below_it = self.recent.add(length)  # every request enters the window, whatever becomes of it
            return not opted_in and below_it >= self.lowest
        return self.below is not None and not opted_in and length >= self.below


def mean_confidence(steps) -> Optional[float]:
    """A request's mean draft confidence, `steps` its verify steps' means over their drafts (gamma each, so this
    is the mean over every draft); None when there are none."""
    return sum(steps) / len(steps) if len(steps) else None
