"""The launcher's own flag handling (no server is started here)."""
import json
import os

import pytest

from sglang_hs import envs
from sglang_hs.tools import launch_server
from sglang_hs.server.capture_spec import CaptureConfigError


def _model_dir(tmp_path, arch="DeepseekV3ForCausalLM", layers=8, **extra):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "num_hidden_layers": layers, "hidden_size": 64,
                                               **extra}))
    return str(d)


@pytest.mark.parametrize(
    "text, expected",
    [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1G", 10**9), ("1000", 1000), ("1.5 KiB", 1536), ("2tb", 2 * 10**12)],
)
def test_parse_size(text, expected):
    assert launch_server.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "8 gigs", "0", "1.2.3M"])
def test_parse_size_rejects(text):
    with pytest.raises(CaptureConfigError, match="--hs-ring-size"):
        launch_server.parse_size(text)


def test_split_argv_keeps_sglang_flags_and_refuses_unknown_hs_flags():
    ns, rest = launch_server.split_argv(["--hs-dump-dir", "/x", "--tp", "8", "--hs-last", "--port=1"])
    assert ns.hs_dump_dir == "/x" and ns.hs_last == "post-norm" and rest == ["--tp", "8", "--port=1"]
    for value in ("post-norm", "pre-norm", "both"):  # a bare --hs-last is post-norm, as before it took a value
        ns, rest = launch_server.split_argv(["--hs-last", value, "--tp", "8"])
        assert ns.hs_last == value and rest == ["--tp", "8"]
    ns, rest = launch_server.split_argv(["--hs-last=pre-norm", "--tp", "8"])
    assert ns.hs_last == "pre-norm" and rest == ["--tp", "8"]
    with pytest.raises(CaptureConfigError, match="unknown sglang-hs flag --hs-layer;"):
        launch_server.split_argv(["--hs-layer", "2"])  # no abbreviation of --hs-layers either
    with pytest.raises(CaptureConfigError, match="unknown sglang-hs flag --hs-bogus"):
        launch_server.split_argv(["--hs-bogus=1"])


def test_prepare_cpu_mode_capture(tmp_path, clean_env):
    model = _model_dir(tmp_path)
    dump = tmp_path / "hs"
    argv, dump_dir = launch_server.prepare(
        ["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(dump), "--hs-layers", "1,3", "--hs-last",
         "--hs-ring-size", "64MiB"]
    )
    assert dump_dir == str(dump) and oct(os.stat(dump).st_mode & 0o777) == "0o700"
    assert argv[argv.index("--max-total-tokens") + 1] == launch_server.CPU_DEFAULT_MAX_TOTAL_TOKENS
    assert "--sleep-on-idle" in argv
    assert envs.SGLANG_HS_LAYERS == [1, 3] and envs.SGLANG_HS_LAST and envs.SGLANG_HS_DUMP_DIR == str(dump)
    assert envs.SGLANG_HS_RING_SIZE == 64 << 20 and envs.SGLANG_HS_CPU_MODE
    assert os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "sglang_hs.server.models"
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("sglang_hs", "server", "cpu", "stubs"))
    assert os.environ["PYTHONPATH"].endswith("/orig")


@pytest.mark.parametrize("given, served, said", [
    (None, envs.CPU_OMP_WAIT_POLICY, "OMP_WAIT_POLICY=PASSIVE (set by sglang-hs"),  # unset: the launcher's choice
    ("", None, "OMP_WAIT_POLICY unset (empty in the environment: libgomp's default"),  # empty: libgomp's default
    ("ACTIVE", "ACTIVE", "OMP_WAIT_POLICY=ACTIVE (from the environment)"),  # the user's: kept
])
def test_prepare_cpu_mode_omp_wait_policy(tmp_path, clean_env, capsys, given, served, said):
    """CPU mode gives the server's processes OMP_WAIT_POLICY=PASSIVE unless the user set it (measured in
    benchmarks/bench_omp_wait.py), plain or capturing, and its CPU-mode line says which and why."""
    model = _model_dir(tmp_path)
    for extra in ([], ["--hs-dump-dir", str(tmp_path / "hs")]):
        os.environ.pop("OMP_WAIT_POLICY", None)
        if given is not None:
            os.environ["OMP_WAIT_POLICY"] = given
        launch_server.prepare(["--model-path", model, "--device", "cpu", *extra])
        assert os.environ.get("OMP_WAIT_POLICY") == served and envs.OMP_WAIT_POLICY == served
        line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[sglang-hs] CPU mode")]
        assert len(line) == 1 and said in line[0], line


def test_prepare_leaves_torch_compile_to_the_server(tmp_path, clean_env):
    """The launcher sets no TORCHDYNAMO_DISABLE: the server decides on SGLang's resolved dtype
    (serve.cpu_torch_compile; tests/unit/test_server_arg_refusals.py)."""
    os.environ.pop("TORCHDYNAMO_DISABLE", None)
    launch_server.prepare(["--model-path", _model_dir(tmp_path), "--device", "cpu", "--dtype", "float32"])
    assert "TORCHDYNAMO_DISABLE" not in os.environ


@pytest.mark.parametrize("value, rows", [("pre-norm", 3), ("both", 4)])
def test_prepare_hs_last_value_reaches_the_overlay(tmp_path, clean_env, value, rows, capsys):
    from sglang_hs.server.capture_spec import CaptureSpec

    model = _model_dir(tmp_path)
    launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                           "--hs-layers", "1,3", "--hs-last", value, "--hs-ring-size", "64MiB"])
    assert os.environ["SGLANG_HS_LAST"] == value and f"+ last {value}" in capsys.readouterr().err
    # what the overlay resolves in the server's processes
    assert CaptureSpec.resolve(envs.SGLANG_HS_LAYERS, envs.SGLANG_HS_LAST, 4, 16).rows_per_token == rows


def test_prepare_refuses_an_unknown_hs_last_in_one_line(tmp_path, clean_env):
    model = _model_dir(tmp_path)
    with pytest.raises(CaptureConfigError, match=r"^--hs-last: 'prenorm' is not one of post-norm, pre-norm, both"):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                               "--hs-last", "prenorm"])


def test_prepare_default_ids_and_user_kv_flags_kept(tmp_path, clean_env):
    model = _model_dir(tmp_path, layers=61)
    argv, _ = launch_server.prepare(["--model-path", model, "--device", "cpu", "--mem-fraction-static", "0.05",
                                     "--hs-dump-dir", str(tmp_path / "hs")])
    assert envs.SGLANG_HS_LAYERS == [2, 30, 58] and not envs.SGLANG_HS_LAST
    assert "--max-total-tokens" not in argv


@pytest.mark.parametrize(
    "extra, arch, message",
    [
        (["--hs-layers", "2,9"], "DeepseekV3ForCausalLM", "id 9 is out of range"),
        (["--hs-layers", "4,2"], "DeepseekV3ForCausalLM", "strictly increasing"),
        ([], "LlamaForCausalLM", "unsupported architecture 'LlamaForCausalLM'"),
        ([], "PixtralForConditionalGeneration", "'PixtralForConditionalGeneration'.*inside the Pixtral wrapper"),
        (["--hs-startup-timeout", "0"], "DeepseekV3ForCausalLM", "--hs-startup-timeout: must be > 0"),
        (["--hs-startup-timeout", "nan"], "DeepseekV3ForCausalLM", "--hs-startup-timeout: must be > 0"),
        (["--hs-startup-timeout", "inf"], "DeepseekV3ForCausalLM", "--hs-startup-timeout: must be > 0"),
        (["--hs-admission-timeout", "-1"], "DeepseekV3ForCausalLM", "--hs-admission-timeout: must be >= 0"),
        (["--hs-admission-timeout", "nan"], "DeepseekV3ForCausalLM", "--hs-admission-timeout: must be >= 0"),
        (["--hs-staging-rows", "64"], "DeepseekV3ForCausalLM", "--hs-staging-rows needs --hs-copy staging"),
        (["--hs-copy", "direct", "--hs-staging-rows", "64"], "DeepseekV3ForCausalLM", "needs --hs-copy staging"),
        (["--hs-copy", "staging", "--hs-staging-rows", "0"], "DeepseekV3ForCausalLM",
         "--hs-staging-rows: must be > 0 rows, got 0"),
        (["--hs-gather-threads", "0"], "DeepseekV3ForCausalLM", "--hs-gather-threads: must be > 0 threads, got 0"),
        (["--hs-scatter-threads", "2"], "DeepseekV3ForCausalLM", "--hs-scatter-threads needs --hs-copy staging"),
        (["--hs-copy", "deferred", "--hs-scatter-threads", "2"], "DeepseekV3ForCausalLM",
         r"--hs-scatter-threads needs --hs-copy staging$"),
        (["--hs-copy", "deferred"], "DeepseekV3ForCausalLM",
         r"--hs-copy deferred needs a CUDA device \(this server runs SGLang's CPU engine\)"),
        (["--hs-copy", "staging", "--hs-scatter-threads", "0"], "DeepseekV3ForCausalLM",
         "--hs-scatter-threads: must be > 0 threads, got 0"),
        (["--hs-capture", "some"], "DeepseekV3ForCausalLM", "--hs-capture: all or opt-in, got 'some'"),
        (["--hs-capture-sample", "0"], "DeepseekV3ForCausalLM", "--hs-capture-sample: a fraction 0 < P <= 1"),
        (["--hs-capture-sample", "1.5"], "DeepseekV3ForCausalLM", "--hs-capture-sample: .* got '1.5'"),
        (["--hs-capture-sample", "nan"], "DeepseekV3ForCausalLM", "--hs-capture-sample: a fraction"),
        (["--hs-capture-sample", "10%"], "DeepseekV3ForCausalLM", "--hs-capture-sample: .* got '10%'"),
        (["--hs-when-behind", "drop"], "DeepseekV3ForCausalLM", "--hs-when-behind: hold or skip, got 'drop'"),
        (["--hs-capture-accept-below", "1", "--speculative-algorithm", "NGRAM"], "DeepseekV3ForCausalLM",
         r"--hs-capture-accept-below: an accept length L > 1 .* got '1'"),
        (["--hs-capture-accept-below", "fast", "--speculative-algorithm", "NGRAM"], "DeepseekV3ForCausalLM",
         "--hs-capture-accept-below: an accept length L > 1"),
        (["--hs-capture-accept-below", "1.5"], "DeepseekV3ForCausalLM",
         "--hs-capture-accept-below selects on the draft's accept length: it needs a server that decodes "
         "speculatively"),
    ],
)
def test_prepare_refuses(tmp_path, clean_env, extra, arch, message):
    model = _model_dir(tmp_path, arch=arch)
    with pytest.raises(CaptureConfigError, match=message):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"), *extra])


def test_prepare_refuses_sparse_attention_by_config_under_any_class_name(tmp_path, clean_env):
    """SGLang serves DeepseekV3ForCausalLM (and MistralLarge3ForCausalLM) with DeepSeek Sparse Attention when
    its config sets index_topk: refused like V3.2, one line naming the reason (the class name let it by)."""
    model = _model_dir(tmp_path, arch="DeepseekV3ForCausalLM", index_topk=2048)
    with pytest.raises(CaptureConfigError, match=r"index_topk = 2048 .*DeepSeek Sparse Attention") as e:
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs")])
    assert "\n" not in str(e.value) and f"{model}/config.json" in str(e.value)


@pytest.mark.parametrize("flag", [["--hs-layers", "2"], ["--hs-share-group", "0"], ["--hs-copy", "staging"],
                                  ["--hs-staging-rows", "8"], ["--hs-capture", "opt-in"], ["--hs-capture-sample", "0.1"],
                                  ["--hs-when-behind", "skip"], ["--hs-gather-threads", "4"],
                                  ["--hs-scatter-threads", "2"], ["--hs-capture-accept-below", "1.5"]])
def test_prepare_layers_without_dump_dir(tmp_path, clean_env, flag):
    with pytest.raises(CaptureConfigError, match="need --hs-dump-dir"):
        launch_server.prepare(["--model-path", _model_dir(tmp_path), "--device", "cpu", *flag])


def test_prepare_copy_strategy_reaches_the_server_env(tmp_path, clean_env):
    model = _model_dir(tmp_path)
    def base(name):  # one dump dir per run: prepare() keeps each one locked, as a live server would
        return ["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / name)]

    launch_server.prepare(base("a"))
    assert envs.SGLANG_HS_COPY == "direct" and envs.SGLANG_HS_STAGING_ROWS == 0  # 0: sized by the server
    launch_server.prepare(base("b") + ["--hs-copy", "staging", "--hs-staging-rows", "96"])
    assert envs.SGLANG_HS_COPY == "staging" and envs.SGLANG_HS_STAGING_ROWS == 96
    launch_server.prepare(base("c"))  # a second run in the same environment does not inherit the first's
    assert envs.SGLANG_HS_COPY == "direct" and envs.SGLANG_HS_STAGING_ROWS == 0
    assert envs.SGLANG_HS_GATHER_THREADS == envs.DEFAULT_GATHER_THREADS
    launch_server.prepare(base("d") + ["--hs-gather-threads", "3"])
    assert envs.SGLANG_HS_GATHER_THREADS == 3
    launch_server.prepare(base("e"))
    assert envs.SGLANG_HS_GATHER_THREADS == envs.DEFAULT_GATHER_THREADS
    assert envs.SGLANG_HS_SCATTER_THREADS == envs.DEFAULT_SCATTER_THREADS
    launch_server.prepare(base("f") + ["--hs-copy", "staging", "--hs-scatter-threads", "6"])
    assert envs.SGLANG_HS_SCATTER_THREADS == 6
    launch_server.prepare(base("g"))
    assert envs.SGLANG_HS_SCATTER_THREADS == envs.DEFAULT_SCATTER_THREADS


def test_prepare_capture_selection_reaches_the_server_env(tmp_path, clean_env):
    model = _model_dir(tmp_path)

    def base(name):
        return ["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / name)]

    launch_server.prepare(base("a"))
    assert (envs.SGLANG_HS_CAPTURE, envs.SGLANG_HS_CAPTURE_SAMPLE, envs.SGLANG_HS_WHEN_BEHIND) == ("all", None, "hold")
    launch_server.prepare(base("b") + ["--hs-capture", "opt-in", "--hs-capture-sample", "0.1",
                                       "--hs-when-behind", "skip"])
    assert (envs.SGLANG_HS_CAPTURE, envs.SGLANG_HS_CAPTURE_SAMPLE, envs.SGLANG_HS_WHEN_BEHIND) == ("opt-in", 0.1, "skip")
    launch_server.prepare(base("c"))  # not inherited by the next run in the same environment
    assert (envs.SGLANG_HS_CAPTURE, envs.SGLANG_HS_CAPTURE_SAMPLE, envs.SGLANG_HS_WHEN_BEHIND) == ("all", None, "hold")
    launch_server.prepare(base("d") + ["--speculative-algorithm", "NGRAM", "--hs-capture-accept-below", "1.5"])
    assert envs.SGLANG_HS_CAPTURE_ACCEPT_BELOW == 1.5
    launch_server.prepare(base("e"))
    assert envs.SGLANG_HS_CAPTURE_ACCEPT_BELOW is None
    os.environ["SGLANG_HS_CAPTURE_CONFIDENCE_BELOW"] = "0.5"  # left by a run before, or the caller's environment
    launch_server.prepare(base("f"))
    assert envs.SGLANG_HS_CAPTURE_CONFIDENCE_BELOW is None


def test_every_setting_a_flag_gives_is_cleared_first():
    """Each SGLANG_HS_* setting that prepare() sets from a --hs-* flag is removed from the environment before the
    flags are read, so a value inherited from the caller or an earlier run never reaches a server without its flag
    (the settings a user may give as environment variables, the timeouts and the ring size, excepted)."""
    import inspect
    import re

    source = inspect.getsource(launch_server)
    set_from_flags = set(re.findall(r'env\["(SGLANG_HS_[A-Z_]+)"\] =', source))
    cleared = set(re.search(r"for key in \((.*?)\):\n\s+env.pop\(key, None\)", source, re.S).group(1)
                  .replace('"', "").replace(",", " ").split())
    users = {"SGLANG_HS_RING_SIZE", "SGLANG_HS_ADMISSION_TIMEOUT", "SGLANG_HS_STARTUP_TIMEOUT", "SGLANG_HS_CPU_MODE"}
    assert set_from_flags - users <= cleared, sorted(set_from_flags - users - cleared)


def test_unknown_copy_strategy_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        launch_server.split_argv(["--hs-copy", "zero-copy"])
    assert e.value.code == 2
    assert "--hs-copy: invalid choice: 'zero-copy' (choose from 'direct', 'staging', 'deferred')" in capsys.readouterr().err


def test_prepare_share_group_opens_the_folder_to_the_group_and_back(tmp_path, clean_env):
    model, dump, gid = _model_dir(tmp_path), tmp_path / "hs", os.getegid()
    launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(dump),
                           "--hs-share-group", str(gid)])
    st = os.stat(dump)
    assert oct(st.st_mode & 0o777) == "0o750" and st.st_gid == gid and envs.SGLANG_HS_SHARE_GID == gid
    os.close(launch_server._dump_dir_lock)  # as if that server had exited
    launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(dump)])
    assert oct(os.stat(dump).st_mode & 0o777) == "0o700" and envs.SGLANG_HS_SHARE_GID is None  # private again


def test_prepare_refuses_an_unknown_share_group(tmp_path, clean_env):
    with pytest.raises(CaptureConfigError, match="^--hs-share-group no-such-group-xyz: no such group$"):
        launch_server.prepare(["--model-path", _model_dir(tmp_path), "--device", "cpu", "--hs-dump-dir",
                               str(tmp_path / "hs"), "--hs-share-group", "no-such-group-xyz"])


@pytest.mark.parametrize("kind", ["missing-parent", "file", "symlink"])
def test_prepare_refuses_bad_dump_dir(tmp_path, clean_env, kind):
    model = _model_dir(tmp_path)
    if kind == "missing-parent":
        target, message = tmp_path / "no" / "hs", "parent folder .* does not exist"
    elif kind == "file":
        target, message = tmp_path / "f", "exists and is not a folder"
        target.write_text("x")
    else:
        (tmp_path / "real").mkdir()
        target, message = tmp_path / "link", "is a symlink"
        target.symlink_to(tmp_path / "real")
    with pytest.raises(CaptureConfigError, match=f"--hs-dump-dir .*{message}"):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(target)])


def test_fs_type_of_dev_shm():
    if os.path.isdir("/dev/shm"):
        assert launch_server.fs_type("/dev/shm/anything") == "tmpfs"


def test_refuses_any_other_sglang(tmp_path, clean_env, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.22" if name == "sglang" else "0")
    with pytest.raises(CaptureConfigError, match="runs on sglang 0.5.23 only, found sglang 0.5.22"):
        launch_server.prepare(["--model-path", _model_dir(tmp_path), "--device", "cpu"])


def test_ring_must_hold_one_record_at_the_maximal_context(tmp_path, clean_env, capsys):
    from sglang_hs.server.store.ring import record_bytes

    model = _model_dir(tmp_path, max_position_embeddings=163840)
    need = 2 * record_bytes(163840, 4, 64, 2, 256)  # 3 aux layers + last, bf16: ~168 MB
    def base(n):
        return ["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / f"hs{n}"), "--hs-last"]

    with pytest.raises(CaptureConfigError, match=r"--hs-ring-size: 67108864 bytes cannot hold one record at the "
                                                 r"server's maximal context length \(163840 tokens"):
        launch_server.prepare(base(1) + ["--hs-ring-size", "64MiB"])
    launch_server.prepare(base(2) + ["--hs-ring-size", "64MiB", "--context-length", "32768"])  # a shorter context fits
    assert envs.SGLANG_HS_RING_SIZE == 64 << 20
    assert need < 256 << 20
    launch_server.prepare(base(3) + ["--context-length", "400000"])  # the CPU default (256MiB) grows to one record
    assert envs.SGLANG_HS_RING_SIZE == 2 * record_bytes(400000, 4, 64, 2, 256) > 256 << 20
    assert "room for one record at the server's maximal context length, 400000 tokens" in capsys.readouterr().err


def test_max_record_tokens_lowers_the_rings_floor(tmp_path, clean_env, capsys):
    """--hs-max-record-tokens: the ring need only hold records of that many tokens, not one at the maximal context
    (issue 47: a 128K-context server capturing shorter samples); admission refuses what can never fit (a 400)."""
    from sglang_hs.server.store.ring import record_bytes

    model = _model_dir(tmp_path, max_position_embeddings=163840)

    def base(n, *more):
        return ["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / f"hs{n}"), "--hs-last", *more]

    launch_server.prepare(base(1, "--hs-ring-size", "64MiB", "--hs-max-record-tokens", "32768"))
    assert envs.SGLANG_HS_RING_SIZE == 64 << 20
    err = capsys.readouterr().err
    assert "records of at most ~32768 tokens (--hs-max-record-tokens; the context is 163840)" in err, err
    with pytest.raises(CaptureConfigError, match=r"--hs-ring-size: 67108864 bytes cannot hold one record of "
                                                 r"--hs-max-record-tokens \(100000 tokens x 4 x 64 x 2 bytes, .*; raise "
                                                 r"it to at least .* or lower --hs-max-record-tokens$"):
        launch_server.prepare(base(2, "--hs-ring-size", "64MiB", "--hs-max-record-tokens", "100000"))
    launch_server.prepare(base(3, "--hs-max-record-tokens", "400000", "--context-length", "1000"))  # above: no cap
    assert envs.SGLANG_HS_RING_SIZE == 256 << 20  # the CPU default, which holds a 1000-token record
    assert "--hs-max-record-tokens" not in capsys.readouterr().err
    launch_server.prepare(base(4, "--hs-max-record-tokens", "600000", "--context-length", "700000"))
    assert envs.SGLANG_HS_RING_SIZE == 2 * record_bytes(600000, 4, 64, 2, 256)  # the default grows to the cap only
    assert "room for one record of --hs-max-record-tokens, 600000 tokens" in capsys.readouterr().err
    for n, bad in enumerate(("0", "-3")):
        with pytest.raises(CaptureConfigError, match=rf"^--hs-max-record-tokens: at least 1 token .*got {bad}$"):
            launch_server.prepare(base(5 + n, "--hs-max-record-tokens", bad))
    with pytest.raises(CaptureConfigError, match=r"--hs-max-record-tokens need --hs-dump-dir"):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-max-record-tokens", "10"])


def test_record_part_size_lets_a_ring_smaller_than_a_record_serve_and_needs_attention_tp_1(tmp_path, clean_env):
    """--hs-record-part-size: a long record leaves the ring in parts, so the ring need hold one part of a record at
    the maximal context (all its token ids), twice; refused in one line where a writer's attention group has more
    than one rank (holding a request's KV on one rank alone is not built), and without --hs-dump-dir."""
    from sglang_hs.server.store.ring import record_bytes

    model = _model_dir(tmp_path, max_position_embeddings=163840)

    def base(n, *more):
        return ["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / f"hs{n}"), "--hs-last", *more]

    with pytest.raises(CaptureConfigError, match="cannot hold one record at the server's maximal context"):
        launch_server.prepare(base(1, "--hs-ring-size", "16MiB"))  # whole records: 163840 x 4 x 64 x 2 x 2 > 16 MiB
    launch_server.prepare(base(2, "--hs-ring-size", "16MiB", "--hs-record-part-size", "1MiB"))
    assert envs.SGLANG_HS_RING_SIZE == 16 << 20 and envs.SGLANG_HS_RECORD_PART_BYTES == 1 << 20
    part_rows = (1 << 20) // (4 * 64 * 2)
    launch_server.prepare(base(3, "--hs-record-part-size", "1MiB", "--context-length", "400000"))  # a default ring
    assert envs.SGLANG_HS_RING_SIZE == 256 << 20  # the CPU default holds a part (and all ids) of a 400000-token record
    assert 2 * record_bytes(part_rows, 4, 64, 2, 256, n_ids=400000) < 256 << 20 < 2 * record_bytes(400000, 4, 64, 2, 256)
    launch_server.prepare(base(4, "--hs-record-part-size", "1MiB", "--tp", "2", "--dp", "2", "--enable-dp-attention"))
    launch_server.prepare(base(10, "--hs-record-part-size", "1MiB", "--tp", "2", "--attn-dp-size", "2"))
    for n, tp in enumerate((["--tp", "2"], ["--tp", "4", "--dp", "2", "--enable-dp-attention"], ["--tp", "2", "--dp", "2"],
                            ["--tp", "4", "--attn-dp-size", "2"])):
        with pytest.raises(CaptureConfigError, match=r"^--hs-record-part-size with --tp \d.*: attention TP 2; records in "
                                                     r"parts need attention TP 1 .*not built$"):
            launch_server.prepare(base(11 + n, "--hs-record-part-size", "1MiB", *tp))
    for n, flag in enumerate(("--enable-streaming-session", "--enable-memory-saver")):
        with pytest.raises(CaptureConfigError, match=rf"^--hs-record-part-size with {flag}: .*; drop one of them$"):
            launch_server.prepare(base(15 + n, "--hs-record-part-size", "1MiB", flag))
    os.environ["SGLANG_HS_SYNC_FINISH"] = "1"
    try:
        with pytest.raises(CaptureConfigError, match=r"^--hs-record-part-size with SGLANG_HS_SYNC_FINISH=1: "):
            launch_server.prepare(base(17, "--hs-record-part-size", "1MiB"))
    finally:
        del os.environ["SGLANG_HS_SYNC_FINISH"]
    with pytest.raises(CaptureConfigError, match=r"^--hs-record-part-size: 100 bytes is less than one token's rows "
                                                 r"\(4 x 64 x 2 = 512 bytes\)"):
        launch_server.prepare(base(18, "--hs-record-part-size", "100"))
    with pytest.raises(CaptureConfigError, match=r"^--hs-record-part-size: must be more than 0 bytes, got '0'$"):
        launch_server.prepare(base(9, "--hs-record-part-size", "0"))
    with pytest.raises(CaptureConfigError, match=r"--hs-record-part-size/.* need --hs-dump-dir"):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-record-part-size", "1MiB"])


def test_a_speculative_servers_ring_holds_the_drafts_metadata_too(tmp_path, clean_env):
    """A speculative server's records also hold each verify step's accepted drafts (admission.meta_bound): the
    ring's floor counts them, so a request at the maximal context is never refused as oversized (issue 47)."""
    from sglang_hs.server.store.admission import meta_bound
    from sglang_hs.server.store.ring import record_bytes

    model = _model_dir(tmp_path, max_position_embeddings=400000)
    launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                           "--hs-last", "--speculative-algorithm", "NGRAM"])
    assert envs.SGLANG_HS_RING_SIZE == 2 * record_bytes(400000, 4, 64, 2, 256, meta_bound(400000))


def test_ring_larger_than_the_filesystem_is_refused(tmp_path, clean_env):
    model = _model_dir(tmp_path)
    with pytest.raises(CaptureConfigError, match=r"--hs-ring-size: 102400.00GiB does not fit the .*iB free"):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                               "--hs-ring-size", "100TiB"])


def test_prepare_reads_a_mistral_native_folder_with_sglangs_parser(tmp_path, clean_env):
    """Mistral Large 3 ships params.json, no config.json: the launcher reads it as SGLang will, so the
    architecture check, default layer ids and ring size see MistralLarge3ForCausalLM's 8 layers."""
    from sglang_hs.tools import tiny_model

    ckpt = tiny_model.ensure("mistral-large-3")
    argv, dump = launch_server.prepare(["--model-path", ckpt, "--device", "cpu", "--hs-dump-dir",
                                        str(tmp_path / "hs"), "--hs-last"])
    assert os.environ["SGLANG_HS_LAYERS"] == "2,4,5" and os.environ["SGLANG_HS_LAST"] == "post-norm"
    broken = tmp_path / "mistral-large-3-broken"
    broken.mkdir()
    (broken / "params.json").write_text(json.dumps({"dim": 8, "moe": {"num_shared_experts": 1}}))
    with pytest.raises(CaptureConfigError, match="cannot read .*params.json"):
        launch_server.prepare(["--model-path", str(broken), "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs2")])


def test_prepare_serves_kimi_k25_text_only_and_sizes_from_its_text_config(tmp_path, clean_env):
    """Kimi-K2.5 keeps its sizes in text_config; the launcher serves it with language_model_only merged
    into the user's --json-model-override-args (SGLang's --language-model-only refuses this class)."""
    from sglang_hs.tools import tiny_model

    ckpt = tiny_model.ensure("kimi-k25")
    argv, _ = launch_server.prepare(["--model-path", ckpt, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                                     "--context-length", "4096", "--json-model-override-args", '{"x": 1}'])
    assert os.environ["SGLANG_HS_LAYERS"] == "2,4,5" and "--language-model-only" not in argv
    assert argv.count("--json-model-override-args") == 1
    assert json.loads(argv[argv.index("--json-model-override-args") + 1]) == {"x": 1, "language_model_only": True}
    assert launch_server.text_only(["--a", "--json-model-override-args={}"]) == [
        "--a", "--json-model-override-args", '{"language_model_only": true}']


@pytest.mark.parametrize("value", ["0", "abc", "nan", "-5", "inf"])
def test_an_inherited_startup_timeout_is_checked_as_the_flag_is(tmp_path, clean_env, value):
    """SGLANG_HS_STARTUP_TIMEOUT from the environment (no flag): one line naming the variable, not a traceback
    from float(), nor a supervisor that gives up at once (0) or never (nan)."""
    os.environ["SGLANG_HS_STARTUP_TIMEOUT"] = value
    with pytest.raises(CaptureConfigError, match=rf"^SGLANG_HS_STARTUP_TIMEOUT='{value}': expected seconds > 0 "
                                                 r"\(inherited from the environment"):
        launch_server.prepare(["--model-path", _model_dir(tmp_path), "--device", "cpu", "--hs-dump-dir",
                               str(tmp_path / "hs")])
    os.environ["SGLANG_HS_STARTUP_TIMEOUT"] = "30"
    assert envs.SGLANG_HS_STARTUP_TIMEOUT == 30.0


def test_test_switches_are_ignored_without_their_gate(clean_env):
    """SGLANG_HS_TEST_* (a planted hang, a delay, a broken overlay) inherited by a production server are
    ignored, and named by ignored_test_switches (the launcher prints them); honoured with SGLANG_HS_TESTING=1."""
    os.environ.update({"SGLANG_HS_TEST_FINISH_DELAY": "5", "SGLANG_HS_TEST_HANG_PHASE": "load",
                       "SGLANG_HS_TEST_BREAK_OVERLAY": "1"})
    assert (envs.SGLANG_HS_TEST_FINISH_DELAY, envs.SGLANG_HS_TEST_HANG_PHASE, envs.SGLANG_HS_TEST_BREAK_OVERLAY) == \
        (0.0, None, False)
    assert envs.ignored_test_switches() == ["SGLANG_HS_TEST_BREAK_OVERLAY", "SGLANG_HS_TEST_FINISH_DELAY",
                                            "SGLANG_HS_TEST_HANG_PHASE"]
    os.environ["SGLANG_HS_TESTING"] = "1"
    assert (envs.SGLANG_HS_TEST_FINISH_DELAY, envs.SGLANG_HS_TEST_HANG_PHASE, envs.SGLANG_HS_TEST_BREAK_OVERLAY) == \
        (5.0, "load", True)
    assert envs.ignored_test_switches() == []


def test_a_bad_number_in_the_environment_names_the_variable(clean_env):
    os.environ["SGLANG_HS_RING_SIZE"] = "1GB"
    with pytest.raises(envs.EnvError, match=r"^SGLANG_HS_RING_SIZE='1GB': expected an integer$"):
        envs.SGLANG_HS_RING_SIZE


@pytest.mark.parametrize("ratios", [None, [0, 2, 128, 0], [1, 0]])
def test_prepare_refuses_other_deepseek_v4_layers_on_the_cpu_engine_in_one_line(tmp_path, clean_env, ratios):
    """The CPU-engine patches serve compress ratios 0, 4 and 128: a config with V4.1's ratios 1 / 2 (or without
    compress_ratios) is refused before any server starts."""
    extra = {} if ratios is None else {"compress_ratios": ratios}
    model = _model_dir(tmp_path, arch="DeepseekV4ForCausalLM", hc_mult=4, index_topk=8, **extra)
    with pytest.raises(CaptureConfigError, match=r"^DeepseekV4ForCausalLM: SGLang 0.5.23 serves DeepSeek-V4 on CUDA "
                                                 r"only, and sglang-hs's CPU-engine patches serve only compress_ratios "
                                                 r"0, 4 and 128") as e:
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs")])
    assert "\n" not in str(e.value)


def _v4_refused(tmp_path, flags, pattern):
    """The launcher refuses a small V4 (4 query heads, 2 output groups) served with `flags` on the CPU engine in
    one line matching `pattern`."""
    model = _model_dir(tmp_path, arch="DeepseekV4ForCausalLM", layers=4, hc_mult=4, compress_ratios=[0, 0, 0, 0],
                       num_attention_heads=4, o_groups=2)
    with pytest.raises(CaptureConfigError, match=pattern) as e:
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                               "--hs-layers", "1,3", *flags])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, named", [(["--attention-data-parallel-size", "2"], "--attention-data-parallel-size 2"),
                                          (["--pipeline-parallel-size=2"], "--pipeline-parallel-size 2"),
                                          (["--tp", "2", "--attn-cp-size", "2"], "--attn-cp-size 2")])
def test_prepare_refuses_deepseek_v4_on_other_cpu_parallelism_in_one_line(tmp_path, clean_env, flags, named):
    """Tensor parallel and DP attention only: pipeline and context parallel are refused, naming the flag."""
    _v4_refused(tmp_path, flags, rf"^{named} with DeepseekV4ForCausalLM on the CPU engine: sglang-hs's V4 CPU patches "
                                 r"serve tensor parallel \(--tp\) and DP attention \(--dp --enable-dp-attention\) only")


def test_prepare_refuses_deepseek_v4_dp_without_dp_attention_on_the_cpu_engine_in_one_line(tmp_path, clean_env):
    """--dp without --enable-dp-attention (whole model replicas behind SGLang's DP controller) is refused, naming
    the flag; with it the V4 server runs (tests/e2e/test_v4_cpu.py's DP-attention test)."""
    _v4_refused(tmp_path, ["--tp", "2", "--dp", "2"], r"^--dp 2 with DeepseekV4ForCausalLM on the CPU engine: "
                                                      r"sglang-hs's V4 CPU patches serve data parallel as DP attention only")


@pytest.mark.parametrize("flags, pattern", [
    (["--tp", "4", "--dp", "2", "--enable-dp-attention"], r"^--dp 2 with --tp 4 and --enable-dp-attention, "
                                                           r"DeepseekV4ForCausalLM on the CPU engine: .* --dp equal to --tp"),
    (["--tp", "2", "--ep-size", "2"], r"^--ep-size 2 with DeepseekV4ForCausalLM on the CPU engine: .*; drop it$")])
def test_prepare_refuses_untested_deepseek_v4_layouts_in_one_line(tmp_path, clean_env, flags, pattern):
    """Attention tensor parallel inside a DP-attention group (upstream's extra reduce in _project_wo_b) and expert
    parallel with V4's hash-routed layers have not run on the CPU engine: refused, naming the flag (review)."""
    _v4_refused(tmp_path, flags, pattern)


@pytest.mark.parametrize("flags", [["--tp", "3"], ["--tp-size=8"], ["--tensor-parallel-size", "4"]])
def test_prepare_refuses_a_deepseek_v4_tp_split_of_partial_heads_in_one_line(tmp_path, clean_env, flags):
    """--tp must divide the query heads and wo_a's output groups (4 and 2 here: --tp 2 is served,
    tests/e2e/test_v4_cpu.py's csa-tp2)."""
    tp = flags[-1].split("=")[-1]
    _v4_refused(tmp_path, flags, rf"^--tp {tp} with DeepseekV4ForCausalLM on the CPU engine: DeepSeek-V4 attention "
                                 rf"tensor parallel {tp}: its 4 query heads and 2 output groups \(o_groups\) must both "
                                 r"divide by it")


def test_prepare_refuses_a_quantized_deepseek_v4_on_the_cpu_engine_in_one_line(tmp_path, clean_env):
    """The CPU patches read unquantized weights: a released (FP8) checkpoint would be read without its scales."""
    model = _model_dir(tmp_path, arch="DeepseekV4ForCausalLM", layers=4, hc_mult=4, compress_ratios=[0, 4, 128, 4],
                       quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(CaptureConfigError, match=r"^DeepseekV4ForCausalLM with quantization_config \(fp8\) on the CPU "
                                                 r"engine: sglang-hs's V4 CPU patches read unquantized weights only") as e:
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                               "--hs-layers", "1,3"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("ratios", [[0, 0, 0, 0], [0, 128, 0, 128], [0, 4, 128, 4]])
def test_prepare_serves_sliding_and_hca_deepseek_v4_on_the_cpu_engine(tmp_path, clean_env, ratios):
    """Sliding-window and heavily compressed layers: served on the CPU engine (the patches dsv4_* serve them;
    tests/e2e/test_v4_cpu.py)."""
    model = _model_dir(tmp_path, arch="DeepseekV4ForCausalLM", layers=4, hc_mult=4, compress_ratios=ratios)
    launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                           "--hs-layers", "1,3", "--hs-ring-size", "64MiB"])
    assert os.environ["SGLANG_HS_CPU_MODE"] == "1" and os.environ["SGLANG_HS_LAYERS"] == "1,3"


def test_prepare_refuses_speculative_capture_beyond_the_mla_family_in_one_line(tmp_path, clean_env):
    """Speculative capture is proven on the V2/V3 family's MLA pools (tests/e2e/test_speculative.py), V3.2's MTP
    chain and V4's on the CPU engine; V4 on a GPU is not, so the pair is refused before any model loads."""
    arch = "DeepseekV4ForCausalLM"
    model = _model_dir(tmp_path, arch=arch, hc_mult=4, index_topk=8)
    with pytest.raises(CaptureConfigError, match=rf"^--speculative-algorithm NGRAM with {arch}: capture under "
                                                 r"speculative decoding is not served on a GPU .* it is proven for "
                                                 r"DeepSeek-V2/V3") as e:
        launch_server.prepare(["--model-path", model, "--device", "cuda", "--hs-dump-dir", str(tmp_path / "hs"),
                               "--speculative-algorithm", "NGRAM"])
    assert "\n" not in str(e.value)


def test_v4_speculative_capture_is_its_mtp_chain_on_the_cpu_engine(monkeypatch):
    """DeepSeek-V4 decodes speculatively with capture with its MTP draft (EAGLE/NEXTN) drafting a chain (top-k 1, N
    steps, N + 1 draft tokens) or its DSpark draft (DSPARK, the draft's path given) on the CPU engine only, on one
    rank (dsv4_cpu_spec, dsv4_cpu_dspark); every other algorithm, shape or device is refused in one line, and DSPARK
    for any other model."""
    chain = ["--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
    arch = "DeepseekV4ForCausalLM"
    for algorithm in ("EAGLE", "NEXTN"):
        assert launch_server.speculative_refusal(arch, algorithm, chain, cpu=True, model_path="/m") == ""
    assert launch_server.speculative_refusal("DeepseekV3ForCausalLM", "NGRAM", [], cpu=True, model_path="/m") == ""
    longer = chain[:1] + ["3"] + chain[2:5] + ["4"]  # DeepSeek's production MTP setting: a chain of 3
    assert launch_server.speculative_refusal(arch, "EAGLE", longer, cpu=True, model_path="/m") == ""
    for ranks in (["--tp", "2"], ["--dp-size", "2", "--enable-dp-attention"], ["--attn-dp-size", "2"]):
        line = launch_server.speculative_refusal(arch, "EAGLE", chain + ranks, cpu=True, model_path="/m")
        assert "served on one rank only" in line and "\n" not in line, line
    for argv in (chain[2:], chain[:3] + ["2"] + chain[4:], longer[:5] + ["3"], chain[:1] + ["0"] + chain[2:5] + ["1"]):
        line = launch_server.speculative_refusal(arch, "EAGLE", argv, cpu=True, model_path="/m")
        assert line.startswith("--speculative-algorithm EAGLE with DeepseekV4ForCausalLM: capture is served with its "
                               "MTP draft drafting a chain only") and "\n" not in line, line
    dspark = ["--speculative-draft-model-path", "/draft"]  # V4's DSpark draft (dsv4_cpu_dspark), one rank
    assert launch_server.speculative_refusal(arch, "DSPARK", dspark, cpu=True, model_path="/m") == ""
    for argv, why in ((dspark + ["--tp", "2"], "served on one rank only"), ([], "needs a draft checkpoint of its own"),
                      (["--speculative-draft-model-path", "/m"], "bundled in the target's checkpoint"),  # bundled drafts
                      (["--speculative-draft-model-path", "/m/dspark/"], "bundled in the target's checkpoint")):
        line = launch_server.speculative_refusal(arch, "DSPARK", argv, cpu=True, model_path="/m")
        assert why in line and "\n" not in line, line
    for mode, served in (("static", True), ("", True), ("cap-accept", True), ("compact", False)):  # ragged windows
        monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
        line = launch_server.speculative_refusal(arch, "DSPARK", dspark, cpu=True, model_path="/m")
        assert line == "" if served else ("SGLANG_RAGGED_VERIFY_MODE=compact" in line and "\n" not in line), line
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE")
    for model, cpu in (("DeepseekV3ForCausalLM", True), ("DeepseekV32ForCausalLM", True), (arch, False)):
        line = launch_server.speculative_refusal(model, "DSPARK", dspark, cpu=cpu, model_path="/m")
        assert line and "\n" not in line, (model, line)
    for algorithm, argv in (("NGRAM", chain), ("EAGLE3", chain),
                            ("EAGLE", chain + ["--speculative-draft-model-path", "/another"])):
        line = launch_server.speculative_refusal(arch, algorithm, argv, cpu=True, model_path="/m")
        assert line.startswith(f"--speculative-algorithm {algorithm} with {arch}: capture under speculative decoding "
                               "is proven for") and "\n" not in line, line
    v32 = "DeepseekV32ForCausalLM"  # V3.2: its MTP draft drafting a chain (dsa_speculative_served), --tp allowed
    for argv in (chain, longer):
        assert launch_server.speculative_refusal(v32, "EAGLE", argv, True, "/m") == ""
        assert launch_server.speculative_refusal(v32, "EAGLE", argv + ["--tp", "2"], True, "/m") == ""
    tree = chain[:3] + ["2"] + chain[4:5] + ["3"]
    assert "drafting a chain only" in launch_server.speculative_refusal(v32, "EAGLE", tree, True, "/m")
    # data parallelism, in any spelling (--attn-dp-size is SGLang 0.5.23's own for DP attention)
    for ranks in (["--dp", "2", "--enable-dp-attention"], ["--tp", "2", "--attn-dp-size", "2"], ["--dp-size", "2"]):
        line = launch_server.speculative_refusal(v32, "EAGLE", chain + ranks, True, "/m")
        assert "served without data parallelism only" in line and "\n" not in line, (ranks, line)
    for model in (arch, v32):  # a GPU, or a setting that changes the proven chain, in one line each
        for argv, cpu, why in ((chain, False, "is not served on a GPU"),
                               (chain + ["--speculative-adaptive"], True, "is not served with --speculative-adaptive"),
                               (chain + ["--enable-multi-layer-eagle"], True,
                                "is not served with --enable-multi-layer-eagle")):
            line = launch_server.speculative_refusal(model, "EAGLE", argv, cpu, "/m")
            assert why in line and "\n" not in line, (model, argv, line)


MTP_ONE_STEP = ["--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
MTP_THREE_STEPS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                   "4"]  # DeepSeek's production MTP setting


@pytest.mark.parametrize("spec", [
    ["--speculative-algorithm", "NGRAM"],
    ["--speculative-algorithm", "EAGLE3", *MTP_ONE_STEP],
    ["--speculative-algorithm", "EAGLE"],  # SGLang's defaults would pick the steps
    ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
     "--speculative-num-draft-tokens", "3"],  # not a chain of 3 (that verifies 4 tokens)
    ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1", "--speculative-eagle-topk", "2",
     "--speculative-num-draft-tokens", "3"],  # a tree: SGLang's GPU DSA verify attends it causally by row
    ["--speculative-algorithm", "EAGLE", *MTP_ONE_STEP, "--speculative-draft-model-path", "/elsewhere"],
])
def test_prepare_serves_v32_speculative_capture_for_its_mtp_chain_only(tmp_path, clean_env, spec):
    """DeepSeek-V3.2 (DSA) under speculative decoding: its MTP draft drafting a chain (patches/dsa_spec_verify.py,
    eagle_cpu_draft.py; tests/e2e/test_model_family.py "v32-tp2" runs 3 steps); every other setting is refused in one
    line before any model loads."""
    arch = "DeepseekV32ForCausalLM"
    model = _model_dir(tmp_path, arch=arch, index_topk=8)
    with pytest.raises(CaptureConfigError, match=rf"^--speculative-algorithm {spec[1]} with {arch}: capture under "
                                                 r"speculative decoding with DSA's sparse attention is served for the "
                                                 r"model's MTP draft drafting a chain only") as e:
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                               *spec])
    assert "\n" not in str(e.value)
    for algorithm, draft, steps in (("EAGLE", [], MTP_ONE_STEP), ("NEXTN", ["--speculative-draft-model-path", model],
                                                                   MTP_THREE_STEPS)):
        launch_server.prepare(["--model-path", model, "--device", "cpu", "--hs-dump-dir", str(tmp_path / algorithm),
                               "--hs-ring-size", "64MiB", "--speculative-algorithm", algorithm, *steps, *draft])


@pytest.mark.parametrize("streams, rows", [(None, 3), ("full", 9)])
def test_prepare_deepseek_v4_streams_reach_the_overlay(tmp_path, clean_env, streams, rows):
    from sglang_hs.server.capture_spec import CaptureSpec

    model = _model_dir(tmp_path, arch="DeepseekV4ForCausalLM", hc_mult=4, index_topk=8)
    launch_server.prepare(["--model-path", model, "--device", "cuda", "--hs-dump-dir", str(tmp_path / "hs"),
                           "--hs-layers", "1,3", "--hs-last", "--hs-ring-size", "64MiB"]
                          + (["--hs-hc-streams", streams] if streams else []))
    assert os.environ["SGLANG_HS_HC_STREAMS"] == (streams or "mean")
    # what the overlay resolves in the server's processes
    spec = CaptureSpec.resolve(envs.SGLANG_HS_LAYERS, envs.SGLANG_HS_LAST, 8, 64, hc_mult=4,
                               streams=envs.SGLANG_HS_HC_STREAMS)
    assert spec.rows_per_token == rows


def test_prepare_refuses_hc_streams_for_a_model_without_them(tmp_path, clean_env):
    with pytest.raises(CaptureConfigError, match=r"^--hs-hc-streams: only for models with hyper-connections"):
        launch_server.prepare(["--model-path", _model_dir(tmp_path), "--device", "cpu", "--hs-dump-dir",
                               str(tmp_path / "hs"), "--hs-hc-streams", "full"])
    (tmp_path / "b").mkdir()
    with pytest.raises(CaptureConfigError, match="need --hs-dump-dir"):
        launch_server.prepare(["--model-path", _model_dir(tmp_path / "b"), "--device", "cpu", "--hs-hc-streams",
                               "mean"])


def test_the_gpu_probe_without_torch_answers_only_where_no_driver_is(monkeypatch):
    """cuda_available() skips torch's import (~1.5 s a CPU start) only where neither a GPU node nor a GPU driver
    library exists; a node (a Jetson's nvgpu ones included) or a driver library alone leaves the answer to torch."""
    import ctypes.util

    asked = []
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda lib: asked.append(lib) or None)
    assert launch_server.no_gpu_driver() and asked == ["cuda", "amdhip64"]
    monkeypatch.setattr(ctypes.util, "find_library", lambda lib: "libcuda.so.1" if lib == "cuda" else None)
    assert not launch_server.no_gpu_driver()  # a driver whose module loads at the first cuInit: torch decides
    monkeypatch.setattr(ctypes.util, "find_library", lambda lib: None)
    for node in ("/dev/nvhost-ctrl", "/dev/kfd", "/dev/nvidiactl"):
        monkeypatch.setattr(os.path, "exists", lambda p, node=node: p == node)
        assert not launch_server.no_gpu_driver(), node
