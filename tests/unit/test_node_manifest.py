"""SGLang --nnodes: each node's dump dir describes the writers on that node (capture_spec.node_dp_ranks) and
the DP ranks they serve; a reader of it covers exactly those ranks and says so. Writers are real
CaptureWriters on temporary dirs, one dir per node, as two machines would have."""
import os

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec, node_dp_ranks  # noqa: E402
from sglang_hs.reader import HiddenStateReader, coverage  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

SPEC = CaptureSpec.resolve([1], True, 4, 16)


@pytest.mark.parametrize("tp, dp, nnodes, by_node", [
    (2, 2, 2, [[0], [1]]),  # one DP attention group per node
    (2, 1, 2, [[0], []]),  # TP over two nodes: the one writer, TP rank 0, is on node 0
    (16, 16, 2, [list(range(8)), list(range(8, 16))]),
    (16, 2, 4, [[0], [], [1], []]),  # a group spans two nodes: its attention-TP rank 0 is on the first
    (8, 4, 1, [[0, 1, 2, 3]]),
])
def test_node_dp_ranks_follow_sglangs_rank_layout(tp, dp, nnodes, by_node):
    from sglang.srt.layers.dp_attention import compute_dp_attention_world_info

    assert [node_dp_ranks(tp, dp, nnodes, r) for r in range(nnodes)] == by_node
    # the same as SGLang's own placement: node r runs TP ranks [r*tp/nnodes, (r+1)*tp/nnodes), a group's writer
    # is its attention-TP rank 0
    for r in range(nnodes):
        mine = []
        for tp_rank in range(r * tp // nnodes, (r + 1) * tp // nnodes):
            attn_tp_rank, _, attn_dp_rank, _ = compute_dp_attention_world_info(tp_rank, tp, dp, 1)
            if attn_tp_rank == 0:
                mine.append(attn_dp_rank)
        assert mine == by_node[r]


def _writer(path, dp_rank, node_ranks, node, dp_size=2, nnodes=2):
    os.makedirs(path, exist_ok=True)
    return CaptureWriter(str(path), SPEC, 8, torch.float32, 1 << 16, writer_id=dp_rank,
                         node={"dp_ranks": node_ranks, "dp_size": dp_size, "nnodes": nnodes, "node_rank": node})


def test_each_node_dump_is_read_alone_and_names_its_dp_ranks(tmp_path):
    """Two nodes, one DP group each: each node's reader opens at once (wait=0: it waits for no writer of the
    other node), covers its rank, and a record it reads carries that rank. Before: each manifest announced
    the 2 writers of the server and held 1, and every reader refused both dumps."""
    writers = [_writer(tmp_path / f"node{r}", r, [r], r) for r in (0, 1)]
    for r, w in enumerate(writers):
        w.ring.publish(f"req-{r}", torch.arange(3, dtype=torch.int32), torch.full((3, SPEC.rows_per_token, 16), float(r)))
    for r in (0, 1):
        with HiddenStateReader(str(tmp_path / f"node{r}"), wait=0) as reader:
            assert reader.dp_ranks == [r]
            assert coverage(reader.manifest) == f"DP ranks [{r}] of 2 (node {r} of 2)"
            rec = reader.take(f"req-{r}", timeout=5)
            assert rec.dp_rank == r and float(rec.aux_hidden_states[0, 0, 0]) == r
            assert f"req-{1 - r}" not in reader.ready_rids()


def test_a_node_with_two_groups_waits_for_both_and_names_the_missing_rank(tmp_path):
    """Node 1 of 2 serving DP ranks 2 and 3 of 4: its manifest announces 2 writers; with only rank 2's
    there, the reader's error names the ranks it has and the node's."""
    _writer(tmp_path, 2, [2, 3], 1, dp_size=4)
    with pytest.raises(FileNotFoundError) as e:
        HiddenStateReader(str(tmp_path), wait=0.2)
    assert "1 of the 2 writers it announces" in str(e.value) and "DP ranks [2] of this node's [2, 3]" in str(e.value)
    _writer(tmp_path, 3, [2, 3], 1, dp_size=4)
    with HiddenStateReader(str(tmp_path), wait=0) as reader:
        assert reader.dp_ranks == [2, 3]
        assert coverage(reader.manifest) == "DP ranks [2, 3] of 4 (node 1 of 2)"


def test_a_writer_outside_its_nodes_ranks_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"writer of DP rank 1 on node 0, whose writers serve DP ranks \[0\]"):
        _writer(tmp_path, 1, [0], 0)


class _Reader:
    def __init__(self, ranks, dp_size, node, nnodes):
        self.dp_ranks = ranks
        self.manifest = {"writers": [{"id": r, "dp_rank": r} for r in ranks], "dp_size": dp_size, "nnodes": nnodes,
                         "node_rank": node}


@pytest.mark.parametrize("shard", [None, "0/1", "1/3"])
def test_extraction_per_node_splits_and_routes_deterministically(shard):
    """The extraction CLI against one node of 2 (DP ranks [0, 1] and [2, 3] of 4): without --shard, node r
    takes the samples whose index modulo 4 is one of its ranks and routes each to that rank; the nodes'
    selections are disjoint and cover every sample. With --shard, that selection, routed to the node's
    ranks in turn. Against a dump covering every rank, nothing is routed."""
    from sglang_hs.extract import cli

    taken = []
    for node, ranks in enumerate(([0, 1], [2, 3])):
        ns, _ = cli.parse_args(["--data", "x", "--output", "y", *(["--shard", shard] if shard else [])])
        cli.node_route(ns, _Reader(ranks, 4, node, 2))
        mine = [i for i in range(40) if cli.selected(ns, i)]
        routes = [cli.routed_dp_rank(ns, i) for i in mine]
        assert set(routes) <= set(ranks) and len(set(routes)) == 2
        if shard in (None, "0/1"):  # 0/1 written out is the default: the node split, not every sample per node
            assert ns.shard == f"DP ranks {ranks} of 4 (node {node} of 2)"
            assert mine == [i for i in range(40) if i % 4 in ranks] and routes == [i % 4 for i in mine]
        else:
            assert mine == [i for i in range(40) if i % 3 == 1]
        taken.append(mine)
    if shard in (None, "0/1"):
        assert sorted(taken[0] + taken[1]) == list(range(40))
    ns, _ = cli.parse_args(["--data", "x", "--output", "y"])
    cli.node_route(ns, _Reader([0, 1], 2, 0, 1))
    assert ns.route is None and ns.shard == "0/1" and cli.routed_dp_rank(ns, 3) is None
    assert all(cli.selected(ns, i) for i in range(10))


# -- a node hosting no writer (--tp over nodes without DP attention): its launcher marks its dump dir --

@pytest.mark.parametrize("argv, marker", [
    (["--tp", "2", "--nnodes", "2", "--node-rank", "1"],
     {"nnodes": 2, "node_rank": 1, "layout": "--tp 2 over 2 nodes", "writer_nodes": [0]}),
    (["--tp-size=16", "--dp", "2", "--enable-dp-attention", "--nnodes", "4", "--node-rank", "3"],
     {"nnodes": 4, "node_rank": 3, "layout": "--tp 16 --dp 2 --enable-dp-attention over 4 nodes",
      "writer_nodes": [0, 2]}),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "0"], None),  # node 0 hosts TP rank 0's writer
    (["--tp", "2", "--dp", "2", "--enable-dp-attention", "--nnodes", "2", "--node-rank", "1"], None),
    (["--tp", "2"], None),
])
def test_the_launcher_knows_which_nodes_host_no_writer(argv, marker):
    from sglang_hs.tools.launch_server import node_without_writers

    assert node_without_writers(argv) == marker


def _mark(path, argv):
    from sglang_hs.tools.launch_server import mark_node_writers

    os.makedirs(path, exist_ok=True)
    mark_node_writers(str(path), argv, None)


def test_a_reader_of_a_node_without_writers_fails_at_once_naming_node_0(tmp_path):
    """Node 1 of `--tp 2 --nnodes 2`: no manifest will ever come; a reader fails at once (wait=3600) in one
    line naming the dir and node 0, also over a stale manifest of an earlier server there. Before: it waited
    `wait` seconds for a manifest, then said no server was capturing there."""
    from sglang_hs.reader import NoWriterHere

    _writer(tmp_path, 0, [0], 0, dp_size=1)  # an earlier server's manifest and ring, left in the dir
    _mark(tmp_path, ["--tp", "2", "--nnodes", "2", "--node-rank", "1"])
    assert oct(os.stat(tmp_path / "no-writer.json").st_mode & 0o777) == "0o600"
    with pytest.raises(NoWriterHere) as e:
        HiddenStateReader(str(tmp_path), wait=3600)
    assert str(e.value) == (f"{tmp_path}: this node hosts no writer (node 1 of 2, --tp 2 over 2 nodes): records of "
                            "this server land in node 0's dump; read them there")
    assert isinstance(e.value, FileNotFoundError)  # what a missing manifest raised: callers' handling holds


def test_a_node_hosting_a_writer_again_drops_the_mark(tmp_path):
    _mark(tmp_path, ["--tp", "2", "--nnodes", "2", "--node-rank", "1"])
    _mark(tmp_path, ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--nnodes", "2", "--node-rank", "1"])
    assert not (tmp_path / "no-writer.json").exists()
    _writer(tmp_path, 1, [1], 1)
    with HiddenStateReader(str(tmp_path), wait=0) as reader:
        assert reader.dp_ranks == [1]


@pytest.mark.parametrize("how", ["harvest", "extract", "live"])
def test_the_harvester_extraction_cli_and_live_dataset_on_a_node_without_writers_fail_in_one_line(tmp_path, how):
    import json
    import subprocess
    import sys

    dump = tmp_path / "dump"
    _mark(dump, ["--tp", "2", "--nnodes", "2", "--node-rank", "1"])
    why = f"{dump}: this node hosts no writer (node 1 of 2, --tp 2 over 2 nodes): records of this server land in " \
          "node 0's dump; read them there"
    if how == "live":
        from sglang_hs.live import LiveHiddenStates
        from sglang_hs.live_workers import LiveDatasetError

        with pytest.raises(LiveDatasetError) as e:
            next(iter(LiveHiddenStates([[1, 2, 3]], "http://127.0.0.1:9", str(dump))))
        assert str(e.value) == f"LiveHiddenStates: {why}"
        return
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    args = ["--from-dump", str(dump)] if how == "harvest" else \
        ["--data", str(data), "--server", "http://127.0.0.1:9", "--hs-dump-dir", str(dump)]
    proc = subprocess.run([sys.executable, "-m", "sglang_hs.extract", "--no-progress", *args, "--output",
                           str(tmp_path / "out"), "--format", "specforge"], capture_output=True, text=True, timeout=300)
    flag = "--from-dump" if how == "harvest" else "--hs-dump-dir"
    assert proc.returncode != 0 and f"error: {flag}: {why}\n" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
