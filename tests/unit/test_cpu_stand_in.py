"""The import stand-ins used in CPU mode: sgl_kernel (plain-torch ops) and flashinfer (left out)."""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sglang_hs.server.cpu import stubs_dir


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.syspath_prepend(stubs_dir())
    saved = sys.modules.pop("sgl_kernel", None)
    mod = importlib.import_module("sgl_kernel")
    yield mod
    sys.modules.pop("sgl_kernel", None)
    if saved is not None:
        sys.modules["sgl_kernel"] = saved


def test_the_stand_in_implements_the_ops_sglang_calls_on_the_cpu_engine(stand_in):
    assert stand_in.SGLANG_HS_STAND_IN
    for name in ("assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
                 "assign_req_to_token_pool_cpu", "build_tree_kernel_efficient_cpu", "copy_all_layer_kv_cache_cpu",
                 "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu"):
        assert callable(getattr(stand_in, name)), name
    with pytest.raises(ImportError):  # anything else is missing: its import fails, nothing computes garbage
        exec("from sgl_kernel import fused_moe_router_cpu", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_kv_move_copies_every_buffer_at_raw_addresses(stand_in, dtype):
    """copy_all_layer_kv_cache_cpu, an MHA pool's move_kv_cache (an EAGLE-3 draft's pool warms it up at
    start-up): every layer's K and V buffer (odd slot sizes, one buffer per stride) gets slot tgt[i] = slot
    src[i], all sources read before any write, against a plain gather-then-scatter on copies."""
    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(40, heads, dim, generator=gen).to(dtype) for heads, dim in ((1, 7), (3, 5), (2, 64))]
    ref = [b.clone() for b in bufs]
    src = torch.tensor([3, 4, 5, 30, 0], dtype=torch.int64)
    tgt = torch.tensor([4, 5, 6, 2, 39], dtype=torch.int64)  # overlaps its sources: read-before-write matters
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs])
    stand_in.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        r[tgt] = r[src].clone()
        assert torch.equal(b, r)
    stand_in.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt[:0], src[:0])  # nothing to move: nothing touched
    assert all(torch.equal(b, r) for b, r in zip(bufs, ref))


def test_cpu_mode_leaves_flashinfer_out_the_way_sglangs_cpu_install_does():
    """In CPU mode `import flashinfer` fails with the ModuleNotFoundError SGLang's guards expect (its CPU
    install has none), and the modules a server's processes run from (HTTP server, scheduler with its model
    runner and speculative workers, detokenizer, our model overlays) import without FlashInfer or cutlass."""
    code = textwrap.dedent("""
        import sys
        try:
            import flashinfer.sampling
        except ModuleNotFoundError as e:
            assert e.name == "flashinfer" and "sglang-hs" in str(e), e
        else:
            raise AssertionError("flashinfer imported")
        import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
        import sglang.srt.managers.detokenizer_manager, sglang.srt.model_executor.model_runner
        import sglang.srt.speculative.eagle_worker_v2, sglang.srt.speculative.ngram_worker
        import sglang.srt.speculative.dspark_components.dspark_draft
        import sglang_hs.server.models
        from sglang.srt.layers.quantization import fp4_utils
        assert fp4_utils.fp4_quantize is None  # its guarded import took the except branch
        loaded = sorted({m.split(".")[0] for m in sys.modules} & {"flashinfer", "cutlass"})
        assert not loaded, loaded
        print("ok")
    """)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_HS_CPU_MODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (stubs_dir(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
