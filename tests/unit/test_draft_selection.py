"""--hs-capture-accept-lowest's window (sglang_hs/server/store/draft_selection.py) against a brute-force reference,
and the launcher's flags for it. The finish hook's use of it: test_finish_hook; on a real speculative server:
tests/e2e/test_speculative.py."""
import os

import pytest
from hypothesis import given, settings, strategies as st

from sglang_hs.server.capture_spec import CaptureConfigError
from sglang_hs.server.store.draft_selection import DraftSelection, RecentAccepts
from sglang_hs.tools import launch_server

LENGTHS = st.lists(st.sampled_from([1.0, 1.25, 1.5, 2.0, 2.5, 3.0]) | st.floats(1, 8), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(lengths=LENGTHS, window=st.integers(1, 9), fraction=st.sampled_from([0.1, 0.25, 0.5, 0.9]),
       opted=st.lists(st.booleans(), min_size=60, max_size=60))
def test_the_window_keeps_what_a_plain_rescan_keeps(lengths, window, fraction, opted):
    """Each decision equals a rescan of the last `window` lengths (this one included): kept when fewer than
    fraction x len of them are strictly below it, or when opted in; the window holds every request either way."""
    sel = DraftSelection(lowest=fraction, window=window)
    seen = []
    for i, length in enumerate(lengths):
        seen.append(length)
        recent = seen[-window:]
        below = sum(x < length for x in recent)
        want_drop = not opted[i] and below >= fraction * len(recent)
        assert sel.did_well(length, opted[i]) is want_drop, (i, recent)
    assert len(sel.recent) == min(len(lengths), window)


def test_a_request_without_a_verify_step_is_kept_and_not_counted():
    sel = DraftSelection(lowest=0.5, window=3)
    assert sel.did_well(None, False) is False and len(sel.recent) == 0
    assert DraftSelection(below=1.5).did_well(None, False) is False


def test_the_threshold_policy_is_unchanged():
    sel = DraftSelection(below=1.5)
    assert [sel.did_well(x, False) for x in (1.0, 1.49, 1.5, 3.0)] == [False, False, True, True]
    assert sel.did_well(3.0, True) is False and DraftSelection().active is False


def test_one_policy_at_a_time_and_a_real_window():
    with pytest.raises(ValueError, match="one policy at a time"):
        DraftSelection(below=1.5, lowest=0.5)
    with pytest.raises(ValueError, match="window: at least 1"):
        RecentAccepts(0)


def _prepare(tmp_path, *flags):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, '
                                   '"hidden_size": 64}')
    dump = tmp_path / f"hs{len(list(tmp_path.glob('hs*')))}"
    launch_server.prepare(["--model-path", str(d), "--device", "cpu", "--hs-dump-dir", str(dump),
                           "--speculative-algorithm", "NGRAM", *flags])
    return {k: os.environ.get(k) for k in ("SGLANG_HS_CAPTURE_ACCEPT_LOWEST", "SGLANG_HS_CAPTURE_ACCEPT_WINDOW")}


def test_the_launcher_flags(tmp_path, clean_env):
    from sglang_hs import envs

    assert _prepare(tmp_path, "--hs-capture-accept-lowest", "0.25", "--hs-capture-accept-window", "50") == \
        {"SGLANG_HS_CAPTURE_ACCEPT_LOWEST": "0.25", "SGLANG_HS_CAPTURE_ACCEPT_WINDOW": "50"}
    assert envs.SGLANG_HS_CAPTURE_ACCEPT_LOWEST == 0.25 and envs.SGLANG_HS_CAPTURE_ACCEPT_WINDOW == 50
    _prepare(tmp_path, "--hs-capture-accept-lowest", "0.25")
    assert envs.SGLANG_HS_CAPTURE_ACCEPT_WINDOW == 1000  # the default


@pytest.mark.parametrize("flags, message", [
    (["--hs-capture-accept-lowest", "1"], r"^--hs-capture-accept-lowest: a fraction 0 < F < 1 .*got '1'$"),
    (["--hs-capture-accept-lowest", "nan"], r"^--hs-capture-accept-lowest: a fraction"),
    (["--hs-capture-accept-lowest", "x"], r"^--hs-capture-accept-lowest: a fraction"),
    (["--hs-capture-accept-lowest", "0.5", "--hs-capture-accept-below", "2"], r"^--hs-capture-accept-lowest and "
                                                                               r"--hs-capture-accept-below: one policy"),
    (["--hs-capture-accept-window", "10"], r"^--hs-capture-accept-window sizes --hs-capture-accept-lowest"),
    (["--hs-capture-accept-lowest", "0.5", "--hs-capture-accept-window", "0"], r"^--hs-capture-accept-window: at least"),
])
def test_the_launcher_refuses_in_one_line(tmp_path, clean_env, flags, message):
    with pytest.raises(CaptureConfigError, match=message):
        _prepare(tmp_path, *flags)


def test_a_server_without_a_draft_is_refused(tmp_path, clean_env):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, '
                                   '"hidden_size": 64}')
    with pytest.raises(CaptureConfigError, match=r"^--hs-capture-accept-lowest selects on the draft's accept length"):
        launch_server.prepare(["--model-path", str(d), "--device", "cpu", "--hs-dump-dir", str(tmp_path / "hs"),
                               "--hs-capture-accept-lowest", "0.5"])


CONFIDENCES = st.lists(st.none() | st.floats(0, 1), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(confidences=CONFIDENCES, below=st.sampled_from([0.1, 0.5, 0.75, 1.0]),
       opted=st.lists(st.booleans(), min_size=40, max_size=40))
def test_the_confidence_policy_drops_what_the_draft_was_sure_of(confidences, below, opted):
    """--hs-capture-confidence-below C: dropped exactly when the request's mean draft confidence is C or more and it
    is not opted in; a request without one (no verify step, no confidence head) is kept; its accept length plays
    no part."""
    sel = DraftSelection(confidence_below=below)
    assert sel.active
    for i, conf in enumerate(confidences):
        want_drop = conf is not None and not opted[i] and conf >= below
        assert sel.did_well(1.0 + i % 3, opted[i], conf) is want_drop, (i, conf, below)
        assert sel.did_well(None, opted[i], conf) is want_drop  # nor whether it has one


def test_mean_confidence_is_the_mean_over_the_steps():
    from sglang_hs.server.store.draft_selection import mean_confidence

    assert mean_confidence([]) is None and mean_confidence([0.25]) == 0.25
    assert mean_confidence([0.2, 0.4, 0.9]) == pytest.approx(0.5)


def test_the_confidence_policy_is_one_policy_at_a_time():
    for other in ({"below": 1.5}, {"lowest": 0.5}):
        with pytest.raises(ValueError, match="one policy at a time"):
            DraftSelection(confidence_below=0.5, **other)


def _prepare_v4(tmp_path, monkeypatch, mode, *flags):
    """launch_server.prepare for tiny v4-csa served with its DSpark draft on the CPU engine, under
    SGLANG_RAGGED_VERIFY_MODE `mode` (None: unset)."""
    from sglang_hs.tools import tiny_model

    if mode is None:
        monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    else:
        monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    dump = tmp_path / f"hs{len(list(tmp_path.glob('hs*')))}"
    launch_server.prepare(["--model-path", tiny_model.ensure("v4-csa"), "--device", "cpu", "--hs-dump-dir", str(dump),
                           "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                           tiny_model.ensure_dspark_draft("v4-csa"), *flags])
    return os.environ.get("SGLANG_HS_CAPTURE_CONFIDENCE_BELOW")


def test_the_confidence_flag_on_a_dspark_server(tmp_path, clean_env, monkeypatch):
    from sglang_hs import envs

    assert _prepare_v4(tmp_path, monkeypatch, "cap-accept", "--hs-capture-confidence-below", "0.4") == "0.4"
    assert envs.SGLANG_HS_CAPTURE_CONFIDENCE_BELOW == 0.4
    for mode in (None, "static"):  # SGLang builds no confidence head
        with pytest.raises(CaptureConfigError, match=r"^--hs-capture-confidence-below selects on the DSpark draft's "
                                                     r"confidence head: .*SGLANG_RAGGED_VERIFY_MODE=cap-accept"):
            _prepare_v4(tmp_path, monkeypatch, mode, "--hs-capture-confidence-below", "0.4")


@pytest.mark.parametrize("flags, message", [
    (["--hs-capture-confidence-below", "0"], r"^--hs-capture-confidence-below: a mean draft confidence 0 < C <= 1, "
                                             r"got '0'$"),
    (["--hs-capture-confidence-below", "1.5"], r"^--hs-capture-confidence-below: a mean draft confidence"),
    (["--hs-capture-confidence-below", "nan"], r"^--hs-capture-confidence-below: a mean draft confidence"),
    (["--hs-capture-confidence-below", "x"], r"^--hs-capture-confidence-below: a mean draft confidence"),
    (["--hs-capture-confidence-below", "0.5", "--hs-capture-accept-below", "2"],
     r"^--hs-capture-confidence-below and --hs-capture-accept-below/-lowest: one policy at a time$"),
])
def test_the_confidence_flag_is_refused_in_one_line(tmp_path, clean_env, monkeypatch, flags, message):
    with pytest.raises(CaptureConfigError, match=message):
        _prepare_v4(tmp_path, monkeypatch, "cap-accept", *flags)


def test_the_confidence_flag_is_refused_without_dspark(tmp_path, clean_env):
    with pytest.raises(CaptureConfigError, match=r"^--hs-capture-confidence-below selects on the DSpark draft's "
                                                 r"confidence head: it needs --speculative-algorithm DSPARK .*NGRAM"):
        _prepare(tmp_path, "--hs-capture-confidence-below", "0.5")  # an NGRAM server
