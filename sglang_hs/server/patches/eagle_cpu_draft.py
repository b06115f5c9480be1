"""CPU engine, EAGLE / NEXTN (MTP) drafts: the pieces of SGLang 0.5.23's draft path that call CUDA.

`DeepseekV2ForCausalLM.set_embed_and_head` (the draft takes the target's embedding and LM head when its
memory pool is made, eagle_worker_v2.init_lm_head) ends with `torch.cuda.empty_cache()` and
`torch.cuda.synchronize()`, which raise on a machine without a CUDA driver: on a CPU device the same
rebinding runs without them. `DraftBackendFactory._create_backend` knows no torch_native backend for the
draft's extend pass (the pass over each request's accepted tokens after a verify): it gets SGLang's own
TorchNativeAttnBackend there, as the target has. Nor does it know a torch_native multi-step draft decode
backend (--speculative-num-steps > 1: the draft's steps 0..num_steps-2 run the draft model over topk tokens
per request each; one step needs none): `TorchNativeMultiStepDraftBackend` is one, reading the draft KV as
SGLang's Triton and FlashInfer ones do (speculative/eagle_utils.per_step_draft_out_cache_loc and
kernels/ops/speculative/cache_locs.generate_draft_decode_kv_indices, page size 1): branch t of request b
writes its step-s token at req_to_token[b, seq_len + t * num_steps + s], and its step-i query attends the
prefix req_to_token[b, :seq_len] and its own column's slots seq_len + t * num_steps + 0..i. As upstream: with
top-k > 1 the column is the branch's slot, not its ancestry (select_top_k_tokens may re-parent a column at a
later step); the drafts are only proposals, the target's verify pass judges them over the true tree. A DSA draft
(DeepSeek-V3.2's MTP layer) attends over the keys its indexer selected among those same slots (its indexer runs
over this step's spans: sglang_hs/server/patches/dsa_spec_verify.py). See the ledger in
sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION


def _cpu_safe(original):
    def set_embed_and_head(self, embed, head):
        if embed.is_cuda:
            return original(self, embed, head)
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head

    set_embed_and_head.__wrapped__ = original
    return set_embed_and_head


def draft_step_spans(seq_lens, req_pool_indices, topk: int, num_steps: int, step: int):
    """The spans (sglang_hs/server/ops/masked_attention.py) of draft step `step` (0-based, < num_steps - 1):
    query row b * topk + t (request b, branch t) attends req_to_token[req_b, :seq_len_b] and its branch's
    slots seq_len_b + t * num_steps + 0..step (its own token, written at this step, last)."""
    import torch

    spans = []
    for b, (req, prefix) in enumerate(zip(req_pool_indices, seq_lens)):
        for t in range(topk):
            first = prefix + t * num_steps  # this branch's step-0 slot
            length = first + step + 1

            def mask(length, prefix=prefix, first=first):
                visible = torch.zeros((1, length), dtype=torch.bool)
                visible[0, :prefix] = True
                visible[0, first:] = True
                return visible

            spans.append((req, length, slice(b * topk + t, b * topk + t + 1), mask))
    return spans


def _step_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeDraftStepBackend(TorchNativeAttnBackend):
        """One draft decode step: the step's KV written at forward_batch.out_cache_loc (the step's slots,
        which EagleWorkerV2.draft_forward sets), then each query over its prefix and its branch's drafts; with DSA's
        `topk_indices` (DeepSeek-V3.2), over the keys its indexer selected among those (dsa_spec_verify runs the
        draft step's indexer over the same `spans`)."""

        hs_draft_step = True  # dsa_spec_verify's indexer reads `spans` of a backend so marked

        def __init__(self, model_runner, topk: int, num_steps: int, step: int):
            super().__init__(model_runner)
            if self.use_sliding_window_kv_pool or (model_runner.sliding_window_size or 0) > 0:
                raise NotImplementedError("sglang-hs: a multi-step EAGLE draft with sliding-window layers has no "
                                          "CPU path (--speculative-num-steps 1 has)")
            self.topk, self.num_steps, self.step = topk, num_steps, step
            self.spans = None

        def init_forward_metadata(self, forward_batch):
            self.swa_out_cache_loc = None
            self.spans = draft_step_spans([int(x) for x in forward_batch.seq_lens.tolist()],
                                          [int(x) for x in forward_batch.req_pool_indices.tolist()],
                                          self.topk, self.num_steps, self.step)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            from sglang_hs.server.ops.masked_attention import masked_attention

            topk_indices = kwargs.pop("topk_indices", None)
            extra = sorted(name for name, value in kwargs.items() if value is not None)
            if extra:  # upstream's torch_native forward_decode takes none: refuse what this one would ignore
                raise NotImplementedError(f"sglang-hs eagle_cpu_draft: a draft decode step with {', '.join(extra)} "
                                          "has no CPU path")
            if (getattr(layer, "sliding_window_size", -1) or -1) > -1:
                raise NotImplementedError("sglang-hs: a multi-step EAGLE draft with sliding-window layers has no "
                                          "CPU path (--speculative-num-steps 1 has)")
            rows = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim).shape[0]
            # DP attention pads a group's batch to its peers' after the spans were built (ModelRunner's
            # prepare_mlp_sync_batch, speculative: to the largest group's): rows past the spans are that padding,
            # and masked_attention leaves them zero
            if rows < len(self.spans):
                raise RuntimeError(f"sglang-hs eagle_cpu_draft: draft step {self.step} got {rows} query rows for "
                                   f"{len(self.spans)} branches")
            if topk_indices is not None:  # DSA (DeepSeek-V3.2's MTP layer): the keys its indexer selected among
                # the same spans (dsa_spec_verify gives the draft step's indexer these spans)
                from sglang_hs.server.patches.dsa_torch_native import sparse_attention

                return sparse_attention(self, q, k, v, layer, forward_batch, save_kv_cache, topk_indices,
                                        spans=self.spans)
            return masked_attention(self, q, k, v, layer, forward_batch, save_kv_cache, self.spans)

        def forward_extend(self, *args, **kwargs):
            raise NotImplementedError("sglang-hs eagle_cpu_draft: a draft decode step backend runs decode only")

    return TorchNativeDraftStepBackend


class TorchNativeMultiStepDraftBackend:
    """The draft's multi-step decode backend on the CPU engine (the container EagleWorkerV2 calls
    `init_forward_metadata` on once per draft, then reads `attn_backends[i]` for step i), as SGLang's
    TritonMultiStepDraftBackend: num_steps - 1 step backends, page size 1."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        from sglang.srt.speculative.spec_utils import resolve_draft_decode_window

        page_size = model_runner.token_to_kv_pool.page_size
        if page_size != 1:
            raise NotImplementedError(f"sglang-hs: a multi-step EAGLE draft on the CPU engine needs --page-size 1 "
                                      f"(got {page_size})")
        if resolve_draft_decode_window(model_runner) != (0, 0):
            raise NotImplementedError("sglang-hs: --speculative-draft-window-size has no CPU path")
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.device = model_runner.device
        step_cls = _step_backend_class()
        self.attn_backends = [step_cls(model_runner, topk, speculative_num_steps, i)
                              for i in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


def _with_torch_native(original):
    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        if "torch_native" not in backend_map:
            if stamps_children:  # the draft's multi-step decode container
                def make():
                    return ("torch_native", TorchNativeMultiStepDraftBackend(self.draft_model_runner, self.topk,
                                                                             self.speculative_num_steps))
            else:  # the draft extend's single backend
                def make():
                    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

                    return ("torch_native", TorchNativeAttnBackend(self.draft_model_runner))
            backend_map = dict(backend_map, torch_native=make)
        return original(self, backend_name, backend_map, error_template, stamps_children)

    _create_backend.__wrapped__ = original
    return _create_backend


def apply():
    """Wrap DeepseekV2ForCausalLM.set_embed_and_head and DraftBackendFactory._create_backend; returns the
    originals."""
    import sglang
    from sglang.srt.models import deepseek_v2

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch eagle_cpu_draft targets sglang {SGLANG_VERSION}, found "
                           f"{sglang.__version__}")
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    cls = deepseek_v2.DeepseekV2ForCausalLM
    originals = {"DeepseekV2ForCausalLM.set_embed_and_head": cls.set_embed_and_head,
                 "DraftBackendFactory._create_backend": DraftBackendFactory._create_backend}
    cls.set_embed_and_head = _cpu_safe(cls.set_embed_and_head)
    DraftBackendFactory._create_backend = _with_torch_native(DraftBackendFactory._create_backend)
    return originals
