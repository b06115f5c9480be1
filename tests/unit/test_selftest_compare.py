"""The self-test's verdict logic (sglang_hs/tools/selftest.py): every row is judged. It passes equal captures,
bf16 rounding, and on a half-precision server a few rows off the way MoE routing near-ties put them (at
most 5%, each still far closer to its own reference row than to any other); it fails a single row from
another token, layer or record anywhere, any far row on a float32 server, too many far rows, a drift of
every row, rows shifted by one position, another layer's rows, noise beyond bf16 tolerance, and
differing token ids or counts. (tests/e2e/test_selftest.py runs the whole self-test on the server.)"""
import os

import pytest
import torch

from sglang_hs.tools.selftest import FAR_SHARE, Capture, compare, make_prompts


def _captures(seed=0, n=3, T=20, K=3, H=64):
    g = torch.Generator().manual_seed(seed)
    return [Capture(list(range(5, 5 + T + i)), torch.randn(T + i, K, H, generator=g), torch.randn(T + i, H, generator=g))
            for i in range(n)]


def _map(caps, fn_aux, fn_last=lambda x: x, ids=lambda x: x):
    return [Capture(ids(c.token_ids), fn_aux(c.aux), fn_last(c.last)) for c in caps]


def _one_row(caps, i, fn):
    """caps with record i's rows replaced by fn(record, aux, last) -> (aux, last), the others untouched."""
    out = list(caps)
    c = caps[i]
    aux, last = fn(c, c.aux.clone(), c.last.clone())
    out[i] = Capture(c.token_ids, aux, last)
    return out


def _near_tie(caps, tokens, err=0.3, seed=1):
    """A routing near-tie at token t of record 0: its later layers and final state off by `err` (relative),
    in a random direction; its first layer untouched (before the flip)."""
    g = torch.Generator().manual_seed(seed)

    def fn(c, aux, last):
        for t in tokens:
            for row in [aux[t, 1], aux[t, 2], last[t]]:
                d = torch.randn(row.shape, generator=g)
                row += err * row.norm() * d / d.norm()
        return aux, last

    return _one_row(caps, 0, fn)


def test_equal_and_bf16_rounded_captures_pass():
    ref = _captures()
    assert compare(ref, ref)[0] and compare(ref, ref, "float32")[0]
    ok, row = compare(_map(ref, lambda a: a.bfloat16(), lambda x: x.bfloat16()), ref)
    assert ok and row["median"] < 0.01 and row["rows"] == 20 + 21 + 22 and row["far"] == 0
    assert not compare(_map(ref, lambda a: a.bfloat16(), lambda x: x.bfloat16()), ref, "float32")[0]  # ~0.003 > 1e-3


@pytest.mark.parametrize("where", ["another token", "another layer", "another record", "the final state's",
                                   "the last token's final state from the token before"])
def test_a_single_wrong_row_anywhere_fails(where):
    ref = _captures()

    def fn(c, aux, last):
        if where == "another token":
            aux[7, 1] = c.aux[8, 1]
        elif where == "another layer":
            aux[7, 1] = c.aux[7, 2]
        elif where == "another record":
            aux[7, 1] = ref[2].aux[7, 1]
        elif where == "the final state's":
            aux[0, 0] = c.last[0]
        else:
            last[-1] = c.last[-2]
        return aux, last

    ok, row = compare(_one_row(ref, 1, fn), ref)
    assert not ok and row["far"] == 1 and row["unlike"] == 1, row
    assert row["median"] == 0.0  # what a median-only verdict would have passed


def test_near_tie_rows_pass_in_half_precision_only_and_only_a_few():
    ref = _captures()
    rows = sum(c.aux.shape[0] * 4 for c in ref)
    ok, row = compare(_near_tie(ref, [4, 11]), ref)
    assert ok and row["far"] == 6 and row["unlike"] == 0, row
    assert compare(_near_tie(ref, [4, 11]), ref, "float16")[0]
    assert not compare(_near_tie(ref, [4]), ref, "float32")[0]  # a float32 server gets no allowance
    many = [t for t in range(20) if t % 2]  # 10 tokens x 3 rows = 30 far rows > 5% of 252
    assert 3 * len(many) > FAR_SHARE * rows
    ok, row = compare(_near_tie(ref, many), ref)
    assert not ok and row["far"] == 30 and row["unlike"] == 0, row


def test_a_far_row_not_closer_to_its_own_fails_even_alone():
    ref = _captures()
    ok, row = compare(_near_tie(ref, [4], err=1.0), ref)  # off by its own size: nothing says it is that token's
    assert not ok and row["unlike"] >= 1, row


def test_every_row_a_little_off_fails_the_median():
    ref = _captures()
    g = torch.Generator().manual_seed(3)

    def drift(a):
        d = torch.randn(a.shape, generator=g)
        return a + 0.03 * a.norm(dim=-1, keepdim=True) * d / d.norm(dim=-1, keepdim=True)

    ok, row = compare(_map(ref, drift, drift), ref)
    assert not ok and row["far"] == 0 and row["median"] > 0.02, row


def test_off_by_one_rows_fail():
    ref = _captures()
    shifted = _map(ref, lambda a: torch.cat([a[:1], a[:-1]]))
    assert not compare(shifted, ref)[0]


def test_another_layers_rows_fail():
    ref = _captures()
    assert not compare(_map(ref, lambda a: a.roll(1, dims=1)), ref)[0]


def test_noise_beyond_tolerance_fails():
    ref = _captures()
    assert not compare(_map(ref, lambda a: a + 0.1 * torch.randn_like(a)), ref)[0]


def test_repeated_tokens_with_identical_reference_rows_pass():
    """The embedding layer of a repeated token: neighbouring reference rows equal, nothing to tell apart."""
    ref = _captures(n=1)
    c = ref[0]
    aux = c.aux.clone()
    aux[5:8, 0] = aux[5, 0]
    ref = [Capture(c.token_ids, aux, c.last)]
    assert compare(_map(ref, lambda a: a.bfloat16(), lambda x: x.bfloat16()), ref)[0]


def test_different_token_ids_or_counts_fail():
    ref = _captures()
    assert not compare(_map(ref, lambda a: a, ids=lambda t: t[:-1] + [t[-1] + 1]), ref)[0]
    assert not compare(_map(ref, lambda a: a[:-1], lambda x: x[:-1]), ref)[0]
    assert not compare(ref[:2], ref)[0]


def test_prompts_cover_shared_prefixes_and_a_repeat_within_the_vocabulary():
    p = make_prompts(1000)
    assert p[4][:30] == p[3][:30] == p[5][:30] and p[6] == p[2]
    assert all(5 <= t < 1000 for q in p for t in q)


def test_the_users_hs_flags_reach_every_run_and_the_staging_ones_only_staging_runs():
    """selftest passes the user's --hs-* flags (but the dump dir) to every server it starts; those of
    --hs-copy staging only to the runs with staging, which the launcher would refuse otherwise."""
    from sglang_hs.tools.launch_server import split_argv
    from sglang_hs.tools.selftest import _hs_flags

    ns, _ = split_argv(["--model-path", "m", "--hs-last", "--hs-gather-threads", "3", "--hs-ring-size", "1GiB",
                        "--hs-copy", "staging", "--hs-staging-rows", "64", "--hs-scatter-threads", "2"])
    assert _hs_flags(ns) == ["--hs-last", "post-norm", "--hs-copy", "staging", "--hs-staging-rows", "64", "--hs-scatter-threads",
                             "2", "--hs-ring-size", "1GiB", "--hs-gather-threads", "3"]
    assert _hs_flags(ns, copy="direct") == ["--hs-last", "post-norm", "--hs-copy", "direct", "--hs-ring-size", "1GiB",
                                            "--hs-gather-threads", "3"]
    assert _hs_flags(ns, copy="deferred") == ["--hs-last", "post-norm", "--hs-copy", "deferred", "--hs-staging-rows", "64",
                                              "--hs-ring-size", "1GiB", "--hs-gather-threads", "3"]


def test_every_other_copy_strategy_is_run_deferred_only_on_a_gpu():
    from sglang_hs.tools.selftest import other_copies

    assert other_copies(None, cpu=True) == ["staging"]
    assert other_copies(None, cpu=False) == ["staging", "deferred"]
    assert other_copies("staging", cpu=True) == ["direct"]
    assert other_copies("deferred", cpu=False) == ["direct", "staging"]


def test_hs_hc_streams_reaches_every_run():
    """--hs-hc-streams full (DeepSeek-V4) was dropped: every configuration would have captured the mean."""
    from sglang_hs.tools.launch_server import split_argv
    from sglang_hs.tools.selftest import _hs_flags

    ns, _ = split_argv(["--model-path", "m", "--hs-hc-streams", "full", "--hs-last", "both"])
    assert _hs_flags(ns) == ["--hs-last", "both", "--hs-hc-streams", "full"]
    assert _hs_flags(ns, copy="staging")[:4] == ["--hs-last", "both", "--hs-hc-streams", "full"]


@pytest.fixture
def no_server(monkeypatch):
    """The self-test's servers, recorded instead of started: a refusal must come before any."""
    import sglang_hs.tools.selftest as st

    started = []

    def run_capture(name, *a, **kw):
        started.append(name)
        raise RuntimeError("a server was started")

    monkeypatch.setattr(st, "run_capture", run_capture)
    return started


def _v4_folder(tmp_path, **extra):
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": 8,
           "hidden_size": 88, "hc_mult": 4, "vocab_size": 300, **extra}
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("streams", [[], ["--hs-hc-streams", "full"]])
def test_a_v4_the_cpu_engine_cannot_serve_is_refused_in_one_line_before_any_server(tmp_path, capsys, no_server,
                                                                                   streams):
    from sglang_hs.tools.selftest import main

    for extra in ({}, {"compress_ratios": [0, 1, 2, 0, 4, 128, 0, 0]}):  # none, or V4.1's ratios 1 and 2
        assert main(["--model-path", _v4_folder(tmp_path, **extra), "--device", "cpu", *streams]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("sglang-hs selftest: error: DeepseekV4ForCausalLM: SGLang 0.5.23 "
                                                   "serves DeepSeek-V4 on CUDA only"), err
        assert err[0].endswith("run the self-test on a GPU node") and no_server == []


def test_a_v4_the_cpu_engine_serves_reaches_the_servers(tmp_path, capsys, no_server, monkeypatch):
    """Sliding-window, CSA and HCA layers (compress ratios 0, 4, 128): served by the CPU-engine patches, so the
    self-test runs its configurations (served for real by tests/e2e/test_selftest.py). Its work folder, empty when
    no server wrote a log, is not left behind (it was, in /dev/shm, on every run of this test)."""
    import tempfile

    import sglang_hs.tools.selftest as st

    made, real = [], tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real(dir=str(tmp_path)))
        return made[-1]

    monkeypatch.setattr(st.tempfile, "mkdtemp", mkdtemp)
    assert st.main(["--model-path", _v4_folder(tmp_path, compress_ratios=[0, 4, 128, 0, 4, 128, 0, 0]),
                    "--device", "cpu", "--only", "chunked-16"]) == 1
    assert no_server == ["reference"], capsys.readouterr()
    assert len(made) == 1 and not os.path.exists(made[0])
    assert capsys.readouterr().err.strip() == "sglang-hs selftest: error: a server was started"


def test_hs_hc_streams_for_a_model_without_streams_is_refused_before_any_server(capsys, no_server):
    from sglang_hs.tools import tiny_model
    from sglang_hs.tools.selftest import main

    tiny_model.ensure()  # on a cold cache, its shards' progress bar is not the refusal's output
    capsys.readouterr()
    assert main(["--hs-hc-streams", "full", "--device", "cpu"]) == 2  # the embedded DeepSeek-V3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sglang-hs selftest: error: --hs-hc-streams: only for models with hyper-connections "
                   "(DeepseekV4ForCausalLM, hc_mult > 1); this model has one residual stream"], err
    assert no_server == []


@pytest.mark.parametrize("argv, rest, only", [
    (["--hs-last"], ["--hs-last"], None),
    (["--only", "sglang-json", "--tp", "2"], ["--tp", "2"], {"sglang-json"}),
    (["--only=copy-staging,chunked-16", "--hs-last"], ["--hs-last"], {"copy-staging", "chunked-16"}),
    (["--only", "plain-scheduler", "--only", "no-cuda-graph"], [], {"plain-scheduler", "no-cuda-graph"}),
    (["--hs-copy", "staging", "--only", "copy-direct"], ["--hs-copy", "staging"], {"copy-direct"}),
])
def test_only_picks_configurations_and_leaves_the_other_flags(argv, rest, only):
    from sglang_hs.tools.selftest import take_only

    assert take_only(argv) == (rest, only)


@pytest.mark.parametrize("argv", [["--only"], ["--only", "chunked"], ["--only=reference"], ["--only", ",,"]])
def test_only_refuses_unknown_or_missing_names_in_one_line(argv):
    from sglang_hs.tools.selftest import take_only

    with pytest.raises(ValueError, match=r"^--only: comma-separated configuration names out of chunked-16, "):
        take_only(argv)
