"""CPU engine, EAGLE / NEXTN (MTP) drafts: the pieces of SGLang 0.5.23's draft path that call CUDA.

`DeepseekV2ForCausalLM.set_embed_and_head` (the draft takes the target's embedding and LM head when its
memory pool is made, eagle_worker_v2.init_lm_head) ends with `torch.cuda.empty_cache()` and
`torch.cuda.synchronize()`, which raise on a machine without a CUDA driver: on a CPU device the same
rebinding runs without them. `DraftBackendFactory._create_backend` knows no torch_native backend for the
draft's extend pass (the pass over each request's accepted tokens after a verify): the one-step draft
(--speculative-num-steps 1, DeepSeek's MTP setting, which needs no multi-step decode backend) gets SGLang's
own TorchNativeAttnBackend there, as the target has. See the ledger in sglang_hs/server/patches/__init__.py.
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


def _with_torch_native(original):
    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        if not stamps_children and "torch_native" not in backend_map:  # the draft extend's single backend
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            backend_map = dict(backend_map, torch_native=lambda: ("torch_native",
                                                                  TorchNativeAttnBackend(self.draft_model_runner)))
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
