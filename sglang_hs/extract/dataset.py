"""Training data in, token ids and loss masks out: one `Sample` per dataset record, or a skip reason.

Records (JSON Lines, or a Hugging Face `datasets` name/path when that library is installed):
  * a conversation, `conversations` or `messages`, ShareGPT (`from`/`value`: human, gpt, system) or
    OpenAI (`role`/`content`: user, assistant, system) style. It is rendered ONCE with the model's chat
    template and tokenized with character offsets; `loss_mask` is 1 exactly on the tokens of the
    assistant's replies, found by the character offsets of each reply in the rendered text (real
    DeepSeek and Kimi templates have no generation markers and may rewrite earlier turns, e.g. drop
    the reasoning of earlier assistant turns: a reply is then matched by its final answer). The
    end-of-turn special token right after a reply (e.g. `<｜end▁of▁sentence｜>`) is 1 as well: the
    drafter must learn to stop, as in SpecForge's masks. Role headers such as `<｜Assistant｜>` are 0.
  * pre-tokenized: `input_ids` (list of ints) and optional `loss_mask` (same length, 0/1; default 1).

A record that is malformed, empty, or too long for the server's context is skipped with a reason
(`SkipSample.reason`), counted by the caller; nothing here raises for bad data. A JSON Lines file is read
line by line, each decoded on its own: a line that is not UTF-8 (invalid-utf8), not JSON (invalid-json) or
nested deeper than Python's JSON decoder recurses (too-deep) is that one record skipped, the lines around it
read as usual (record i is line i + 1, whatever the lines before hold, so --resume finds the same indices).
A chat template that raises for a record (a `raise_exception` of the template, say, for roles that do not
alternate) skips that record (chat-template-error); one that cannot compile is an error of the model, raised
once (ValueError).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


class SkipSample(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class Sample:
    index: int
    input_ids: List[int]
    loss_mask: List[int]
    prompt_len: Optional[int] = None  # --regenerate: tokens sent; the target writes the rest


# A byte that is not UTF-8, as errors="surrogateescape" decodes it; a lone surrogate a JSON string spells
# with \u escapes cannot be encoded either (the tokenizer's Rust side would raise on it)
_UNDECODED = re.compile("[\udc80-\udcff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def read_records(path: str) -> Iterator[Tuple[int, object]]:
    """(index, record) for each record; a line that is not valid UTF-8 or JSON yields a SkipSample as its
    record (record_place() names its line)."""
    if os.path.isfile(path):
        # Lines split as before (universal newlines); each line's bytes checked on their own: a strict decode
        # fails for the whole read-ahead chunk, and every later read of the file at the same place.
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for i, line in enumerate(f):
                yield i, _parse_line(line)
        return
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"--data: {path} is not a file (and the `datasets` library, needed for a "
                                f"Hugging Face dataset name, is not installed)") from None
    ds = datasets.load_dataset(path, split="train") if not os.path.isdir(path) else datasets.load_from_disk(path)
    for i, rec in enumerate(ds):
        yield i, rec


def record_place(path: str, index: int) -> str:
    """Where record `index` of `path` is, for a message: its line in a JSON Lines file, else its row."""
    return f"line {index + 1} of {path}" if os.path.isfile(path) else f"row {index} of {path}"


def _parse_line(line: str) -> object:
    """The record a line holds, or the SkipSample that says why it holds none."""
    if not line.strip():
        return SkipSample("empty-line")
    bad = _UNDECODED.search(line)
    if bad:
        byte = ord(bad.group()) - 0xDC00
        return SkipSample("invalid-utf8", f"byte 0x{byte:02x} at character {bad.start() + 1} is not UTF-8")
    try:
        return json.loads(line)
    except RecursionError:
        return SkipSample("too-deep", "nested deeper than the JSON decoder goes")
    except ValueError as e:
        return SkipSample("invalid-json", str(e))


def normalise_messages(record: dict) -> List[dict]:
    conv = record.get("conversations", record.get("messages"))
    if not isinstance(conv, list):
        raise SkipSample("wrong-type", "conversations/messages must be a list")
    out = []
    for m in conv:
        if not isinstance(m, dict):
            raise SkipSample("wrong-type", "a message must be an object")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise SkipSample("unknown-role", repr(role))
        if not isinstance(content, str):
            raise SkipSample("wrong-type", "message content must be a string")
        if _SURROGATE.search(content):
            raise SkipSample("invalid-unicode", "message content holds a lone surrogate (a \\ud800-\\udfff escape)")
        out.append({"role": ROLES[role.lower()], "content": content})
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        raise SkipSample("empty-conversation", "no assistant reply")
    return out


def _reply_spans(text: str, messages: List[dict]) -> List[Tuple[int, int]]:
    """Character spans of the assistant replies in the rendered text, found in order."""
    spans, cursor = [], 0
    for m in messages:
        if m["role"] != "assistant" or not m["content"]:
            continue
        for candidate in (m["content"], m["content"].split("</think>")[-1].strip()):
            pos = text.find(candidate, cursor) if candidate else -1
            if pos >= 0:
                spans.append((pos, pos + len(candidate)))
                cursor = pos + len(candidate)
                break
        else:
            raise SkipSample("reply-not-in-template", "an assistant reply is not in the rendered chat template")
    return spans


class Preparer:
    """Turns records into Samples for one tokenizer and server: `limits` is the server's RequestLimits
    (sglang_hs/extract/limits.py), or its context length (the scheduler's limit then follows from it)."""

    def __init__(self, tokenizer, limits, regenerate: bool = False, max_new_tokens: int = 0) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("the model's tokenizer has no fast (Rust) version: character offsets are needed for "
                             "loss masks")
        from sglang_hs.extract.limits import RequestLimits

        self.limits = limits if isinstance(limits, RequestLimits) else RequestLimits.of_context(int(limits))
        self.tok, self.regenerate, self.max_new = tokenizer, regenerate, max_new_tokens
        self.vocab_size = len(tokenizer)
        self.end_of_turn = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                        tokenizer.convert_tokens_to_ids("<|eot_id|>")) if isinstance(i, int)
                            and i != tokenizer.unk_token_id}

    def __call__(self, index: int, record) -> Sample:
        if isinstance(record, SkipSample):
            raise record
        if not isinstance(record, dict):
            raise SkipSample("wrong-type", "a record must be a JSON object")
        if "input_ids" in record:
            sample = self._pretokenized(index, record)
        elif "conversations" in record or "messages" in record:
            sample = self._conversation(index, normalise_messages(record))
        else:
            raise SkipSample("missing-fields", "neither conversations/messages nor input_ids")
        # the request sends input_ids with max_new_tokens 1 (--regenerate: the prompt and max_new_tokens)
        why = self.limits.refusal(len(sample.input_ids), self.max_new if self.regenerate else 1)
        if why is not None:
            raise SkipSample("too-long", why)
        return sample

    def _pretokenized(self, index: int, record: dict) -> Sample:
        ids, mask = record["input_ids"], record.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise SkipSample("wrong-type", "input_ids must be a list of integers")
        if not ids:
            raise SkipSample("empty-input")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise SkipSample("token-out-of-vocab", f"ids must be in [0, {self.vocab_size})")
        if mask is None:
            mask = [1] * len(ids)
        elif not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise SkipSample("bad-loss-mask", "loss_mask must be a list of 0/1 as long as input_ids")
        if self.regenerate:
            raise SkipSample("no-conversation", "--regenerate needs conversations, not input_ids")
        return Sample(index, list(ids), [int(m) for m in mask])

    def _render(self, messages: List[dict], **kwargs) -> str:
        """The conversation as the model's chat template writes it. The template is code that runs on the
        record: what it raises for one record (a `raise_exception("roles must alternate")`, a TypeError on
        an odd message) skips that record; a template that cannot compile, or none, is the model's fault."""
        from jinja2 import TemplateSyntaxError

        if getattr(self.tok, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template: give records as input_ids (+ loss_mask)")
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, **kwargs)
        except TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not compile: {e}") from None
        except Exception as e:  # noqa: BLE001 - anything the template raises for this record's messages
            raise SkipSample("chat-template-error", f"{type(e).__name__}: {e}") from None

    def _conversation(self, index: int, messages: List[dict]) -> Sample:
        if self.regenerate:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = messages[:last]
            if not prompt:
                raise SkipSample("empty-conversation", "no prompt before the assistant reply")
            text = self._render(prompt, add_generation_prompt=True)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            return Sample(index, ids, [0] * len(ids), prompt_len=len(ids))
        text = self._render(messages)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        spans = _reply_spans(text, messages)
        mask, j = [0] * len(ids), 0
        for t, (s, e) in enumerate(offsets):
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            if j < len(spans) and s < spans[j][1] and e > spans[j][0] and e > s:
                mask[t] = 1
        for t in range(1, len(ids)):  # the end-of-turn token that closes a reply learns to stop
            if mask[t - 1] == 1 and mask[t] == 0 and ids[t] in self.end_of_turn:
                mask[t] = 1
        if not any(mask):
            raise SkipSample("empty-conversation", "no assistant token")
        return Sample(index, ids, mask)
