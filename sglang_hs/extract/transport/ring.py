"""The node-local ring: the records of the server's writers on this node, read from the shared-memory rings
in its --hs-dump-dir by sglang_hs.HiddenStateReader (which is the transport: transport/base.py), opened the
way each run needs it, its refusals one line naming the flag."""
from __future__ import annotations

import os
from typing import Optional

from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.transport.base import Transport


class RingTransport:
    name = "ring"

    @staticmethod
    def for_requests(dump_dir: str, owner: Optional[int], part_bytes: Optional[int] = None) -> Transport:
        """The --data run's reader of `dump_dir` (--hs-dump-dir): zero-copy, a record goes from the ring
        straight into its file and is acked once the file is in place; one of more than `part_bytes` row bytes
        (--part-mb) a chunk at a time (HiddenStateReader.chunks; one the server publishes in parts is streamed,
        each part given back as soon as it is written)."""
        from sglang_hs.reader import HiddenStateReader, NoWriterHere

        try:
            return HiddenStateReader(dump_dir, wait=30, recycle_memory=True, owner=owner, ack=True, zero_copy=True,
                                     part_bytes=part_bytes)
        except (RuntimeError, NoWriterHere) as e:  # another reader holds the dump dir; a node without writers
            raise ExtractError(f"--hs-dump-dir: {e}") from None

    @staticmethod
    def for_harvest(dump_dir: str, owner: Optional[int], part_bytes: Optional[int] = None) -> Transport:
        """The harvest's reader of `dump_dir` (--from-dump): acked once each file is journaled, following a
        restarted server to its new ring; a record of more than `part_bytes` row bytes is not copied but
        written from the ring a chunk at a time (streamed as its parts arrive when the server publishes it in
        parts)."""
        from sglang_hs.reader import MANIFEST, HiddenStateReader, no_writer_here

        dump = os.path.abspath(dump_dir)
        if not os.path.isdir(dump):
            raise ExtractError(f"--from-dump: {dump} is not a folder")
        why = no_writer_here(dump)  # a node of a multi-node server hosting no writer: nothing to harvest here
        if why is not None:
            raise ExtractError(f"--from-dump: {why}")
        if not os.path.exists(os.path.join(dump, MANIFEST)):
            raise ExtractError(f"--from-dump: {dump} holds no {MANIFEST} (is a server running with --hs-dump-dir "
                               f"{dump}?)")
        try:
            return HiddenStateReader(dump, wait=5, ack=True, recycle_memory=True, owner=owner, reattach=True,
                                     part_bytes=part_bytes)
        except (RuntimeError, ValueError, OSError) as e:  # another reader, another format, permissions
            raise ExtractError(f"--from-dump: {e}") from None
