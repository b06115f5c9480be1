"""The longest sample the extraction sends, by SGLang's own limits: a prompt SGLang's scheduler would abort
(`validate_input_length` against `max_req_input_len = min(context_len - 1, kv - 1) - 5`) or its tokenizer
refuse (context length, prompt + max_new_tokens) is skipped as too long, and every shorter one is sent.
Judged against SGLang 0.5.23's own function, around each edge."""
import types

import pytest

from sglang_hs.extract.limits import RequestLimits, max_req_input_len


@pytest.mark.parametrize("context_len, kv", [(4096, 4096), (4096, 2048), (128, 10**6), (32768, 33000)])
def test_the_scheduler_limit_is_sglangs_own(context_len, kv):
    utils = pytest.importorskip("sglang.srt.managers.utils")
    limit = max_req_input_len(context_len, kv)
    assert limit == min(context_len - 1, kv - 1) - 5
    limits = RequestLimits.of_context(context_len, kv)
    for n in range(limit - 3, limit + 4):
        req = types.SimpleNamespace(origin_input_ids=list(range(n)))
        refused = utils.validate_input_length(req, limit, False) is not None  # SGLang's scheduler check
        assert (limits.refusal(n, 1) is not None) == refused, n
        assert refused == (n >= limit)


def test_sglangs_worker_reports_the_limit_by_the_same_formula(monkeypatch):
    """TpModelWorker.get_worker_info computes max_req_input_len; run it on a stand-in worker."""
    tp_worker = pytest.importorskip("sglang.srt.managers.tp_worker")
    monkeypatch.setattr(tp_worker, "get_schedule", lambda: types.SimpleNamespace(max_prefill_tokens=0,
                                                                                  max_queued_requests=0),
                        raising=False)
    for context_len, kv in ((4096, 4096), (4096, 1000), (100, 5000)):
        runner = types.SimpleNamespace(effective_logical_max_total_num_tokens=kv, token_to_kv_pool_allocator=object(),
                                       logical_max_total_num_tokens=kv, max_running_requests=1, random_seed=0,
                                       device="cpu", forward_stream=None,
                                       req_to_token_pool=types.SimpleNamespace(size=1, max_context_len=context_len),
                                       token_to_kv_pool=types.SimpleNamespace(size=kv))
        worker = types.SimpleNamespace(model_runner=runner, model_config=types.SimpleNamespace(context_len=context_len),
                                       dllm_algorithm=None, random_seed=0, device="cpu")
        try:
            info = tp_worker.TpModelWorker.get_worker_info(worker)
        except (AttributeError, TypeError) as e:  # pragma: no cover - the stand-in misses what SGLang reads
            pytest.skip(f"get_worker_info reads more of the worker than the stand-in has: {e}")
        assert info[5] == max_req_input_len(context_len, kv) and info[4] == min(context_len - 1, kv - 1)


def test_the_tokenizers_limits_and_regenerate_budgets():
    limits = RequestLimits(context_len=100, max_input=120)  # a KV pool larger than the context
    assert limits.refusal(99, 1) is None and "context length 100" in limits.refusal(100, 1)
    assert limits.refusal(80, 20) is None and "80 prompt tokens + 21 new" in limits.refusal(80, 21)
    assert "max_req_input_len" in RequestLimits(100, 50).refusal(50, 1) and RequestLimits(100, 50).refusal(49, 1) is None


def test_the_preparer_skips_what_the_server_would_refuse_and_sends_the_rest():
    from sglang_hs.extract.dataset import Preparer, SkipSample

    tok = type("Tok", (), {"is_fast": True, "eos_token_id": 0, "unk_token_id": 3, "__len__": lambda self: 1000,
                           "convert_tokens_to_ids": lambda self, t: 3})()
    prep = Preparer(tok, RequestLimits(context_len=64, max_input=40))
    assert len(prep(0, {"input_ids": list(range(1, 40))}).input_ids) == 39  # one under the scheduler's limit
    with pytest.raises(SkipSample, match="too-long") as e:
        prep(0, {"input_ids": list(range(1, 41))})  # 40: SGLang's scheduler aborts it (before: sent, run ended)
    assert e.value.reason == "too-long" and "max_req_input_len" in str(e.value)
    # a bare context length: the scheduler's limit follows from it (context - 6)
    prep = Preparer(tok, 64)
    assert len(prep(0, {"input_ids": list(range(1, 58))}).input_ids) == 57
    with pytest.raises(SkipSample, match="too-long"):
        prep(0, {"input_ids": list(range(1, 59))})


@pytest.mark.parametrize("page", [1, 16, 64])
def test_without_server_info_the_limit_comes_from_the_store_less_its_extra_page(page):
    """/server_info may not answer (e.g. behind --api-key): the limit follows from the manifest's store,
    which holds SGLang's KV pool plus one page (KVIndexTranslator.capture_token_capacity). Before, the whole
    store counted as KV: a page too generous, so a prompt the scheduler aborts was sent and ended the run."""
    kv = 1000
    manifest = {"context_len": 10**6, "page_size": page, "writers": [{"num_slots": kv + page}]}
    limits = RequestLimits.of_server(manifest)
    assert limits.max_input == max_req_input_len(10**6, kv) == kv - 1 - 5
    assert limits.refusal(kv - 6, 1) is not None and limits.refusal(kv - 7, 1) is None
    older = {"context_len": 10**6, "writers": [{"num_slots": kv + 1}]}  # no page_size: a page of 1 at least
    assert RequestLimits.of_server(older).max_input == kv - 6


def test_the_manifest_records_the_kv_page_size(tmp_path):
    import json

    import torch

    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    CaptureWriter(str(tmp_path), CaptureSpec.resolve([1], False, 4, 8), 16 + 4, torch.float32, 1 << 16, page_size=4)
    manifest = json.load(open(tmp_path / "manifest.json"))
    assert manifest["page_size"] == 4 and manifest["writers"][0]["num_slots"] == 20
