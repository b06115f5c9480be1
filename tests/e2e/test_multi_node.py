"""Multi-node serving with SGLang's own --nnodes: two launchers on this machine as node ranks 0 and 1.

Each "node" has its own dump dir, as two machines would (shared memory does not cross machines), and they
meet at a loopback --dist-init-addr. Two float32 pairs, one after the other: `--tp 2 --dp 2
--enable-dp-attention` across the two nodes, one DP attention group per node (the usual multi-node
DeepSeek deployment), then `--tp 2` across them (its one writer on node 0). Each node's
manifest lists the writers on that node and the DP ranks they serve; a request routed with SGLang's
`routed_dp_rank` to a group has its record in that group's node's dump, read there, and every row is
judged against HF transformers float32 with the exact oracle (row_judge, as test_multi_rank.py).
Each pair ends with a node going away: the DP pair loses node 0 (node 1 reports it, its dump stays whole),
the TP pair has node 1 stopped alone (it stops at once; node 0 reports it). Keep the order of the tests.

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
from helpers import (Launcher, assert_connection_lost, free_port, leftover_server_processes, server_session, settled,
                     until_decoding)
from sglang_hs import HiddenStateReader
from sglang_hs.reader import NoWriterHere, coverage
from sglang_hs.tools.supervisor import EXIT_NODE0_LOST

pytestmark = [pytest.mark.e2e, pytest.mark.many_servers]
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
            node.dump, node.dist = dump, dist
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
        assert not (node.dump / "no-writer.json").exists()
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
        settled(nodes[1 - dp].dump)  # the other node published all it will for the requests answered so far
        other.poll()
        assert rid not in other.ready_rids() and not other.not_captured(rid)
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


def test_harvester_on_each_node_harvests_what_its_node_served(dp_nodes, hf, tmp_path):
    """`python -m sglang_hs.extract --from-dump` on each node's dump (after the module's readers are closed),
    then two requests routed to each DP rank: each node's harvester writes exactly the files of the requests
    its node served (its journal's rids), every row within one bf16 rounding of HF's float32 row and the loss
    mask on the generated tokens."""
    import subprocess
    import sys

    import torch

    import specforge_way

    nodes, _ = dp_nodes
    procs, logs = [], []
    try:
        for rank, node in enumerate(nodes):
            log = tmp_path / f"harvest{rank}.log"
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "sglang_hs.extract", "--from-dump", str(node.dump),
                                           "--output", str(tmp_path / f"harvest{rank}"), "--format", "specforge",
                                           "--max-samples", "2"], stdout=subprocess.DEVNULL, stderr=open(log, "w")))
        for proc, log in zip(procs, logs):
            deadline = time.monotonic() + 300
            while "[extract] harvesting" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        sent = {}
        for i, text in enumerate(TEXTS * 2):
            ids = row_judge.prompt_ids(hf, text)[: 15 + 6 * i]
            rid = f"harvest-dp{i % 2}-{i}"
            out = nodes[0].generate(input_ids=ids, rid=rid, routed_dp_rank=i % 2,
                                    sampling_params={"max_new_tokens": 4, "ignore_eos": True, **GREEDY})
            sent[rid] = (ids, out["output_ids"])
        for proc, log in zip(procs, logs):
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    worst = 0.0
    for rank in (0, 1):
        out = tmp_path / f"harvest{rank}"
        entries = [json.loads(x) for x in open(out / "harvest.jsonl") if "index" in json.loads(x)]
        assert sorted(e["rid"] for e in entries) == [f"harvest-dp{rank}-{i}" for i in (rank, rank + 2)], entries
        for e in entries:
            ids, generated = sent[e["rid"]]
            (path,) = out.glob(f"rows_*/data_{e['index']}.ckpt")
            s = specforge_way.load_sample(str(path))
            tokens = s["input_ids"][0].tolist()
            assert tokens == ids + generated[:-1] and e["prompt_len"] == len(ids) and e["next_token"] == generated[-1]
            assert torch.load(path)["loss_mask"].tolist() == [0] * len(ids) + [1] * (len(tokens) - len(ids))
            hs = hf(tokens)
            aux = s["hidden_state"][0].view(len(tokens), len(LAYERS), -1)
            for got, ref in [(aux[:, k], hs[lid]) for k, lid in enumerate(LAYERS)] + [(s["target"][0], hs[N_LAYERS])]:
                err = row_judge.rel(got, ref)
                worst = max(worst, err.max().item())
                assert (err <= row_judge.BF16_TOL).all(), (e["rid"], err.max().item())
    print(f"two nodes, one harvester per node: 2 + 2 requests, each harvested on its node, worst row {worst:.2e} "
          f"(bf16 files, tolerance {row_judge.BF16_TOL})")


def _long_request(node, rid, dp_rank, errors):
    """A request decoding for long (3000 tokens), routed to `dp_rank` (None: not routed); the error that ends
    it goes into `errors`."""
    route = {} if dp_rank is None else {"routed_dp_rank": dp_rank}

    def run():
        try:
            node.generate(input_ids=list(range(5, 45)), rid=rid, sampling_params={"max_new_tokens": 3000,
                                                                                  "ignore_eos": True}, **route)
        except Exception as e:  # the server dies under it
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_node_0_lost_mid_generation_node_1_reports_it_and_its_dump_stays_whole(dp_nodes):
    """Node 0 lost (its launcher and every server process SIGKILLed, as a machine going down) while node 1
    decodes a request routed to its DP rank: node 1's launcher says in one line that node 0 (its
    --dist-init-addr) went away and exits with EXIT_NODE0_LOST, leaving no process; a reader of node 1's dump
    sees no record of the request, torn or whole (poll raises on a torn one). Ends the module's DP pair: keep
    it last of the DP tests."""
    nodes, _ = dp_nodes
    reader = HiddenStateReader(str(nodes[1].dump))
    try:
        writer = reader.manifest["writers"][0]["pid"]
        errors = []
        decoding = until_decoding(nodes[1], nodes[1].dump, writer)  # a fresh count of its decode steps first
        t = _long_request(nodes[0], "node0-lost", 1, errors)
        decoding(t)
        session = server_session(nodes[0].output)
        nodes[0].proc.kill()
        os.killpg(session, signal.SIGKILL)
        rc = nodes[1].wait_exit(timeout=600)
        t.join(120)
        assert rc == EXIT_NODE0_LOST, nodes[1].tail()
        lines = [x for x in nodes[1].output.splitlines() if "went away" in x]
        assert len(lines) == 1 and lines[0].startswith(
            f"[sglang-hs] node 0 (--dist-init-addr 127.0.0.1:{nodes[1].dist}) went away ("), nodes[1].tail()
        print(lines[0])
        assert_connection_lost(errors)
        # no writer is left on either node: one poll sees all there is
        assert not leftover_server_processes(nodes[1].output) and not leftover_server_processes(nodes[0].output)
        assert reader.poll() == 0 and "node0-lost" not in reader.ready_rids() and not reader.not_captured("node0-lost")
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
    dump dir holds no manifest, store or ring, only its launcher's no-writer.json. Requests over chunk
    boundaries with decode steps: every row exact against HF."""
    nodes, reader = tp_nodes
    m = reader.manifest
    assert [w["dp_rank"] for w in m["writers"]] == [0] and (m["dp_size"], m["nnodes"], m["node_rank"]) == (1, 2, 0)
    assert coverage(m) == "DP ranks [0] of 1 (node 0 of 2)"
    assert not list(nodes[1].dump.glob("manifest.json")) and not list(nodes[1].dump.glob("*.bin")), \
        list(nodes[1].dump.iterdir())
    assert json.load(open(nodes[1].dump / "no-writer.json"))["writer_nodes"] == [0]
    assert "[sglang-hs] node 1 of 2 hosts no writer (--tp 2 over 2 nodes)" in nodes[1].output, nodes[1].tail()
    worst = 0.0
    for i, text in enumerate(TEXTS):
        ids = row_judge.prompt_ids(hf, text)[: 20 + 9 * i]
        out = nodes[0].generate(input_ids=ids, rid=f"tpn-{i}", sampling_params={"max_new_tokens": 4 + i, **GREEDY})
        rec = reader.take(f"tpn-{i}", timeout=300)
        worst = max(worst, row_judge.assert_exact(rec, hf, (ids + out["output_ids"])[:-1], LAYERS, N_LAYERS, 256))
    print(f"two nodes, --tp 2: 2 records, worst row {worst:.2e} (tolerance {row_judge.TOL})")


def test_a_reader_the_cli_and_the_harvester_on_node_1_say_it_hosts_no_writer(tp_nodes, tmp_path):
    """On node 1's dump dir (no writer there) a reader, the extraction CLI and the harvester fail at once, in
    one line naming the dir and node 0's dump, instead of waiting for a manifest that never comes."""
    import subprocess
    import sys

    nodes, _ = tp_nodes
    why = (f"{nodes[1].dump}: this node hosts no writer (node 1 of 2, --tp 2 over 2 nodes): records of this server "
           "land in node 0's dump; read them there")
    with pytest.raises(NoWriterHere) as e:
        HiddenStateReader(str(nodes[1].dump), wait=120)  # it fails at once: NoWriterHere, not a wait that ran out
    assert str(e.value) == why
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(5, 20))}) + "\n")
    for flag, args in (("--hs-dump-dir", ["--data", str(data), "--server", nodes[0].url, "--hs-dump-dir"]),
                       ("--from-dump", ["--from-dump"])):
        proc = subprocess.run([sys.executable, "-m", "sglang_hs.extract", "--no-progress", *args, str(nodes[1].dump),
                               "--output", str(tmp_path / flag[2:]), "--format", "specforge"], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode != 0 and f"error: {flag}: {why}\n" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr


def test_node_1_stopped_alone_mid_generation_stops_at_once_and_node_0_reports_it(tp_nodes):
    """SIGTERM to node 1's launcher while node 0 decodes a request (TP rank 1 is on node 1): SGLang's node-1
    process ignores SIGTERM (it waits for node 0's ShutdownReq), the launcher stops it with SIGQUIT, which it
    honours: node 1's launcher stops without waiting out its grace, nothing left running. Node 0, its TP peer
    gone, reports the server's exit and exits non-zero, the client gets an error, and no record of the request
    (torn or whole) is emitted. Ends the module's TP pair: keep it last."""
    nodes, reader = tp_nodes
    writer = reader.manifest["writers"][0]["pid"]
    errors = []
    decoding = until_decoding(nodes[0], nodes[0].dump, writer)  # a fresh count of its decode steps first
    t = _long_request(nodes[0], "node1-stopped", None, errors)
    decoding(t)
    nodes[1].proc.send_signal(signal.SIGTERM)
    rc1 = nodes[1].wait_exit(timeout=600)
    assert rc1 == 128 + signal.SIGTERM, nodes[1].tail()
    assert "did not stop within" not in nodes[1].output, nodes[1].tail()
    assert "stopped by SIGTERM; all server processes are gone" in nodes[1].output, nodes[1].tail()
    assert not leftover_server_processes(nodes[1].output)
    rc0 = nodes[0].wait_exit(timeout=600)
    t.join(120)
    assert rc0 != 0, nodes[0].tail()
    assert "[sglang-hs] server exited with status" in nodes[0].output, nodes[0].tail()
    assert_connection_lost(errors)
    assert not leftover_server_processes(nodes[0].output)  # no writer is left: one poll sees all there is
    assert reader.poll() == 0 and "node1-stopped" not in reader.ready_rids() and not reader.not_captured("node1-stopped")
