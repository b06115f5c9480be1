"""python -m sglang_hs.plan without a server: its per-file sizes against files the real sinks write (odd
T, the tiny model's and DeepSeek-V3's widths), the store and ring as the launcher sizes them, and what does
not fit named with flags. Its figures against a real extraction: tests/e2e/test_extract.py."""
import json

import pytest
import torch

from sglang_hs.tools import plan
from sglang_hs.extract.sinks import SafetensorsSink, SpecForgeSink

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168,
      "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("T", [1, 37, 501])
@pytest.mark.parametrize("H", [256, 7168])
@pytest.mark.parametrize("kind", ["specforge", "safetensors", "fp8", "fp8-per-layer"])
def test_file_bytes_are_what_the_sinks_write(tmp_path, T, H, kind):
    sink = SpecForgeSink(str(tmp_path)) if kind == "specforge" else SafetensorsSink(
        str(tmp_path), None if kind == "safetensors" else kind)
    sink.layer_ids = [2, 30, 58]
    rows = torch.randn(T, 4, H).bfloat16()  # a record's rows, handed to the sink as the reader's two views
    n = sink.write(T, torch.arange(T), torch.ones(T, dtype=torch.long), rows[:, :3], rows[:, 3])
    print(kind, T, H, n, n - plan.file_bytes(T, 4, H, 2, kind))
    assert abs(n - plan.file_bytes(T, 4, H, 2, kind)) <= 192  # headers and zip entries vary by tens of bytes


def _plan(tmp_path, capsys, *args):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(V3))
    rc = plan.main(["--model-path", str(cfg), "--device", "cpu", "--json", *args])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else out.err)


def test_deepseek_v3_figures_and_what_does_not_fit(tmp_path, capsys):
    rc, f = _plan(tmp_path, capsys, "--samples", "10000", "--mean-tokens", "2048", "--max-total-tokens", "100000",
                  "--output", str(tmp_path))
    assert rc == 0
    assert f["layers"] == [2, 30, 58] and f["bytes_per_token"] == 57344 and f["bytes_per_token_fp8"] == 28676
    assert f["store_bytes_per_writer"] == (100000 + 1) * 57344  # SGLang adds a page of padding slots
    assert f["ring_bytes_per_writer"] == 4096 + f["ring_needed_for_one_record"] > 2 * 163840 * 57344  # grown to the context
    assert f["disk"]["safetensors bf16"] == pytest.approx(10000 * 2048 * (57344 + 16 + 16), rel=1e-3)  # ~1.2 TB
    assert f["disk"]["safetensors fp8"] / f["disk"]["safetensors bf16"] == pytest.approx(0.5, abs=0.01)
    free = f["output_free"]
    if f["disk"]["safetensors bf16"] > free:  # this machine's disk holds far less than 1.2 TB
        msgs = [p for p in f["problems"] if p.startswith("--format safetensors bf16")]
        assert msgs and "--max-samples" in msgs[0] and "--shard I/" in msgs[0], f["problems"]


def test_max_record_tokens_lowers_the_rings_floor_as_the_launchers(tmp_path, capsys):
    from sglang_hs.server.store.ring import record_bytes

    rc, f = _plan(tmp_path, capsys, "--samples", "10", "--mean-tokens", "2048", "--hs-max-record-tokens", "32768")
    assert rc == 0 and f["context_length"] == 163840 and f["ring_floor_tokens"] == 32768
    assert f["ring_needed_for_one_record"] == 2 * record_bytes(32768, 4, 7168, 2, 256)  # rid of 256 bytes
    rc, f = _plan(tmp_path, capsys, "--samples", "10", "--mean-tokens", "2048", "--hs-max-record-tokens", "999999")
    assert rc == 0 and f["ring_floor_tokens"] == 163840  # above the context: no cap


def test_records_in_parts_plan_a_ring_of_one_part_per_record_as_the_launchers(tmp_path, capsys):
    """--hs-record-part-size: the ring need hold twice one part of a maximal record (all its token ids), and each of
    --concurrent N long requests reserves twice its first part, as the launcher and admission size them."""
    from sglang_hs.server.store.ring import record_bytes

    part_rows = (256 << 20) // 57344
    rc, f = _plan(tmp_path, capsys, "--samples", "10", "--mean-tokens", "2048", "--hs-record-part-size", "256MiB",
                  "--concurrent", "8", "--request-tokens", "131072")
    assert rc == 0 and f["ring_needed_for_one_record"] == 2 * record_bytes(part_rows, 4, 7168, 2, 256, n_ids=163840)
    assert f["concurrent"]["ring_bytes_each"] == 2 * record_bytes(part_rows, 4, 7168, 2, 256, n_ids=131071)
    assert f["concurrent"]["ring_bytes"] < 5 << 30 < 8 * 131072 * 57344  # 8 x 128K: ~4.3 GB of ring, not 60 GB


def test_the_checkpoints_drafter_layers_are_planned_as_the_launcher_captures_them(tmp_path, capsys):
    """A V4-Flash-DSpark config (dspark_target_layer_ids [40, 41, 42] of 43): plan sizes our ids 41, 42, 43, as the
    launcher captures them (server/layer_source.py); --hs-layers still wins."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 43,
                               "hc_mult": 4, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
                               "dspark_target_layer_ids": [40, 41, 42]}))
    for extra, layers in (([], [41, 42, 43]), (["--hs-layers", "2,21"], [2, 21])):
        assert plan.main(["--model-path", str(cfg), "--device", "cpu", "--json", "--samples", "1", "--mean-tokens",
                          "10", *extra]) == 0
        assert json.loads(capsys.readouterr().out)["layers"] == layers


def test_a_store_that_does_not_fit_names_the_flags(tmp_path, capsys):
    rc, f = _plan(tmp_path, capsys, "--samples", "1", "--mean-tokens", "10", "--max-total-tokens", str(10**9),
                  "--context-length", "4096", "--hs-dump-dir", str(tmp_path))
    assert rc == 0
    (p,) = [p for p in f["problems"] if p.startswith("store + ring")]
    assert "--max-total-tokens" in p and "--shm-size" in p


def test_bad_input_is_one_line(tmp_path, capsys):
    rc, err = _plan(tmp_path, capsys)
    assert rc == 2 and err.strip() == ("python -m sglang_hs.plan: error: --data, or --samples and --mean-tokens, or "
                                       "--concurrent say how much will be captured")
    rc, err = _plan(tmp_path, capsys, "--samples", "1", "--mean-tokens", "1", "--hs-layers", "2,99")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--hs-layers" in err
    rc, err = _plan(tmp_path, capsys, "--samples", "1", "--mean-tokens", "1", "--model-path", str(tmp_path / "none"))
    assert rc == 2 and err.strip() == (f"python -m sglang_hs.plan: error: --model-path: {tmp_path / 'none'} is "
                                       "neither a checkpoint folder nor a config.json")


@pytest.mark.parametrize("args, message", [
    (["--samples", "10", "--mean-tokens", "inf"], "--mean-tokens: a number of tokens >= 1, got inf"),
    (["--samples", "10", "--mean-tokens", "nan"], "--mean-tokens: a number of tokens >= 1, got nan"),
    (["--samples", "10", "--mean-tokens", "-100"], "--mean-tokens: a number of tokens >= 1, got -100.0"),
    (["--samples", "-10", "--mean-tokens", "100"], "--samples: a number of samples >= 1, got -10"),
    (["--samples", "10", "--mean-tokens", "100", "--max-total-tokens", "-1"],
     "--max-total-tokens: a number of KV slots >= 1, got -1"),
    (["--samples", "10", "--mean-tokens", "100", "--context-length", "0"],
     "--context-length: a number of tokens >= 1, got 0"),
    (["--concurrent", "0"], "--concurrent: a number of requests >= 1, got 0"),
    (["--concurrent", "2", "--request-tokens", "-5"], "--request-tokens: a number of tokens >= 1, got -5"),
    (["--request-tokens", "5000"], "--request-tokens needs --concurrent (how many such requests run at once)"),
    (["--concurrent", "2", "--request-tokens", "200000"],
     "--request-tokens: 200000 tokens exceed the context length of 163840; raise --context-length"),
    (["--samples", "10", "--mean-tokens", "100", "--page-size", "0"], "--page-size: a number of tokens >= 1, got 0"),
    (["--samples", "10", "--mean-tokens", "100", "--hs-max-record-tokens", "0"],
     "--hs-max-record-tokens: a number of tokens >= 1, got 0"),
    (["--samples", "10", "--mean-tokens", "100", "--dp-size", "0", "--enable-dp-attention"],
     "--dp-size: a number of ranks >= 1, got 0"),
])
def test_a_number_out_of_range_is_one_line_naming_the_flag(tmp_path, capsys, args, message):
    """inf gave an OverflowError traceback and a negative value printed negative sizes."""
    rc, err = _plan(tmp_path, capsys, *args)
    assert rc == 2 and err.strip() == f"python -m sglang_hs.plan: error: {message}", err


@pytest.mark.parametrize("model, H, n, layers, rows", [
    ("deepseek-ai/DeepSeek-V3.2", 7168, 61, [2, 30, 58], 1),
    ("deepseek-ai/DeepSeek-V4-Pro", 7168, 61, [2, 30, 58], 1),
    ("deepseek-ai/DeepSeek-V4-Flash", 4096, 43, [2, 21, 40], 1),
])
def test_published_v32_and_v4_row_sizes_offline(capsys, tmp_path, model, H, n, layers, rows):
    rc = plan.main(["--model-path", model, "--device", "cpu", "--json", "--samples", "10", "--mean-tokens", "100",
                    "--output", str(tmp_path), "--max-total-tokens", "1000"])
    f = json.loads(capsys.readouterr().out)
    assert rc == 0 and f["hidden_size"] == H and f["layers"] == layers
    # three layers + the final state, bf16: V4's default is one row per layer (the mean of its 4 streams)
    assert f["bytes_per_token"] == 4 * H * 2 and f["rows_per_layer"] == rows
    assert f["hc_mult"] == (4 if "V4" in model else 1)


def test_v4_full_streams_are_four_rows_per_layer(capsys, tmp_path):
    rc = plan.main(["--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--device", "cpu", "--json", "--samples", "10",
                    "--mean-tokens", "100", "--output", str(tmp_path), "--max-total-tokens", "1000",
                    "--hs-hc-streams", "full"])
    f = json.loads(capsys.readouterr().out)
    assert rc == 0 and f["rows_per_layer"] == 4
    assert f["bytes_per_token"] == (3 * 4 + 1) * 4096 * 2  # 3 layers x 4 streams + the final state
    assert f["store_bytes_per_writer"] == 1001 * 13 * 4096 * 2
    rc = plan.main(["--model-path", "deepseek-ai/DeepSeek-V3.2", "--device", "cpu", "--samples", "1",
                    "--mean-tokens", "1", "--hs-hc-streams", "full"])
    err = capsys.readouterr().err
    assert rc == 2 and "--hs-hc-streams: only for models with hyper-connections" in err and err.count("\n") == 1


@pytest.mark.parametrize("layout, by_node", [
    ([], [1]),
    (["--dp-size", "8", "--enable-dp-attention"], [8]),
    (["--tp", "16", "--nnodes", "2"], [1, 0]),  # TP over two nodes: the one writer is TP rank 0, on node 0
    (["--tp", "16", "--dp-size", "16", "--enable-dp-attention", "--nnodes", "2"], [8, 8]),  # one rank per group
    (["--tp", "16", "--dp-size", "2", "--enable-dp-attention", "--nnodes", "2"], [1, 1]),  # one group per node
    (["--tp", "16", "--dp-size", "2", "--enable-dp-attention", "--nnodes", "4"], [1, 0, 1, 0]),  # a group on 2 nodes
])
def test_dev_shm_is_sized_per_node(tmp_path, capsys, layout, by_node):
    """Each node's /dev/shm holds the writers on that node: a DP group's writer runs where its attention-TP
    rank 0 does (SGLang gives node r the TP ranks [r*tp/nnodes, (r+1)*tp/nnodes))."""
    rc, f = _plan(tmp_path, capsys, "--samples", "1", "--mean-tokens", "10", "--max-total-tokens", "100000", *layout)
    assert rc == 0, f
    assert f["writers_by_node"] == by_node and f["writers"] == max(by_node)
    assert f["writers"] * (f["store_bytes_per_writer"] + f["ring_bytes_per_writer"]) == max(by_node) * (
        (100000 + 1) * 57344 + f["ring_bytes_per_writer"])
    rc = plan.main(["--model-path", str(tmp_path / "config.json"), "--device", "cpu", "--samples", "1",
                    "--mean-tokens", "10", *layout])
    text = capsys.readouterr().out
    assert rc == 0 and (f"writers per node: {by_node}" in text) == (len(by_node) > 1), text


@pytest.mark.parametrize("args, message", [
    (["--tp", "16", "--nnodes", "3"], "--nnodes 3: must divide --tp-size (16), as SGLang splits the TP ranks evenly "
                                      "over the nodes"),
    (["--tp", "16", "--dp-size", "3", "--enable-dp-attention"], "--dp-size 3: must divide --tp-size (16) with "
                                                                  "--enable-dp-attention"),
    (["--nnodes", "0"], "--nnodes: a number of nodes >= 1, got 0"),
])
def test_bad_multi_node_layout_is_one_line(tmp_path, capsys, args, message):
    rc, err = _plan(tmp_path, capsys, "--samples", "1", "--mean-tokens", "10", *args)
    assert rc == 2 and err.strip() == f"python -m sglang_hs.plan: error: {message}", err


@pytest.mark.parametrize("model, row", [(None, 57344), ("deepseek-ai/DeepSeek-V4-Flash", 32768)])
@pytest.mark.parametrize("L", [65536, 131072])
def test_concurrent_long_requests_size_the_ring_and_store(tmp_path, capsys, model, row, L):
    """--concurrent N --request-tokens L (issue 47): N long requests at once need N x twice their record in the
    ring (what admission reserves) and N x L KV slots in the store, at DeepSeek-V3's (3 aux + final, 7168, bf16)
    and V4-Flash's (4096) row sizes; the default ring and store grow to that."""
    from sglang_hs.server.store.ring import record_bytes

    args = ["--concurrent", "4", "--request-tokens", str(L), "--output", str(tmp_path)]
    if model:
        rc = plan.main(["--model-path", model, "--device", "cpu", "--json", *args])
        f = json.loads(capsys.readouterr().out)
    else:
        rc, f = _plan(tmp_path, capsys, *args)
    assert rc == 0 and f["bytes_per_token"] == row
    c = f["concurrent"]
    each = 2 * record_bytes(L - 1, 4, row // 8, 2, 256)  # rid of 256 bytes
    assert c["ring_bytes"] == 4 * each and c["kv_slots"] == 4 * L and c["store_bytes"] == 4 * L * row
    assert f["ring_bytes_per_writer"] >= c["ring_bytes"] and f["kv_slots_per_writer"] == 4 * L + 1
    assert c["at_once_ring"] == c["at_once_kv"] == 4 and f["samples"] == 4 and f["tokens"] == 4 * L
    print(f"{f['model']} 4 x {L}: ring {c['ring_bytes'] / 1e9:.1f} GB, store {c['store_bytes'] / 1e9:.1f} GB")


def test_a_ring_too_small_for_the_concurrent_requests_says_how_many_fit(tmp_path, capsys):
    rc, f = _plan(tmp_path, capsys, "--concurrent", "8", "--request-tokens", "131072", "--hs-ring-size", "20GiB",
                  "--max-total-tokens", "300000", "--output", str(tmp_path))
    assert rc == 0 and f["concurrent"]["at_once_ring"] == 1 and f["concurrent"]["at_once_kv"] == 2
    ring = next(p for p in f["problems"] if p.startswith("ring:"))
    kv = next(p for p in f["problems"] if p.startswith("KV slots:"))
    assert "holds 1 at once" in ring and ring.endswith("--hs-ring-size 113GiB"), ring
    assert kv.endswith("--max-total-tokens 1048576 (a store of 60.13 GB)"), kv
