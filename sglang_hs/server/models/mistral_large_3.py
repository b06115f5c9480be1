"""The sglang-hs overlay of SGLang's MistralLarge3ForCausalLM (Mistral Large 3, text).

Upstream (`sglang/srt/models/mistral_large_3.py`) subclasses DeepseekV3ForCausalLM and only renames
Mistral-native weights on load (`load_weights`); its config comes from `params.json` through SGLang's
Mistral parser (`srt/utils/hf_transformers/mistral_utils.py::adapt_config_dict`: model_type
deepseek_v3, softmax routing, YaRN, plus `llama_4_scaling`, which the inner DeepseekV2Model applies to
the queries). So the capture is the V3 overlay's, unchanged (same layer convention, fixed output
structure, store, ring): the mixin goes before the upstream class, which keeps its weight remapping.

Not covered: a Mistral Large 3 checkpoint with a vision encoder is served by SGLang as
PixtralForConditionalGeneration, which builds this class inside itself by a direct import
(`srt/models/pixtral.py`), out of the registry's reach; the launcher refuses that architecture.
"""
from __future__ import annotations

from sglang.srt.models import mistral_large_3 as upstream

from sglang_hs.server.models.deepseek_v2 import _HiddenStateOverlay

OriginalMistralLarge3ForCausalLM = upstream.MistralLarge3ForCausalLM


class MistralLarge3ForCausalLM(_HiddenStateOverlay, OriginalMistralLarge3ForCausalLM):
    pass


EntryClass = [MistralLarge3ForCausalLM]
