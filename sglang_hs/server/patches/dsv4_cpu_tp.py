"""CPU engine, --tp > 1: keep DeepSeek-V4's head counts as its config gives them.

See the ledger in sglang_hs/server/patches/__init__.py. On the CPU engine `ModelRunner.load_model` first calls
`update_config.adjust_config_with_unaligned_cpu_tp(model_config, load_config, tp_size)`, which pads a GQA model's KV
heads to a multiple of the TP size when they do not divide (and its query heads with them, heads per KV head
unchanged). DeepSeek-V4's attention is an MQA: one KV head (the compressed key = value) that every attention-TP rank
keeps whole, the query heads split across the ranks (`MqaAttentionBase`: `n_local_heads = n_heads // attn_tp_size`,
`assert config.num_key_value_heads == 1`; wq_b, wo_a column parallel and wo_b row parallel over the attention-TP
group). So the padding turns V4's 1 KV head into tp_size and its query heads into tp_size x n_heads, and the model
fails to build (that assertion). On a GPU this function is never called: the ranks split V4 as the config says.

For a DeepSeek-V4 config (model_type deepseek_v4 / deepseek_v41) whose query heads and output groups the TP size
divides, the wrapper runs SGLang's function (the MoE intermediate padding and the rest stay SGLang's) and puts
back `num_attention_heads` and `num_key_value_heads` where it changed them (model_config, hf_config,
hf_text_config). Any other config goes to SGLang's unchanged; a V4 whose heads or groups the TP size does not
divide is refused (ValueError), as the launcher refuses it before a server starts. Applied in every spawned SGLang
process before its scheduler loads the model (sglang_hs/server/serve.py, `apply_spawned`), and again, as a no-op,
with the model's patches.
"""
from __future__ import annotations

import functools
import sys

from sglang_hs.version import SGLANG_VERSION

V4_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
_HEADS = ("num_attention_heads", "num_key_value_heads")
ORIGINALS = {}


def is_v4(model_config) -> bool:
    return getattr(model_config.hf_config, "model_type", None) in V4_MODEL_TYPES


def tp_refusal(n_heads: int, n_groups: int, tp_size: int):
    """None, or why DeepSeek-V4 cannot be split over `tp_size` attention-TP ranks (one line)."""
    if n_heads % tp_size or n_groups % tp_size:
        return (f"DeepSeek-V4 attention tensor parallel {tp_size}: its {n_heads} query heads and {n_groups} output "
                f"groups (o_groups) must both divide by it (each rank takes whole heads and groups)")
    return None


def _attn_tp_size() -> int:
    """This process's attention-TP size (TP / DP under DP attention): the query heads and groups split over it.
    SGLang's parallel context is set before load_model, which calls the wrapped function with the whole TP size."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_size


def _keeping_v4_heads(original, attn_tp_size=_attn_tp_size):
    @functools.wraps(original)
    def adjust_config_with_unaligned_cpu_tp(model_config, load_config, tp_size):
        if not is_v4(model_config):
            return original(model_config, load_config, tp_size)
        text = model_config.hf_text_config
        why = tp_refusal(text.num_attention_heads, getattr(text, "o_groups", 1), attn_tp_size())
        if why:
            raise ValueError(f"sglang-hs dsv4_cpu_tp: {why}")
        holders = {id(o): o for o in (model_config, model_config.hf_config, text)}.values()
        kept = [(o, name, getattr(o, name)) for o in holders for name in _HEADS if hasattr(o, name)]
        out = original(model_config, load_config, tp_size)
        for o, name, value in kept:
            setattr(o, name, value)
        return out

    adjust_config_with_unaligned_cpu_tp.__wrapped__ = original
    return adjust_config_with_unaligned_cpu_tp


def apply():
    """Wrap update_config.adjust_config_with_unaligned_cpu_tp (and model_runner's binding of it, if that module is
    imported already); returns the original. Idempotent."""
    import sglang
    from sglang.srt.configs import update_config

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch dsv4_cpu_tp targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    if "adjust" not in ORIGINALS:
        original = ORIGINALS["adjust"] = update_config.adjust_config_with_unaligned_cpu_tp
        update_config.adjust_config_with_unaligned_cpu_tp = _keeping_v4_heads(original)
    runner = sys.modules.get("sglang.srt.model_executor.model_runner")
    if runner is not None and runner.adjust_config_with_unaligned_cpu_tp is ORIGINALS["adjust"]:
        runner.adjust_config_with_unaligned_cpu_tp = update_config.adjust_config_with_unaligned_cpu_tp
    return ORIGINALS["adjust"]
