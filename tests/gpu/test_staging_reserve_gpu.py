"""On a GPU: the device memory held for --hs-copy staging before SGLang sizes its KV pool
(capture_hooks._alloc_memory_pool) is what the stage is then built from. Once the hold is dropped,
building the StagedCopy takes no new memory from the device (PyTorch's caching allocator carves the
stage and its twin out of the freed block), so the KV pool sized in between really left room for it."""
import torch

from sglang_hs.server.store.staging import StagedCopy, device_bytes

ROWS, P, H = 8192, 4, 7168  # DeepSeek-V3's default stage: 0.94 GB


def test_the_stage_is_carved_from_the_memory_held():
    # A server has run its kernels and made its streams long before the stage is built: do the same first, so
    # that what CUDA loads once per process outside the allocator (lazily loaded kernel modules: the fill and
    # arange kernels of a first StagedCopy, ~170 MB on an H200) is not counted as the stage's
    StagedCopy(torch.zeros(4, P, H, dtype=torch.bfloat16), 16, "cuda").close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.empty(device_bytes(ROWS, P, H, 2), dtype=torch.uint8, device="cuda")
    free_while_held, _ = torch.cuda.mem_get_info()
    reserved_while_held = torch.cuda.memory_reserved()
    del held  # what _after_init_capturers does just before the writer builds its stage
    store = torch.zeros(64, P, H, dtype=torch.bfloat16)
    stage = StagedCopy(store, ROWS, "cuda")
    try:
        grown = torch.cuda.memory_reserved() - reserved_while_held
        taken = free_while_held - torch.cuda.mem_get_info()[0]
        print(f"held {device_bytes(ROWS, P, H, 2) / 1e9:.3f} GB; building the stage then reserved "
              f"{grown / 1e6:.1f} MB more and took {taken / 1e6:.1f} MB more from the device")
        # The allocator reserved at most a small-pool segment for the slot ids. mem_get_info also sees
        # device memory outside the allocator (a first stream pool, mappings of the pinned host buffers),
        # hence the looser bound there: still a small fraction of the 0.94 GB a new stage would take.
        assert grown <= 4 << 20 and taken <= 64 << 20
    finally:
        stage.close()
