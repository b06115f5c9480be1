"""Prove the override wins: resolve the architecture the way SGLang does, in a fresh process."""
import os
import subprocess
import sys

from sglang_hs.cpu import stubs_dir

SCRIPT = """
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.models import deepseek_v2 as upstream
for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
    cls, name = ModelRegistry.resolve_model_cls([arch])
    assert name == arch, name
    assert cls.__module__ == "sglang_hs.models.deepseek_v2", cls.__module__
    assert issubclass(cls, getattr(upstream, arch)), cls.__mro__
print("OK")
"""


def test_registry_resolves_to_overlay():
    env = dict(os.environ, SGLANG_EXTERNAL_MODEL_PACKAGE="sglang_hs.models", SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [stubs_dir(), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
