"""How long the prompt of a session turn's record will be, read before SGLang builds the request.

A `/generate` with `session_params` (a session opened with `/open_session`) is a turn: SGLang 0.5.23's
`Session.create_req` (srt/session/session_controller.py) makes its `origin_input_ids` the context of the
turn it continues plus the new tokens, and that whole context, as forwarded, is what the record holds
(token ids and rows). Admission sees only the new tokens (`input_ids`), before `create_req` runs, so it
asks here for the length `create_req` will build, with the same rules:

- the turn continued: `session_params.rid`'s (for a streaming session, the session's one request); none
  (rid None, or `replace` without rid) starts afresh from the new tokens alone;
- its context: that turn's `origin_input_ids` plus its output ids up to its `max_new_tokens` (without
  them when `drop_previous_output`), cut to `[:offset]` when an `offset` is given; a streaming session
  first trims the history back to its last committed length;
- the new tokens, less a leading BOS when there is history.

A turn `create_req` will refuse (unknown session or rid, a streaming session busy, its previous turn not
finished, replace/offset/drop on a streaming session) gets None: its record is never made, and
admission sizes it from its own tokens. Radix-native sessions (`--enable-session-radix-cache` with a
top-level `session_id`) are plain requests: None.
"""
from __future__ import annotations

from typing import Optional


def _continued(session, params):
    """(the request the turn continues or None, refused?)"""
    nodes = session.req_nodes
    offset = bool(params.offset)
    if session.streaming:
        if session._inflight or params.replace or params.drop_previous_output or offset:
            return None, True
        return (next(iter(nodes.values())).req if len(nodes) == 1 else None), False
    if params.rid is None:
        return None, False  # replace without rid clears the session; a plain turn without rid has no history
    node = nodes.get(params.rid)
    if node is None:
        return None, True
    if not params.replace and not node.req.finished():
        return None, True
    return node.req, False


def turn_prompt_len(req, sessions, tokenizer, radix_native: bool = False) -> Optional[int]:
    """len(origin_input_ids) SGLang will give the session turn `req` (a TokenizedGenerateReqInput), or
    None when `req` is no session turn or will be refused. `sessions`: the scheduler's SessionController."""
    params = getattr(req, "session_params", None)
    if params is None or params.id is None or req.input_ids is None:
        return None
    if radix_native and getattr(req, "session_id", None) is not None:
        return None
    session = sessions.get(params.id) if sessions is not None else None
    if session is None or session.close_on_finish:
        return None
    last, refused = _continued(session, params)
    new = len(req.input_ids)
    if refused:
        return None
    if last is None:
        return new if new else None
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if new and bos is not None and req.input_ids[0] == bos:
        new -= 1
    out_tail = len(last.output_ids[: last.sampling_params.max_new_tokens])
    if session.streaming and session.committed_origin_len is not None:  # the in-place append (share path)
        base = min(session.committed_origin_len, len(last.origin_input_ids)) + out_tail
        return base + new
    base = len(last.origin_input_ids) + (0 if params.drop_previous_output else out_tail)
    if params.offset:
        base = len(range(base)[: params.offset])
    return (base + new) or None
