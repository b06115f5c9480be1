"""Capture on: tag SGLang's own start-up warm-up request so its record is never emitted.

SGLang's HTTP server sends one warm-up `/generate` before it reports ready, with no request id; the
tokenizer manager then draws a random one, so the scheduler cannot tell it from a user's request.
Requests without a rid that arrive while the server is not yet `Up` get the rid `HS_WARMUP-<hex>` (each
prompt of a batch its own: with data-parallel attention the warm-up is one prompt per group),
and the capture hook (capture_hooks.py) does not publish them. Applied in the HTTP server process
(sglang_hs/server/serve.py); see the ledger in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import uuid

from sglang_hs.version import SGLANG_VERSION

PREFIX = "HS_WARMUP-"
ORIGINALS = {}


def _single(obj) -> bool:
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    return isinstance(text, str) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], int))


def _batch(obj) -> int:
    """Prompts in a batch request (SGLang's warm-up with data-parallel attention sends one per group), else 0."""
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return len(text)
    if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        return len(ids)
    return 0


def apply():
    import sglang
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch warmup_rid targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    original = ORIGINALS["generate_request"] = TokenizerManager.generate_request

    async def generate_request(self, obj, request=None):
        if getattr(obj, "rid", None) is None and self.server_status != ServerStatus.Up:
            if _single(obj):
                obj.rid = PREFIX + uuid.uuid4().hex
            elif _batch(obj):
                obj.rid = [PREFIX + uuid.uuid4().hex for _ in range(_batch(obj))]
        async for out in original(self, obj, request):
            yield out

    TokenizerManager.generate_request = generate_request
    return original
