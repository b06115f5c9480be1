"""The extraction's configuration stage (sglang_hs/extract/config.py): the command line parsed once into a typed,
frozen ExtractConfig whose pieces are what the pipeline's stages get; bad command lines are one line naming the
flag; the node split is the one part settled later, and what manifest.json records follows it."""
import dataclasses
import os

import pytest

from sglang_hs.extract.config import (ExtractConfig, HarvestSettings, OutputSettings, RequestSettings, RunFacts,
                                      ServerSettings, parse_args)
from sglang_hs.extract.errors import ExtractError
from sglang_hs.extract.flags import build_parser
from sglang_hs.extract.sinks import SINKS


def test_a_data_run_is_typed_pieces_of_the_flags(tmp_path):
    config, launcher = parse_args(["--data", "d.jsonl", "--output", "out", "--server", "http://h:1/",
                                   "--hs-dump-dir", "/dump", "--concurrency", "3", "--verify", "0.25",
                                   "--regenerate", "--max-new-tokens", "9", "--temperature", "0.5", "--top-p", "0.9",
                                   "--max-samples", "7", "--shard", "1/3", "--no-progress", "--torch-threads", "2"])
    assert isinstance(config, ExtractConfig) and config.mode == "data" and launcher == []
    assert config.output == OutputSettings(os.path.abspath("out"), "specforge", "bf16", None, False)
    assert config.server == ServerSettings("http://h:1", "/dump", None, ())  # no trailing /: URLs are joined
    assert config.requests == RequestSettings(3, 0.25, 3600.0, True, 9, 0.5, 0.9)
    assert (config.data, config.max_samples, config.harvest, config.torch_threads, config.progress) == (
        "d.jsonl", 7, None, 2, False)
    assert (config.selection.shard_index, config.selection.shard_count, config.selection.shard_given) == (1, 3, True)
    assert config.server.transport == "ring"


def test_the_pieces_are_frozen():
    config, _ = parse_args(["--data", "d.jsonl", "--output", "out"])
    for piece, field in ((config, "data"), (config.output, "format"), (config.server, "url"),
                         (config.requests, "verify")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(piece, field, None)


def test_launcher_flags_go_to_the_server_a_run_starts():
    config, launcher = parse_args(["--data", "d.jsonl", "--output", "out", "--tp", "2", "--hs-last", "both"])
    assert launcher == ["--tp", "2", "--hs-last", "both"] and config.server.launcher_args == tuple(launcher)
    assert config.server.url is None and config.server.dump_dir is None


def test_a_harvest_and_a_finalize_have_their_modes():
    config, _ = parse_args(["--from-dump", "/dump", "--output", "out", "--idle-timeout", "5", "--max-samples", "4",
                            "--format", "safetensors", "--save-dtype", "fp8"])
    assert config.mode == "harvest" and config.harvest == HarvestSettings("/dump", 5.0, 4, None)
    assert config.output.save_dtype == "fp8" and config.facts.from_dump == "/dump" and config.facts.data is None
    config, _ = parse_args(["--finalize", "--format", "safetensors", "--output", "out"])
    assert config.mode == "finalize" and config.harvest is None and config.output.save_dtype is None
    config, _ = parse_args(["--finalize", "--format", "deepspec", "--output", "out"])
    assert config.mode == "finalize" and config.output.save_dtype == "bf16"  # DeepSpec's reader: bf16


@pytest.mark.parametrize("given, stored", [(None, "bf16"), ("bf16", "bf16"), ("fp8", "fp8"), ("fp8-e5m2", "fp8-e5m2")])
def test_deepspec_takes_bf16_and_both_fp8_dtypes(given, stored):
    argv = ["--data", "d", "--output", "out", "--format", "deepspec"] + (["--save-dtype", given] if given else [])
    assert parse_args(argv)[0].output.save_dtype == stored


@pytest.mark.parametrize("argv, message", [
    ([], "--data is required"),
    (["--finalize"], "--finalize is for --format safetensors"),
    (["--data", "d", "--idle-timeout", "3"], "--idle-timeout is for --from-dump"),
    (["--data", "d", "--save-dtype", "fp16"], "--save-dtype: 'fp16' is not one of bf16, fp8, fp8-per-layer, fp8-e5m2"),
    (["--data", "d", "--save-dtype", "fp8"], "--save-dtype fp8 needs --format safetensors"),
    (["--data", "d", "--format", "safetensors", "--save-dtype", "fp8-e5m2"],
     "--save-dtype fp8-e5m2 needs --format deepspec (an unscaled e5m2 cast); --format safetensors takes bf16, fp8"),
    (["--data", "d", "--save-dtype", "fp8-e5m2"], "--save-dtype fp8-e5m2 needs --format deepspec"),
    (["--data", "d", "--format", "deepspec", "--save-dtype", "fp8-per-layer"],
     "--save-dtype fp8-per-layer: --format deepspec stores FP8 unscaled"),
    (["--data", "d", "--server", "http://x", "--hs-dump-dir", "/d", "--tp", "2"],
     "--tp: launcher flags need no --server"),
    (["--from-dump", "/d", "--shard", "1/2"], "--shard does not go with --from-dump"),
    (["--from-dump", "/d", "--torch-threads", "0"], "--torch-threads: must be >= 1, got 0"),
    (["--data", "d", "--part-mb", "0"], "--part-mb: a size in MiB > 0 (at most 1048576), got '0'"),
    (["--data", "d", "--part-mb", "-5"], "--part-mb: a size in MiB > 0"),
    (["--data", "d", "--part-mb", "lots"], "--part-mb: a size in MiB > 0 (at most 1048576), got 'lots'"),
    (["--data", "d", "--part-mb", "nan"], "--part-mb: a size in MiB > 0"),
    (["--from-dump", "/d", "--part-mb", "inf"], "--part-mb: a size in MiB > 0"),
])
def test_a_command_line_that_cannot_run_is_one_line_naming_the_flag(argv, message):
    with pytest.raises(ExtractError) as e:
        parse_args(["--output", "out", *argv])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_part_mb_is_the_long_record_bound_in_bytes():
    assert parse_args(["--data", "d", "--output", "out"])[0].output.part_bytes == 256 << 20
    assert parse_args(["--data", "d", "--output", "out", "--part-mb", "64"])[0].output.part_bytes == 64 << 20
    assert parse_args(["--from-dump", "/d", "--output", "out", "--part-mb", "0.5"])[0].output.part_bytes == 1 << 19


def test_the_format_choices_are_the_sinks_registry():
    fmt = next(a for a in build_parser()._actions if "--format" in a.option_strings)
    assert fmt.choices == list(SINKS) == ["specforge", "safetensors", "deepspec"]


def test_the_node_split_is_what_the_manifest_records_as_the_shard():
    """The one part settled after parsing: against one node of two, the selection (and what RunFacts gives
    manifest.json) becomes that node's DP ranks; the frozen pieces stay as parsed."""
    config, _ = parse_args(["--data", "d.jsonl", "--output", "out"])
    facts = config.facts
    assert isinstance(facts, RunFacts) and facts.shard == config.shard == "0/1" and config.route is None
    config.selection.split_by_node({"writers": [{"id": 0, "dp_rank": 2}, {"id": 1, "dp_rank": 3}], "dp_size": 4,
                                    "nnodes": 2, "node_rank": 1})
    assert facts.shard == config.shard == "DP ranks [2, 3] of 4 (node 1 of 2)" and config.route == ([2, 3], 4)
    assert [i for i in range(8) if config.selection.takes(i)] == [2, 3, 6, 7]
    assert [config.selection.routed_rank(i) for i in (2, 3, 6, 7)] == [2, 3, 2, 3]
