"""One sample's trip to the server and back, the same for the extraction (sources/server.py) and the live dataset
(sglang_hs/live.py): the preparer of samples for a server, the /generate body of a sample, how long its
record may lag the reply, and the loss mask of the record that comes back."""
from __future__ import annotations

from typing import List, Optional

from sglang_hs.extract.errors import ExtractError

RECORD_GRACE_S = 120.0  # after a reply, how long its record may take to reach the reader at most
STATUS_CHECK_S = 0.25  # how often a missing record's server status is looked at (record_overdue)


def record_overdue(dump_dir: str, t_reply: float) -> "str | None":
    """None while the record of a request answered at time.monotonic() `t_reply` may still come; else why
    not: the server's status, written after the reply, has nothing in flight (sglang_hs.status: its record
    would be in the ring already), or RECORD_GRACE_S have passed. The caller polls its reader once more
    before it gives the record up."""
    import time

    from sglang_hs import status

    if time.monotonic() - t_reply > RECORD_GRACE_S:
        return f"no record arrived {RECORD_GRACE_S:.0f}s after the reply"
    snap = status.read(dump_dir)
    if snap["files"] and snap["as_of_ns"] > t_reply * 1e9 and snap["unaccounted"] == 0:
        return "no record: the server's status, written after the reply, has every request it answered published"
    return None


def request_body(sample, rid: str, requests=None) -> dict:
    """The /generate request of one sample: its tokens and one greedy token (with `requests.regenerate`
    (config.RequestSettings), the prompt and a reply sampled with its max_new_tokens, temperature, top_p)."""
    params = {"max_new_tokens": 1, "temperature": 0.0}
    if requests is not None and requests.regenerate:
        params = {"max_new_tokens": requests.max_new_tokens, "temperature": requests.temperature,
                  "top_p": requests.top_p}
    params["custom_params"] = {"hs_capture": True}  # captured by a server that harvests (--hs-capture opt-in)
    return {"input_ids": sample.input_ids, "rid": rid, "sampling_params": params}


def record_loss_mask(sample, output_ids: List[int], rec):
    """The loss mask [T] of a sample's record, after checking the record holds the tokens forwarded for it
    (ExtractError if not): the sample's own mask, or with --regenerate 1 on the generated tokens."""
    import torch

    T = rec.num_tokens
    expect = len(sample.input_ids) if sample.prompt_len is None else sample.prompt_len + len(output_ids) - 1
    want = (sample.input_ids + list(output_ids))[:T]
    if T != expect or rec.input_ids.tolist() != want:
        raise ExtractError(f"the record holds {T} rows, not the {expect} tokens forwarded for this sample")
    if sample.prompt_len is None:
        return torch.tensor(sample.loss_mask[:T])
    return (torch.arange(T) >= sample.prompt_len).long()


def make_preparer(manifest: dict, regenerate: bool = False, max_new_tokens: int = 0, url: Optional[str] = None):
    """The sample preparer for the server of `manifest` (at `url`): its model's tokenizer, and the longest
    request it runs by SGLang's own limits (sglang_hs/extract/limits.py): longer samples are skipped."""
    from transformers import AutoTokenizer

    from sglang_hs.extract.dataset import Preparer
    from sglang_hs.extract.limits import RequestLimits

    tokenizer = AutoTokenizer.from_pretrained(manifest["model_path"])
    return Preparer(tokenizer, RequestLimits.of_server(manifest, url), regenerate=regenerate,
                    max_new_tokens=max_new_tokens)
