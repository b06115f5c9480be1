"""The longest request the server will run, by SGLang 0.5.23's own rules, so a sample it would refuse is
skipped as too long (counted) instead of sent, refused and ending the run.

SGLang checks a request twice:
- the tokenizer (`TokenizerManager._validate_one_request`) refuses a prompt of `context_len` tokens or more
  (plus `num_reserved_tokens`, 0 without EAGLE) and a prompt + max_new_tokens over `context_len`
  (`validate_total_tokens`), with HTTP 400;
- the scheduler (`validate_input_length`, managers/utils.py) aborts a prompt of `max_req_input_len` tokens
  or more, where `max_req_input_len = min(context_len - 1, kv_capacity - 1) - 5` (`TpModelWorker.
  get_worker_info`; the KV pool's tokens as the scheduler counts them), and reports it in /server_info.

The server's own `max_req_input_len` (from /server_info) is used when it answers (it may not: behind
--api-key); else the same formula on the dump's manifest: its store has a slot per KV token plus a page
(`num_slots` = pool + `page_size`), so the page is taken off (a manifest without `page_size`, from an
older server, takes off 1 and may be a page too generous; a KV index translator's virtual table, as with
decode context parallelism, makes the store larger still: there only /server_info is exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

INPUT_MARGIN = 5  # TpModelWorker.get_worker_info: max_req_input_len = max_req_len - 5


def max_req_input_len(context_len: int, kv_tokens: int) -> int:
    """SGLang's scheduler limit: prompts of this many tokens or more are aborted."""
    return min(context_len - 1, kv_tokens - 1) - INPUT_MARGIN


@dataclass(frozen=True)
class RequestLimits:
    context_len: int
    max_input: int  # the scheduler's max_req_input_len

    def refusal(self, prompt_tokens: int, max_new_tokens: int) -> Optional[str]:
        """Why SGLang would refuse a request of `prompt_tokens` and `max_new_tokens`, or None."""
        if prompt_tokens >= self.max_input:
            return f"{prompt_tokens} prompt tokens >= {self.max_input}, the server's max_req_input_len"
        if prompt_tokens >= self.context_len:
            return f"{prompt_tokens} prompt tokens >= the context length {self.context_len}"
        if prompt_tokens + max_new_tokens > self.context_len:
            return (f"{prompt_tokens} prompt tokens + {max_new_tokens} new > the context length "
                    f"{self.context_len}")
        return None

    @classmethod
    def of_context(cls, context_len: int, kv_tokens: Optional[int] = None) -> "RequestLimits":
        return cls(context_len, max_req_input_len(context_len, kv_tokens or context_len))

    @classmethod
    def of_server(cls, manifest: dict, url: Optional[str] = None, timeout: float = 30.0) -> "RequestLimits":
        """The limits of the server of `manifest` (at `url`: its own max_req_input_len, when it says)."""
        context_len = int(manifest.get("context_len") or 10**12)
        reported = None
        if url:
            import requests

            try:
                r = requests.get(f"{url}/server_info", timeout=timeout)
                if r.status_code == 200:
                    reported = r.json().get("max_req_input_len")
            except (requests.RequestException, ValueError):
                reported = None
        if isinstance(reported, int) and reported > 0:
            return cls(context_len, reported)
        kv_tokens = min(int(w["num_slots"]) for w in manifest["writers"]) - int(manifest.get("page_size") or 1)
        return cls.of_context(context_len, kv_tokens)
