"""Multi-node serving with SGLang's own --nnodes: two launchers on this machine as node ranks 0 and 1.

Each "node" has its own dump dir, as two machines would (shared memory does not cross machines), and they
meet at a loopback --dist-init-addr. Two float32 pairs, one after the other: `--tp 2 --dp 2
--enable-dp-attention` across the two nodes, one DP attention group per node (the usual multi-node
DeepSeek deployment), then `--tp 2` across them (its one writer on node 0). Each node's
manifest lists the writers on that node and the DP ranks they serve; a request routed with SGLang's
`routed_dp_rank` to a group has its record in that group's node's dump, read there, and every row is
judged against HF transformers float32 with the exact oracle (row_judge, as test_multi_rank.py).

On one machine node 1 would refuse to start: SGLang pre-checks that the DP-attention ports derived from
--dist-init-addr are free on its own host, and node 0 holds them. The test-only switch
SGLANG_HS_TEST_SAME_HOST_NODES (honoured with SGLANG_HS_TESTING=1) skips that check on node 1; on two
machines the ports are free there and nothing is skipped.
"""
import json
import os
import signal
import threading
import time

import pytest

import row_judge
from conftest import CHUNK
from helpers import Launcher, free_port, leftover_server_processes, server_session
from sglang_hs import HiddenStateReader
from sglang_hs.overlay_status import FLUSH_INTERVAL_S
from sglang_hs.reader import coverage

pytestmark = pytest.mark.e2e
LAYERS, N_LAYERS = [2, 4, 5], 8
GREEDY = {"temperature": 0}
SAME_HOST = {"SGLANG_HS_TESTING": "1", "SGLANG_HS_TEST_SAME_HOST_NODES": "1"}
TEXTS = ["Speculative decoding makes generation faster without changing its result, because the target checks "
         "every token the draft proposes.",
         "A draft model proposes several tokens ahead; the target accepts those it agrees with."]


def _nodes(tmp_path_factory, name, parallel):
    """Two launchers, node ranks 0 and 1 of `parallel` + --nnodes 2, each with its own dump dir and --port
    (node 1 serves SGLang's health check there, no requests) and a loopback --dist-init-addr."""
    dist = free_port()
    bind = os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)  # the launcher chooses it
    nodes = []
    try:
        for rank in (0, 1):
            dump = tmp_path_factory.mktemp(f"hs-{name}-node{rank}") / "dump"
            node = Launcher(["--hs-dump-dir", str(dump), "--hs-ring-size", "64MiB", "--dtype", "float32", *parallel,
                             "--hs-last", "--chunked-prefill-size", str(CHUNK), "--nnodes", "2", "--node-rank",
                             str(rank), "--dist-init-addr", f"127.0.0.1:{dist}"], env=SAME_HOST)
            node.dump = dump
            nodes.append(node)
    finally:
        if bind is not None:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind
    return nodes


def _stop(nodes):
    for node in nodes:  # both at once: a node whose peer went away first may also stop by itself
        if node.proc.poll() is None:
            node.proc.send_signal(15)
    for node in nodes:
        node.stop()
        assert not leftover_server_processes(node.output), node.tail()
        if node.proc.returncode != -signal.SIGKILL:  # a launcher killed with its node cannot clean up
            assert not list(node.dump.glob("store-*.bin")), node.tail()


@pytest.fixture(scope="module")
def dp_nodes(tmp_path_factory):
    """([node 0, node 1], [reader of node 0's dump, reader of node 1's dump]) of `--tp 2 --dp 2
    --enable-dp-attention` over two nodes: one DP attention group per node."""
    nodes = _nodes(tmp_path_factory, "dp", ["--tp", "2", "--dp", "2", "--enable-dp-attention"])
    readers = []
    try:
        for node in (nodes[1], nodes[0]):  # node 0 is ready once node 1's schedulers are
            node.wait_ready(timeout=1500)
        readers = [HiddenStateReader(str(node.dump)) for node in nodes]
        yield nodes, readers
    finally:
        for reader in readers:
            reader.close()
        _stop(nodes)


def test_each_node_describes_its_own_writers(dp_nodes):
    """Node i's manifest lists one writer, serving DP rank i of 2, and says it is node i of 2; a reader of
    it says which DP ranks it covers (the issue: both announced 2 writers and held 1, readers refused)."""
    nodes, readers = dp_nodes
    for rank, (node, reader) in enumerate(zip(nodes, readers)):
        m = reader.manifest
        assert [w["dp_rank"] for w in m["writers"]] == [rank] and [w["id"] for w in m["writers"]] == [rank], m
        assert (m["dp_ranks"], m["dp_size"], m["nnodes"], m["node_rank"]) == ([rank], 2, 2, rank), m
        assert "num_writers" not in m  # one writer on this node: nothing to wait for
        assert reader.dp_ranks == [rank]
        assert coverage(m) == f"DP ranks [{rank}] of 2 (node {rank} of 2)"
        assert sorted(p.name for p in node.dump.glob("ring-*.bin")) == [f"ring-w{rank}.bin"]
    assert "server ready: node 1 (no HTTP server on this node" in nodes[1].output, nodes[1].tail()


def test_requests_routed_to_both_nodes_are_read_on_their_node(dp_nodes, hf):
    """Requests routed with routed_dp_rank to DP rank 0 and 1 (a prompt over chunk boundaries, decode
    steps): each record is read from the dump of the node serving that rank, every row exact against HF;
    the other node's reader has no record of it."""
    nodes, readers = dp_nodes
    worst = 0.0
    for i, text in enumerate(TEXTS * 2):
        dp = i % 2
        ids = row_judge.prompt_ids(hf, text)[: 20 + 7 * i]
        rid = f"node-dp{dp}-{i}"
        out = nodes[0].generate(input_ids=ids, rid=rid, routed_dp_rank=dp,
                                sampling_params={"max_new_tokens": 3 + i, **GREEDY})
        rec = readers[dp].take(rid, timeout=300)
        assert rec.dp_rank == dp
        worst = max(worst, row_judge.assert_exact(rec, hf, (ids + out["output_ids"])[:-1], LAYERS, N_LAYERS, 256))
        other = readers[1 - dp]
        other.poll()
        assert rid not in other._ready and not other.not_captured(rid)
    print(f"two nodes, DP attention: 4 records routed to both nodes, worst row {worst:.2e} (tolerance {row_judge.TOL})")


def test_extraction_once_per_node_merges_into_every_sample(dp_nodes, hf, tmp_path):
    """The extraction CLI run once per node, the same command but for the node's dump dir, against node 0's
    HTTP entry point: each run takes the samples of its node's DP rank (index modulo 2, no --shard given),
    routes them there (routed_dp_rank) and writes them from its node's dump; the two outputs' rows_* folders
    merge into one file per sample, every row within one bf16 rounding of HF's float32 row (--format
    specforge is bf16). Closes the module's readers (one reader per dump dir): keep it last."""
    import shutil
    import subprocess
    import sys

    import specforge_way

    nodes, readers = dp_nodes
    for reader in readers:
        reader.close()
    samples = [[5 + (7 * j + 13 * i) % 900 for j in range(9 + 5 * i)] for i in range(6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in samples))
    merged = tmp_path / "merged"
    for rank, node in enumerate(nodes):
        out = tmp_path / f"node{rank}"
        proc = subprocess.run([sys.executable, "-m", "sglang_hs.extract", "--no-progress", "--data", str(data),
                               "--output", str(out), "--format", "specforge", "--server", nodes[0].url,
                               "--hs-dump-dir", str(node.dump)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"DP ranks [{rank}] of 2 (node {rank} of 2) captured on this node" in proc.stderr, proc.stderr[-2000:]
        m = json.load(open(out / "manifest.json"))
        assert m["samples_written"] == 3 and m["shard"] == f"DP ranks [{rank}] of 2 (node {rank} of 2)", m
        assert sorted(p.name for p in out.glob("rows_*/*.ckpt")) == [f"data_{i}.ckpt" for i in range(rank, 6, 2)]
        for folder in out.glob("rows_*"):
            shutil.copytree(folder, merged / folder.name, dirs_exist_ok=True)
    assert sorted(p.name for p in merged.glob("rows_*/*.ckpt")) == [f"data_{i}.ckpt" for i in range(6)]
    worst = 0.0
    for i, ids in enumerate(samples):
        s = specforge_way.load_sample(str(merged / "rows_0-2000" / f"data_{i}.ckpt"))
        assert s["input_ids"][0].tolist() == ids
        hs = hf(ids)
        aux = s["hidden_state"][0].view(len(ids), len(LAYERS), -1)
        for got, ref in [(aux[:, k], hs[lid]) for k, lid in enumerate(LAYERS)] + [(s["target"][0], hs[N_LAYERS])]:
            err = row_judge.rel(got, ref)
            worst = max(worst, err.max().item())
            assert (err <= row_judge.BF16_TOL).all(), (i, err.max().item())
    print(f"two nodes, one extraction per node: 6 samples merged, worst row {worst:.2e} (bf16 files, "
          f"tolerance {row_judge.BF16_TOL})")


def _decode_steps(dump, pid):
    try:
        return json.load(open(dump / f"overlay-{pid}.json"))["forwards"].get("DECODE", 0)
    except (OSError, ValueError):
        return 0


def test_node_1_lost_mid_generation_node_0_reports_it(dp_nodes):
    """Node 1 lost (its launcher and every server process SIGKILLed, as a machine going down) while node 0
    decodes a request routed to its own DP rank: node 0's launcher reports the server's exit and exits
    non-zero, the client gets an error, no record of the request (torn or whole) is emitted, nothing is
    left running. Ends the module's pair: keep it last."""
    nodes, _ = dp_nodes
    reader = HiddenStateReader(str(nodes[0].dump))
    try:
        writer = reader.manifest["writers"][0]["pid"]
        before = _decode_steps(nodes[0].dump, writer)
        errors = []

        def long_request():
            try:
                nodes[0].generate(input_ids=list(range(5, 45)), rid="node-lost", routed_dp_rank=0,
                                  sampling_params={"max_new_tokens": 3000, "ignore_eos": True})
            except Exception as e:  # the server dies under it
                errors.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 300
        while _decode_steps(nodes[0].dump, writer) < before + 8:  # node 0 is decoding it
            assert time.monotonic() < deadline and t.is_alive(), nodes[0].tail()
            time.sleep(FLUSH_INTERVAL_S)
        session = server_session(nodes[1].output)
        nodes[1].proc.kill()
        os.killpg(session, signal.SIGKILL)
        rc = nodes[0].wait_exit(timeout=600)
        t.join(120)
        assert rc != 0, nodes[0].tail()
        assert "[sglang-hs] server exited with status" in nodes[0].output, nodes[0].tail()
        assert errors
        assert reader.poll() == 0 and "node-lost" not in reader.ready_rids() and not reader.not_captured("node-lost")
        assert not leftover_server_processes(nodes[0].output)
    finally:
        reader.close()


# -- tensor parallel across the two nodes: `--tp 2 --nnodes 2`, TP rank 0 on node 0, rank 1 on node 1 --

@pytest.fixture(scope="module")
def tp_nodes(tmp_path_factory):
    """([node 0, node 1], reader of node 0's dump) of `--tp 2` over two nodes. Comes after the DP pair's
    tests (the last of which ends that pair): one pair runs at a time."""
    nodes = _nodes(tmp_path_factory, "tp", ["--tp", "2"])
    reader = None
    try:
        for node in (nodes[1], nodes[0]):
            node.wait_ready(timeout=1500)
        reader = HiddenStateReader(str(nodes[0].dump))
        yield nodes, reader
    finally:
        if reader is not None:
            reader.close()
        _stop(nodes)


def test_tp_across_nodes_writes_on_node_0_only_and_rows_are_exact(tp_nodes, hf):
    """The one writer is TP rank 0, on node 0: its manifest says DP rank [0] of 1 on node 0 of 2, node 1's
    dump dir holds no manifest, store or ring. Requests over chunk boundaries with decode steps: every row
    exact against HF."""
    nodes, reader = tp_nodes
    m = reader.manifest
    assert [w["dp_rank"] for w in m["writers"]] == [0] and (m["dp_size"], m["nnodes"], m["node_rank"]) == (1, 2, 0)
    assert coverage(m) == "DP ranks [0] of 1 (node 0 of 2)"
    assert not list(nodes[1].dump.glob("manifest.json")) and not list(nodes[1].dump.glob("*.bin")), \
        list(nodes[1].dump.iterdir())
    worst = 0.0
    for i, text in enumerate(TEXTS):
        ids = row_judge.prompt_ids(hf, text)[: 20 + 9 * i]
        out = nodes[0].generate(input_ids=ids, rid=f"tpn-{i}", sampling_params={"max_new_tokens": 4 + i, **GREEDY})
        rec = reader.take(f"tpn-{i}", timeout=300)
        worst = max(worst, row_judge.assert_exact(rec, hf, (ids + out["output_ids"])[:-1], LAYERS, N_LAYERS, 256))
    print(f"two nodes, --tp 2: 2 records, worst row {worst:.2e} (tolerance {row_judge.TOL})")
