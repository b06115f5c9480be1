"""FreeListOrder (sglang_hs/server/store/free_list_order.py) against SGLang 0.5.23's real KV allocators on the CPU:
for any sequence of allocations, frees (alone or in free groups) and hand-overs, the bound it gives for an
allocation, from counts alone, is exactly the largest "gathers handed over when freed" among the slots the
allocation returned (read here from the slot ids, which on CUDA stay on the device): never less (a write
would overtake a gather), and no more (a step would wait for gathers its slots do not need)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

SIZE = 96

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "free", "hand", "group"]), st.integers(1, 40)),
               min_size=1, max_size=60)


def _allocator(page_size):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if page_size == 1:
        return TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", None, need_sort=False)
    return PagedTokenToKVPoolAllocator(SIZE, page_size, torch.float32, "cpu", None, need_sort=False)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_the_bound_is_exactly_the_gathers_the_allocated_slots_may_be_read_by(page_size, ops):
    from sglang_hs.server.store.free_list_order import FreeListOrder

    a = _allocator(page_size)
    handed = [0]
    order = FreeListOrder(a, lambda: handed[0])
    tag = {}  # slot -> gathers handed over when its free reached the free list (absent: free from the start)
    live, group = [], None  # allocated requests' slots; frees deferred by an open free group
    for op, n in ops:
        if op == "hand":
            handed[0] += 1
        elif op == "alloc":
            out = a.alloc(n * page_size)
            if out is None:
                continue
            want = max((tag.get(int(s), 0) for s in out), default=0)
            assert order.take_bound() == want, (op, n)
            live.append(out)
        elif op == "free" and live:
            slots = live.pop(n % len(live))
            a.free(slots)
            if group is None:
                tag.update((int(s), handed[0]) for s in slots)
            else:
                group.append(slots)
        elif op == "group":
            if group is None:
                a.free_group_begin()
                group = []
            else:
                handed[0] += n % 2  # a hand-over inside the group: the frees count at its end
                a.free_group_end()
                tag.update((int(s), handed[0]) for slots in group for s in slots)
                group = None
    assert order.resyncs == 0


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_with_staged_frees_the_bound_is_never_below_the_gathers_the_slots_may_be_read_by(page_size, ops):
    """need_sort allocators (SGLang sets it with disaggregation) stage frees in release_pages and merge and
    sort them into the free list when an allocation runs short: the model cannot follow the sort, so from
    there the bound is every gather handed over. It must never be lower than what the slots need (it was:
    the merge looked like a negative allocation, and the staged slots kept no tag)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sglang_hs.server.store.free_list_order import FreeListOrder

    a = (TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", None, need_sort=True) if page_size == 1 else
         PagedTokenToKVPoolAllocator(SIZE, page_size, torch.float32, "cpu", None, need_sort=True))
    handed = [0]
    order = FreeListOrder(a, lambda: handed[0])
    tag, live = {}, []
    for op, n in ops:
        if op in ("hand", "group"):
            handed[0] += 1
        elif op == "alloc":
            out = a.alloc(n * page_size)
            if out is None:
                continue
            want = max((tag.get(int(s), 0) for s in out), default=0)
            assert order.take_bound() >= want, (op, n)
            live.append(out)
        elif op == "free" and live:
            slots = live.pop(n % len(live))
            a.free(slots)
            tag.update((int(s), handed[0]) for s in slots)


def test_a_merge_of_staged_frees_resyncs():
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from sglang_hs.server.store.free_list_order import FreeListOrder

    a = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", None, need_sort=True)
    handed = [0]
    order = FreeListOrder(a, lambda: handed[0])
    out = a.alloc(SIZE - 4)
    assert order.take_bound() == 0
    handed[0] = 3
    a.free(out[:20])  # staged in release_pages, tag 3
    handed[0] = 7
    a.alloc(10)  # 4 free: merges the 20 staged ones, sorted among them
    assert order.take_bound() == 7 and order.resyncs == 1


def test_a_change_behind_its_back_falls_back_to_every_gather():
    from sglang_hs.server.store.free_list_order import FreeListOrder

    a = _allocator(1)
    handed = [0]
    order = FreeListOrder(a, lambda: handed[0])
    out = a.alloc(10)
    assert order.take_bound() == 0
    handed[0] = 5
    a.free_pages = torch.cat((a.free_pages, out))  # a path the model does not see
    a.alloc(3)
    assert order.take_bound() == 5 and order.resyncs == 1
    handed[0] = 6
    a.clear()
    assert order.take_bound() == 6  # clear(): every gather, then the model starts over
    a.alloc(4)
    assert order.take_bound() == 6  # the slots free at clear() carry the gathers handed over then
