"""What served the captured traffic, for the manifest (`served`): the target, the speculative draft and how it
drafted, and the chat template, each named and hashed so a trainer can tell runs apart, filter or weight
by them, and compare a later draft with the one that served.

A model is its path (or hub id), the revision it was asked at and the SHA-256 of its config file
(config.json, or Mistral's params.json) where the scheduler can read it: a local folder, or the hub's
local cache (`huggingface_hub.try_to_load_from_cache`; never a download). The chat template is the one
SGLang applies: `--chat-template` (a file: its bytes; a built-in template: its name) or else the
tokenizer's own (chat_template.jinja, else tokenizer_config.json's `chat_template`), hashed the same way;
None where none is found. Nothing here fails a server: what cannot be read is None."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

CONFIG_FILES = ("config.json", "params.json")


def local_file(repo: str, name: str, revision: Optional[str]) -> Optional[str]:
    if os.path.isdir(repo):
        path = os.path.join(repo, name)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, name, revision=revision)
    except Exception:  # not a hub id, or no cache: nothing to hash
        return None
    return found if isinstance(found, str) else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Optional[str]) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return _sha256(f.read())
    except (OSError, TypeError):
        return None


def model_identity(path: Optional[str], revision: Optional[str] = None) -> Optional[dict]:
    """{"path", "revision", "config_sha256"} of a model, or None without a path."""
    if not path:
        return None
    digest = None
    for name in CONFIG_FILES:
        digest = _file_sha256(local_file(path, name, revision))
        if digest is not None:
            break
    return {"path": path, "revision": revision, "config_sha256": digest}


def chat_template_sha256(chat_template: Optional[str], tokenizer_path: Optional[str],
                         revision: Optional[str] = None) -> Optional[str]:
    """SHA-256 of the chat template SGLang applies (see the module's doc), or None."""
    if chat_template:
        if os.path.isfile(chat_template):
            return _file_sha256(chat_template)
        return _sha256(f"sglang-template:{chat_template}".encode())  # one of SGLang's built-in templates, by name
    if not tokenizer_path:
        return None
    digest = _file_sha256(local_file(tokenizer_path, "chat_template.jinja", revision))
    if digest is not None:
        return digest
    try:
        with open(local_file(tokenizer_path, "tokenizer_config.json", revision) or "", encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, str):
        return _sha256(template.encode())
    if template:  # named templates: [{"name": ..., "template": ...}, ...]
        return _sha256(json.dumps(template, sort_keys=True).encode())
    return None


class resolved_args:
    """`server_args`' fields as SGLang resolved them in this (scheduler) process: the runtime context's published
    `spec` and `model` namespaces first (resolution puts an MTP draft's path there: the target's own), then the
    flags themselves; None for what neither has."""

    BAGS = ("spec", "model")

    def __init__(self, server_args) -> None:
        self._args = server_args

    def __getattr__(self, name: str):
        try:
            from sglang.srt.runtime_context import get_context

            context = get_context()
        except Exception:  # no SGLang runtime context here (a unit test): the flags alone
            context = None
        for bag in self.BAGS if context is not None else ():
            try:
                return getattr(context.config_bag(bag), name)
            except (ValueError, AttributeError):  # not published here, or not a field of it
                continue
        return getattr(self._args, name, None)


def served_identity(server_args) -> dict:
    """The manifest's `served`: {"target", "draft", "speculative", "chat_template_sha256"} of a server."""
    get = lambda name: getattr(server_args, name, None)  # noqa: E731
    algorithm = get("speculative_algorithm")
    speculative = None
    if algorithm:
        speculative = {"algorithm": str(algorithm), "num_steps": get("speculative_num_steps"),
                       "eagle_topk": get("speculative_eagle_topk"), "num_draft_tokens": get("speculative_num_draft_tokens")}
    return {
        "target": model_identity(get("model_path"), get("revision")),
        "draft": model_identity(get("speculative_draft_model_path"), get("speculative_draft_model_revision"))
        if algorithm else None,
        "speculative": speculative,
        "chat_template_sha256": chat_template_sha256(get("chat_template"), get("tokenizer_path") or get("model_path"),
                                                     get("revision")),
    }
