"""Prove the override wins: resolve the architecture the way SGLang does, in a fresh process."""
import os
import subprocess
import sys

from sglang_hs.server.cpu import stubs_dir

SCRIPT = """
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.models import deepseek_v2 as upstream
from sglang.srt.models import mistral_large_3
from sglang_hs.server.models.deepseek_v2 import _HiddenStateOverlay
for arch, module, up in (("DeepseekV2ForCausalLM", "deepseek_v2", upstream),
                         ("DeepseekV3ForCausalLM", "deepseek_v2", upstream),
                         ("MistralLarge3ForCausalLM", "mistral_large_3", mistral_large_3)):
    cls, name = ModelRegistry.resolve_model_cls([arch])
    assert name == arch, name
    assert cls.__module__ == "sglang_hs.server.models." + module, cls.__module__
    assert issubclass(cls, getattr(up, arch)) and issubclass(cls, _HiddenStateOverlay), cls.__mro__
# Mistral Large 3 keeps upstream's weight renaming (its checkpoints use Mistral names).
assert cls.load_weights is mistral_large_3.MistralLarge3ForCausalLM.load_weights

# Kimi-K2.5: the wrapper resolves to ours, and inside its constructor the name upstream's wrapper calls
# for its language model is the overlay's DeepseekV3 (restored afterwards).
from sglang.srt.models import kimi_k25
from sglang_hs.server.models import kimi_k25 as ours
from sglang_hs.server.patches import kimi_k25_language_model as patch
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
    env = dict(os.environ, SGLANG_EXTERNAL_MODEL_PACKAGE="sglang_hs.server.models", SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [stubs_dir(), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


V4_SCRIPT = """
import os, types
import torch
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.models import deepseek_v4 as upstream
from sglang.srt.layers.layernorm import RMSNorm
from sglang_hs.server.capture_spec import CaptureConfigError
from sglang_hs.server.models import deepseek_v4 as ours
from sglang_hs.server.models.deepseek_v2 import _HiddenStateOverlay
cls, name = ModelRegistry.resolve_model_cls(["DeepseekV4ForCausalLM"])
assert cls is ours.DeepseekV4ForCausalLM, cls
assert issubclass(cls, upstream.DeepseekV4ForCausalLM) and issubclass(cls, _HiddenStateOverlay), cls.__mro__

# The capture set-up (upstream's constructor builds V4's CUDA-only attention: a bare instance instead).
def bare(streams, lagged=False, layers="1,3"):
    os.environ.update(SGLANG_HS_LAYERS=layers, SGLANG_HS_LAST="both", SGLANG_HS_HC_STREAMS=streams)
    m = cls.__new__(cls); torch.nn.Module.__init__(m)
    m.model = upstream.DeepseekV4Model.__new__(upstream.DeepseekV4Model); torch.nn.Module.__init__(m.model)
    m.model.norm = RMSNorm(8)
    cfg = types.SimpleNamespace(architectures=["DeepseekV4ForCausalLM"], num_hidden_layers=6, hidden_size=8,
                                hc_mult=4, hc_pre_from_prev_sublayer=lagged)
    m._hs_setup_capture(cfg)
    return m
m = bare("mean")
# SGLang captures dspark id j after layer j: the state entering layer i is j = i - 1
assert m.model.dspark_layers_to_capture == [0, 2] and type(m.model) is ours._CapturingDeepseekV4Model
assert m.capture_aux_hidden_states and m.hs_spec.rows_per_token == 4 and m.hs_spec.streams == "mean"
assert type(m.model.norm).__name__ == "PreNormCapturingRMSNorm"
assert bare("mean", lagged=True).model.dspark_layers_to_capture == [1, 3]  # captured before layer j there
m = bare("full")
assert m.hs_spec.rows_per_token == 2 * 4 + 2
assert upstream.AuxHiddenStatePacker.__name__ == "StreamsPacker"
try:
    bare("mean", layers="0,3")
    raise SystemExit("id 0 was not refused")
except CaptureConfigError as e:
    assert "id 0 (the embedding)" in str(e) and "\\n" not in str(e), e
# a DSpark drafter's ids (--speculative-algorithm DSPARK): the union is captured once, each side gets its own
m.pp_group, m.config = types.SimpleNamespace(is_last_rank=True), types.SimpleNamespace(num_hidden_layers=6)
m.set_dspark_layers_to_capture([2, 4, 5])
assert m.model.dspark_layers_to_capture == [0, 2, 4, 5] and m.model.hs_captured == (0, 2, 4, 5)
assert m.hs_dspark == (slice(0, 2), slice(1, 4)), m.hs_dspark
try:
    m.set_dspark_layers_to_capture([6])
    raise SystemExit("a DSpark drafter's id past the layers was taken")
except RuntimeError as e:
    assert "dspark_target_layer_ids" in str(e) and "\\n" not in str(e), e
print("OK")
"""


def test_registry_resolves_deepseek_v4_to_overlay_and_sets_sglangs_dspark_ids():
    env = dict(os.environ, SGLANG_EXTERNAL_MODEL_PACKAGE="sglang_hs.server.models", SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [stubs_dir(), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", V4_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:] + r.stdout[-2000:]
