"""Which pending gathers the KV slots of the next step may still be read by, from counts alone.

On CUDA the slot ids a step writes stay on the device (reading them is a sync), so the finish worker
cannot tell per slot which gathers a step's writes must wait for; waiting for every gather handed over
stalls the forward behind the latest finished requests' gathers. But SGLang 0.5.23's KV allocators keep
their free list in a fixed order, and how many slots each free puts into it and each allocation takes out
of it is known on the host (tensor lengths):

- `TokenToKVPoolAllocator`: a free appends at the back (`torch.cat((free_pages, free_index))`), an
  allocation takes from the front: first in, first out;
- `PagedTokenToKVPoolAllocator`: a free of pages puts them at the front (`torch.cat((*page_ids,
  free_pages))`), an allocation takes from the front: last in, first out.

So the free list is a sequence of runs, each tagged with the gathers handed over when it was freed (a
slot freed then can only be read by those); an allocation that takes slots out of runs must wait for the
largest tag among them. Slots free from the start carry tag 0. This is exact for these two allocators
(tests/unit/test_free_list_order.py checks it against the slot ids on SGLang's real classes) and never
reads a device tensor. Whatever changes the free list behind the model's back (a path not wrapped here,
`clear`, an allocation that merges and sorts the frees a `need_sort` allocator staged in `release_pages`)
makes it fall back to the safe answer: every gather handed over so far.

Only counts are observed: the allocator's behaviour, and every rank's scheduling, are SGLang's own.
"""
from __future__ import annotations

import collections
from typing import Callable, Deque, List


class FreeListOrder:
    def __init__(self, allocator, gathered: Callable[[], int]) -> None:
        """`gathered()`: the seq of the last gather handed over (FinishWorker.gathers_handed)."""
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        self.allocator = allocator
        self._gathered = gathered
        self.lifo = isinstance(allocator, PagedTokenToKVPoolAllocator)
        self._runs: Deque[List[int]] = collections.deque()  # [slots or pages, tag], the front taken first
        self._units = 0  # sum of the runs: len(allocator.free_pages) while the model holds
        self._bound = 0  # the largest tag taken since take_bound()
        self.resyncs = 0  # times the model lost the free list and fell back to every gather
        self._reset(0)
        self._wrap()

    # --- what the finish worker asks -----------------------------------------------------------
    def take_bound(self) -> int:
        """The gathers the slots allocated since the last call may be read by (wait until this many are
        done before writing them); resets."""
        self._check()
        bound, self._bound = self._bound, 0
        return bound

    # --- the model -----------------------------------------------------------------------------
    def _reset(self, tag: int) -> None:
        n = len(self.allocator.free_pages)
        self._runs.clear()
        if n:
            self._runs.append([n, tag])
        self._units = n

    def _check(self) -> None:
        if self._units != len(self.allocator.free_pages):  # changed behind the model's back
            self.resyncs += 1
            self._bound = max(self._bound, self._gathered())
            self._reset(self._gathered())

    def _pushed(self, n: int) -> None:
        if n <= 0:
            return
        run = [n, self._gathered()]
        if self.lifo:
            self._runs.appendleft(run)
        else:
            self._runs.append(run)
        self._units += n

    def _taken(self, n: int) -> None:
        self._units -= n
        while n > 0 and self._runs:
            run = self._runs[0]
            k = min(n, run[0])
            self._bound = max(self._bound, run[1])
            run[0] -= k
            n -= k
            if run[0] == 0:
                self._runs.popleft()

    def _wrap(self) -> None:
        a = self.allocator
        for name in ("alloc", "alloc_extend", "alloc_decode"):
            fn = getattr(a, name, None)
            if fn is not None:
                setattr(a, name, self._taking(fn))
        # every free of these allocators ends here (free_group_end and free_page_ids too)
        push = "_release_page_ids" if self.lifo else "free"
        setattr(a, push, self._pushing(getattr(a, push)))
        clear = a.clear

        def cleared(*args, **kwargs):
            out = clear(*args, **kwargs)
            self._bound = max(self._bound, self._gathered())
            self._reset(self._gathered())
            return out

        a.clear = cleared

    def _staged(self) -> int:
        """Frees a need_sort allocator staged out of the free list: the token allocator's release_pages, the
        page allocator's staged_pages (num_staged_pages)."""
        a = self.allocator
        staged = getattr(a, "num_staged_pages", None)
        if staged is not None:
            return int(staged)
        release = getattr(a, "release_pages", None)
        return 0 if release is None else len(release)

    def _taking(self, fn):
        def taking(*args, **kwargs):
            self._check()
            before, staged = len(self.allocator.free_pages), self._staged()
            out = fn(*args, **kwargs)
            taken = before - len(self.allocator.free_pages)
            if taken < 0 or self._staged() != staged:
                # need_sort: the allocation merged the staged frees (release_pages, whose frees the model
                # never saw enter the free list) into it and sorted it: the runs say nothing of it any more.
                # This allocation and the list from now on: every gather handed over (never too few).
                self.resyncs += 1
                self._bound = max(self._bound, self._gathered())
                self._reset(self._gathered())
                return out
            self._taken(taken)
            return out

        taking.__wrapped__ = fn
        return taking

    def _pushing(self, fn):
        def pushing(*args, **kwargs):
            self._check()
            before = len(self.allocator.free_pages)
            out = fn(*args, **kwargs)
            self._pushed(len(self.allocator.free_pages) - before)  # 0 inside a free group: counted at its end
            return out

        pushing.__wrapped__ = fn
        return pushing
