"""The output ring's record sizes, without torch: admission's bounds and the launcher's ring floor are computed
from these before any process of the server has imported torch (the launcher never does in CPU mode: ~1.5 s of
every start). sglang_hs/server/store/ring.py holds the layout itself and re-exports these names."""
from __future__ import annotations

from typing import Optional

ALIGN = 64
# flags of a marker record (T = 0): why that request has no record
SKIP_REASONS = {1: "not_opted_in", 2: "not_sampled", 3: "reader_behind", 4: "beam_search", 5: "input_embeds",
                6: "over_budget", 7: "draft_accepted", 8: "oversized"}
MAX_RID_BYTES = 0xFFFF  # the record header holds the request id's utf-8 length in 16 bits


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def record_bytes(T: int, P: int, H: int, elem: int, rid_len: int, meta_len: int = 0,
                 n_ids: Optional[int] = None) -> int:
    """Bytes of a record of T rows [P, H] holding `n_ids` token ids (default T: a whole record; a part holds
    its record's N ids when it is the first one, none after)."""
    ids = T if n_ids is None else n_ids
    return ALIGN + _align(rid_len) + _align(meta_len) + _align(4 * ids) + _align(T * P * H * elem) + ALIGN
