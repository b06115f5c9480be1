"""The staging buffers' device memory is held before SGLang sizes its KV pool (the
`ModelRunner.alloc_memory_pool` hook), so the pool leaves room for it; the writer then builds its stage
with exactly the rows held. Runs on the `meta` device (no memory, real sizes): the order of events and
the byte count are what is checked here; tests/gpu/test_staging_reserve_gpu.py checks on a GPU that
the stage is carved from the memory held."""
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.server.store.staging import device_bytes

H, P = 7168, 4  # DeepSeek-V3: 3 aux layers + the final state


@pytest.fixture
def hooks(monkeypatch):
    import sglang.srt.runtime_context as rc

    from sglang_hs.server.patches import capture_hooks

    rank = SimpleNamespace(attn_tp_rank=0, attn_cp_rank=0)
    monkeypatch.setattr(rc, "get_parallel", lambda: rank)
    monkeypatch.setattr(rc, "get_schedule", lambda: SimpleNamespace(
        chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=None))
    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(
        graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(max_bs=512)))))
    monkeypatch.setenv("SGLANG_HS_COPY", "staging")
    monkeypatch.delenv("SGLANG_HS_STAGING_ROWS", raising=False)
    monkeypatch.setattr(capture_hooks, "_reserved", None)
    seen = []
    monkeypatch.setitem(capture_hooks.ORIGINALS, "alloc_memory_pool",
                        lambda runner: seen.append(capture_hooks._reserved))
    spec = CaptureSpec.resolve([2, 30, 58], True, 61, H)
    # no max_running_requests: ModelRunner only gets it inside alloc_memory_pool
    runner = SimpleNamespace(device="meta", is_draft_worker=False, model=SimpleNamespace(hs_spec=spec),
                             model_config=SimpleNamespace(dtype=torch.bfloat16))
    return SimpleNamespace(mod=capture_hooks, runner=runner, rank=rank, seen=seen,
                           alloc=lambda: capture_hooks._alloc_memory_pool(runner))


def test_the_stage_is_held_while_the_pool_is_sized(hooks):
    hooks.alloc()
    (held,) = hooks.seen
    rows, buf = held  # the default: the 8192-token prefill chunk (the largest step), not the 512-row graph
    assert rows == 8192 and buf.device.type == "meta"
    assert buf.numel() == device_bytes(8192, P, H, 2) == 8192 * (2 * P * H * 2 + 20)
    print(f"DeepSeek-V3, 8192 rows: {buf.numel() / 1e9:.2f} GB held")  # 0.94 GB


def test_rows_given_by_the_flag_are_held(hooks, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_STAGING_ROWS", "16384")
    hooks.alloc()
    assert hooks.seen[0][0] == 16384 and hooks.seen[0][1].numel() == device_bytes(16384, P, H, 2)


@pytest.mark.parametrize("case", ["direct copy", "cpu engine", "other attention-TP rank", "capture off", "draft"])
def test_nothing_is_held_where_no_device_stage_is_made(hooks, monkeypatch, case):
    if case == "direct copy":
        monkeypatch.setenv("SGLANG_HS_COPY", "direct")
    elif case == "cpu engine":
        hooks.runner.device = "cpu"
    elif case == "other attention-TP rank":
        hooks.rank.attn_tp_rank = 1
    elif case == "capture off":
        hooks.runner.model.hs_spec = None
    else:
        hooks.runner.is_draft_worker = True
    hooks.alloc()
    assert hooks.seen == [None]


def test_the_writer_builds_its_stage_with_the_rows_held_and_lets_the_hold_go(hooks, monkeypatch):
    """After the pool is sized, the capturer hook hands the held memory back to the allocator and makes
    the writer with the held row count (the pool-based default could differ, e.g. a larger
    max_running_requests known only now)."""
    hooks.alloc()
    made = {}

    class Made(Exception):
        pass

    def writer(*args, **kw):  # what the hook would build the writer with; the rest needs a real server
        made.update(kw, held=hooks.mod._reserved)
        raise Made

    monkeypatch.setitem(hooks.mod.ORIGINALS, "init_routed_experts_capturer", lambda runner: None)
    monkeypatch.setattr("sglang_hs.server.store.writer.CaptureWriter", writer)
    runner = hooks.runner
    runner.max_running_requests = 20000  # known once the pool is sized: larger than the rows held
    runner.kv_index_translator = SimpleNamespace(capture_token_capacity=lambda n: n)
    runner.max_token_pool_size = 1000
    runner.model_config.model_path, runner.model_config.hf_config, runner.model_config.context_len = "m", None, 4096
    with pytest.raises(Made):
        hooks.mod._after_init_capturers(runner)
    assert made["staging_rows"] == 8192 and made["held"] is None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pool_that_translates_slot_ids_is_refused_before_the_store_on_every_rank(hooks, monkeypatch, rank):
    """Issue 48, item 3: with SGLang's KVIndexTranslator translating (a unified SWA/Mamba allocator, a fused
    draft), eager steps copy rows by virtual ids and graph replays by the physical ones captured, while
    records are gathered by virtual ids. Refused in one line at writer creation, on every rank alike (a
    writer rank alone refusing would leave the others waiting)."""
    made = []
    monkeypatch.setitem(hooks.mod.ORIGINALS, "init_routed_experts_capturer", lambda runner: None)
    monkeypatch.setattr("sglang_hs.server.store.writer.CaptureWriter", lambda *a, **k: made.append(k))
    hooks.rank.attn_tp_rank = rank
    runner = hooks.runner
    runner.kv_index_translator = SimpleNamespace(is_translating=True, capture_token_capacity=lambda n: n)
    runner.token_to_kv_pool_allocator = type("UnifiedSWATokenToKVPoolAllocator", (), {})()
    with pytest.raises(RuntimeError, match=r"translates slot ids \(SGLang's UnifiedSWATokenToKVPoolAllocator") as e:
        hooks.mod._after_init_capturers(runner)
    assert "\n" not in str(e.value) and made == []
