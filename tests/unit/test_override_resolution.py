"""Prove the override wins: resolve the architecture the way SGLang does, in a fresh process."""
import os
import subprocess
import sys

from sglang_hs.cpu import stubs_dir

SCRIPT = """
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.models import deepseek_v2 as upstream
from sglang.srt.models import mistral_large_3
from sglang_hs.models.deepseek_v2 import _HiddenStateOverlay
for arch, module, up in (("DeepseekV2ForCausalLM", "deepseek_v2", upstream),
                         ("DeepseekV3ForCausalLM", "deepseek_v2", upstream),
                         ("MistralLarge3ForCausalLM", "mistral_large_3", mistral_large_3)):
    cls, name = ModelRegistry.resolve_model_cls([arch])
    assert name == arch, name
    assert cls.__module__ == "sglang_hs.models." + module, cls.__module__
    assert issubclass(cls, getattr(up, arch)) and issubclass(cls, _HiddenStateOverlay), cls.__mro__
# Mistral Large 3 keeps upstream's weight renaming (its checkpoints use Mistral names).
assert cls.load_weights is mistral_large_3.MistralLarge3ForCausalLM.load_weights

# Kimi-K2.5: the wrapper resolves to ours, and inside its constructor the name upstream's wrapper calls
# for its language model is the overlay's DeepseekV3 (restored afterwards).
from sglang.srt.models import kimi_k25
from sglang_hs.models import kimi_k25 as ours
from sglang_hs.patches import kimi_k25_language_model as patch
cls, name = ModelRegistry.resolve_model_cls(["KimiK25ForConditionalGeneration"])
assert cls is ours.KimiK25ForConditionalGeneration and issubclass(cls, kimi_k25.KimiK25ForConditionalGeneration)
assert issubclass(ours.KimiK25LanguageModel, _HiddenStateOverlay)
assert issubclass(ours.KimiK25LanguageModel, upstream.DeepseekV3ForCausalLM)
seen = []
def fake_init(self, config, quant_config=None, prefix="", **kw):
    seen.append(kimi_k25.DeepseekV3ForCausalLM)
    self.language_model = None
orig_init = kimi_k25.KimiK25ForConditionalGeneration.__init__
kimi_k25.KimiK25ForConditionalGeneration.__init__ = fake_init
try:
    cls.__new__(cls).__init__(type("C", (), {"architectures": ["KimiK25ForConditionalGeneration"]})())
finally:
    kimi_k25.KimiK25ForConditionalGeneration.__init__ = orig_init
assert seen == [ours.KimiK25LanguageModel], seen
assert kimi_k25.DeepseekV3ForCausalLM is patch.ORIGINAL is upstream.DeepseekV3ForCausalLM
print("OK")
"""


def test_registry_resolves_to_overlay():
    env = dict(os.environ, SGLANG_EXTERNAL_MODEL_PACKAGE="sglang_hs.models", SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [stubs_dir(), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
