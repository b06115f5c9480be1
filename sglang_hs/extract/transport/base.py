"""The transport interface: how a run gets the records the server captured, whatever carries them.

A transport hands out records (sglang_hs.reader.HiddenStateRecord: rid, input_ids, aux_hidden_states, the
final states, prompt_len, ring_id, seq) and takes each back with ack() once its file is in place; until then
a record's bytes are the transport's (zero-copy: views of them). The extraction matches records to the
requests it sent by rid (poll, pop_ready, not_captured, discard); a harvest takes them in order (next).
sglang_hs.HiddenStateReader implements it over the node-local ring (transport/ring.py) as it is.
"""
from __future__ import annotations

from typing import List, Optional, Protocol, runtime_checkable


@runtime_checkable
class Transport(Protocol):
    manifest: dict  # the capture's: model, layer ids, final states, the writers and their DP ranks
    dump_dir: str  # where the capture's status is read (sglang_hs.status), and what errors name
    markers: int  # requests the server served without capture, seen so far
    restarts: int  # new server generations followed (a harvest's transport follows a restarted server)

    def poll(self) -> int:
        """Take what has arrived; returns how many records."""

    def pop_ready(self, rid: str):
        """The record of request `rid` if it arrived, else None."""

    def ready_rids(self) -> List[str]:
        """The rids whose records arrived and were not taken."""

    def not_captured(self, rid: str) -> Optional[str]:
        """Why request `rid` was served without capture (its marker arrived), else None."""

    def discard(self, rid: str) -> int:
        """Drop every record (and marker) of `rid` that arrived, giving its bytes back."""

    def next(self, timeout: Optional[float] = None):
        """The next record in arrival order (TimeoutError after `timeout` seconds without one)."""

    def ack(self, record) -> None:
        """Done with `record`: its bytes go back to the server."""

    def intact(self, record) -> bool:
        """Whether a zero-copy record's bytes are still its own (nobody gave them back meanwhile)."""

    def unread_bytes(self) -> int:
        """How far this reader lags the server (bytes published and not read)."""

    def close(self) -> None:
        """Let go of the transport (the records not acked stay for the next reader)."""
