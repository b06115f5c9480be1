"""The sglang-hs overlay of SGLang's KimiK25ForConditionalGeneration (Kimi-K2.5), text only.

Upstream (`sglang/srt/models/kimi_k25.py`) wraps a MoonViT vision tower, a projector and, as its
language model, an upstream `DeepseekV3ForCausalLM` imported directly: the registry override by name
never reaches it. This subclass (registered under the same name) builds the wrapper with the overlay's
DeepseekV3 as that language model (runtime patch sglang_hs/server/patches/kimi_k25_language_model.py, scoped
to the constructor), so capture is the V3 overlay's unchanged: same layer convention (of the text
model's layers), fixed output structure, store and ring. The wrapper exposes the language model's
`hs_spec` / `hs_status` / `hs_writer`, which the capture hooks look for on the served model.

Text only: with capture on, the launcher sets `language_model_only` in the model config (through
--json-model-override-args). SGLang then treats the model as text only (model_config.py: is_lm_only,
so is_multimodal is false): it builds no multimodal processor (Kimi-K2.5's is remote code), a chat
request carrying an image is refused with a one-line error (HTTP 400 "Model only supports text input;
received unsupported content type 'image_url'.", entrypoints/openai/serving_chat.py), and image data
sent to /generate is dropped by the
tokenizer manager before the scheduler (the request runs on its text; no image embedding ever reaches
the model). Image placeholder ids sent as plain token ids are just tokens: their rows are the text
model's states for those ids. The vision tower is still constructed by upstream's constructor (no
weights loaded for it, never run). SGLang's own --language-model-only refuses this architecture.
"""
from __future__ import annotations

from sglang.srt.models import kimi_k25 as upstream

from sglang_hs import envs
from sglang_hs.server.capture_spec import check_architecture
from sglang_hs.server.models.deepseek_v2 import DeepseekV3ForCausalLM as _OverlayDeepseekV3ForCausalLM

OriginalKimiK25ForConditionalGeneration = upstream.KimiK25ForConditionalGeneration


class KimiK25LanguageModel(_OverlayDeepseekV3ForCausalLM):
    """The overlay's DeepseekV3ForCausalLM as Kimi-K2.5's language model; its config is the wrapper's
    text_config, and the architecture check is the wrapper's."""

    hs_check_architecture = False


class KimiK25ForConditionalGeneration(OriginalKimiK25ForConditionalGeneration):
    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs) -> None:
        from sglang_hs.server.patches import kimi_k25_language_model

        if envs.SGLANG_HS_DUMP_DIR:
            check_architecture(getattr(config, "architectures", None), where="the served model's config",
                               config=config)
        with kimi_k25_language_model.building(KimiK25LanguageModel):
            super().__init__(config, quant_config=quant_config, prefix=prefix, **kwargs)
        if self.language_model is not None and not isinstance(self.language_model, KimiK25LanguageModel):
            raise RuntimeError("sglang-hs: Kimi-K2.5's language model was not built as the overlay's "
                               f"({type(self.language_model).__module__}.{type(self.language_model).__name__})")

    # The capture hooks find these on the served model (here: the wrapper).
    @property
    def hs_spec(self):
        return getattr(self.language_model, "hs_spec", None)

    @property
    def hs_status(self):
        return getattr(self.language_model, "hs_status", None)

    @property
    def hs_writer(self):
        return getattr(self.language_model, "hs_writer", None)

    @hs_writer.setter
    def hs_writer(self, writer) -> None:
        self.language_model.hs_writer = writer


EntryClass = [KimiK25ForConditionalGeneration]
