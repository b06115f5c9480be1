"""Which samples of --data a run takes, and which DP rank each is sent to.

--shard I/N takes the samples whose index is I modulo N. Against one node of a multi-node server (SGLang
--nnodes: each node's dump holds the records of the DP attention groups on that node), every request is
routed (routed_dp_rank) to a DP rank this node's reader covers, and, unless --shard was given, the node takes
the samples whose index modulo the DP size is one of its ranks: one run per node, the same command
everywhere, the shards merge by sample index. That half is settled once the node's manifest is read
(split_by_node): the one part of the configuration that changes after the command line is parsed.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple

from sglang_hs.extract.errors import PROG, ExtractError


class Selection:
    def __init__(self, shard: str = "0/1", given: bool = False) -> None:
        try:
            i, n = (int(x) for x in shard.split("/"))
            assert n >= 1 and 0 <= i < n
        except (ValueError, AssertionError):
            raise ExtractError(f"--shard: {shard!r} is not I/N with 0 <= I < N") from None
        self.shard_index, self.shard_count, self.shard_given = i, n, given
        self.label = shard  # what manifest.json records as the shard (the node's DP ranks after split_by_node)
        self.route: Optional[Tuple[List[int], int]] = None  # (this node's DP ranks, the DP size), when one node's

    def split_by_node(self, manifest: dict) -> None:
        """The node split of a dump that is one node's of several (a no-op for a dump covering every DP rank:
        SGLang's own balancing)."""
        from sglang_hs.reader import coverage, node_share

        share = node_share(manifest)
        if share is None:
            return
        self.route = share
        ranks, dp_size = share
        if not self.shard_given:
            self.label = f"DP ranks {ranks} of {dp_size} (node {manifest.get('node_rank')} of {manifest.get('nnodes')})"
        print(f"{PROG}: {coverage(manifest)} captured on this node: requests go to those ranks (routed_dp_rank)"
              + ("" if self.shard_given else ", and this run takes the samples whose index modulo "
                 f"{dp_size} is one of them"), file=sys.stderr)

    def takes(self, index: int) -> bool:
        if index % self.shard_count != self.shard_index:
            return False
        return self.route is None or self.shard_given or index % self.route[1] in self.route[0]

    def routed_rank(self, index: int) -> Optional[int]:
        """The DP rank sample `index` is sent to (None: SGLang chooses): with the node split its own rank,
        with --shard one of this node's ranks in turn."""
        if self.route is None:
            return None
        ranks, dp_size = self.route
        return index % dp_size if index % dp_size in ranks else ranks[(index // self.shard_count) % len(ranks)]
