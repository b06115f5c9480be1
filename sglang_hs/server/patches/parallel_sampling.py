"""Capture on: tag the prefix request SGLang sends before the choices of an `n > 1` request, so it leaves
no record.

For `n > 1` (parallel sampling), `TokenizerManager._handle_batch_request` first sends, per prompt, a copy
with `max_new_tokens = 0` under a fresh random rid (to put the prompt in the radix cache), waits for it,
and then sends the n choices, each under its own fresh rid (the `meta_info["id"]` of each output). The
prefix request would be recorded like a user's prompt-only request: a record nobody asked for, under a
rid no client sees, holding its ring space for good with an acknowledging reader. While an `n > 1`
request is being sent, the first `batch_size` requests it sends are those prefix requests (the loop
awaits each before the choices go out); each gets `custom_params[INTERNAL_KEY] = PARALLEL_SAMPLING_PREFIX`
on its own sampling-params copy (the choices' are untouched), and admission
(sglang_hs/server/store/admission.py) serves it without a record or marker. Applied in the HTTP server process
(sglang_hs/server/serve.py); see the ledger in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import contextvars

from sglang_hs.version import SGLANG_VERSION

ORIGINALS = {}
# prefix requests still to be sent by the n > 1 request this task is handling (a task's own context)
_prefixes_left: "contextvars.ContextVar[int]" = contextvars.ContextVar("sglang_hs_prefixes_left", default=0)


def tag(sampling_params) -> None:
    from sglang_hs.server.store.admission import INTERNAL_KEY, PARALLEL_SAMPLING_PREFIX

    params = dict(sampling_params.custom_params or {})  # a new dict: the choices share the old one
    params[INTERNAL_KEY] = PARALLEL_SAMPLING_PREFIX
    sampling_params.custom_params = params


def apply():
    import sglang
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch parallel_sampling targets sglang {SGLANG_VERSION}, "
                           f"found {sglang.__version__}")
    handle = ORIGINALS["_handle_batch_request"] = TokenizerManager._handle_batch_request
    send = ORIGINALS["_send_one_request"] = TokenizerManager._send_one_request

    async def _handle_batch_request(self, obj, request, request_states):
        n = getattr(obj, "parallel_sample_num", 1) or 1
        _prefixes_left.set(obj.batch_size if n > 1 else 0)
        try:
            async for out in handle(self, obj, request, request_states):
                _prefixes_left.set(0)  # all sent before the first output
                yield out
        finally:
            _prefixes_left.set(0)

    async def _send_one_request(self, tokenized_obj, *args, **kwargs):
        left = _prefixes_left.get()
        if left > 0:
            _prefixes_left.set(left - 1)
            sp = getattr(tokenized_obj, "sampling_params", None)
            if sp is not None and sp.max_new_tokens == 0:
                tag(sp)
        return await send(self, tokenized_obj, *args, **kwargs)

    TokenizerManager._handle_batch_request = _handle_batch_request
    TokenizerManager._send_one_request = _send_one_request
    return dict(ORIGINALS)
