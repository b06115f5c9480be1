"""Harvest volume (issue 31 item 8): a client cannot force its requests into the capture sample, and
--hs-capture-max-bytes caps what is captured. Sampling hashes the rid with a key the server draws at start
(or --hs-capture-sample-key): rids a client picked because the unkeyed hash samples them are captured at
the sampling rate, not all; under one key the choice is reproducible. The byte budget: requests are
captured, each charged its worst-case record, while that fits in what is left of the budget; the others
are served without capture (reason over_budget, counted, with a marker), and what was charged never
exceeds the budget. Admission control runs for real on a stand-in ring; the launcher's flags are checked."""
import math
import os

import pytest
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_hs.tools.launch_server import CaptureConfigError, selection_env
from sglang_hs.server.store.admission import AdmissionControl, sample_point
from sglang_hs.server.store.ring import SKIP_REASONS, record_bytes
from ring_stand_in import Ring  # noqa: E402

P, H, ELEM = 2, 16, 2


def _req(rid, prompt=5, new=3):
    return TokenizedGenerateReqInput(
        rid=rid, input_text="", input_ids=list(range(5, 5 + prompt)), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=new, custom_params=None),
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


def test_a_client_cannot_force_capture_by_choosing_rids():
    p, n = 0.1, 4000
    # the client's attack: rids whose unkeyed hash falls in the sample (what the server hashed before)
    forced = [r for r in (f"mine-{i}" for i in range(20 * n)) if sample_point(r) < p][:n]
    assert len(forced) == n
    adm = AdmissionControl(Ring(1 << 40), P, H, ELEM, context_len=4096, mode="opt-in", sample=p,
                           sample_key=os.urandom(32))  # what the server does without --hs-capture-sample-key
    adm.filter([_req(r) for r in forced])
    captured = len(adm.reserved) - sum(1 for reason, marked in adm.decided.values() if marked)
    sd = math.sqrt(n * p * (1 - p))
    assert abs(captured - n * p) < 5 * sd, captured  # the sampling rate, not all of them
    assert adm.stats["skipped_not_sampled"] == n - captured


def test_one_key_samples_alike_and_another_key_differently():
    rids = [f"req-{i}" for i in range(2000)]
    key = bytes.fromhex("5eed" * 8)
    a = [sample_point(r, key) < 0.3 for r in rids]
    assert a == [sample_point(r, key) < 0.3 for r in rids]  # reproducible under --hs-capture-sample-key
    assert a != [sample_point(r, bytes.fromhex("5eee" * 8)) < 0.3 for r in rids]


def test_the_byte_budget_caps_what_is_captured_and_counts_the_rest():
    one = record_bytes(5 + 3 - 1, P, H, ELEM, len("r-00"))  # each request's worst-case record
    adm = AdmissionControl(Ring(1 << 30), P, H, ELEM, context_len=4096, max_bytes=int(3.5 * one))
    out = adm.filter([_req(f"r-{i:02d}") for i in range(10)])
    assert len(out) == 10 and not adm.held  # every request is served
    captured = [r for r in adm.reserved if r not in adm.decided]
    assert captured == ["r-00", "r-01", "r-02"] and adm.stats["capture_bytes"] == 3 * one <= 3.5 * one
    assert adm.stats["skipped_over_budget"] == 7
    assert all(adm.decided[f"r-{i:02d}"] == ("over_budget", True) for i in range(3, 10))  # marked: readers know
    assert "over_budget" in SKIP_REASONS.values()
    small = record_bytes(1, P, H, ELEM, len("late-0"))
    assert 3 * one + small <= 3.5 * one < 3 * one + 2 * small
    adm.filter([_req("late-0", prompt=1, new=1), _req("late-1", prompt=1, new=1)])  # one more fits, not two
    assert "late-0" not in adm.decided and adm.decided["late-1"] == ("over_budget", True)
    assert adm.stats["capture_bytes"] == 3 * one + small <= 3.5 * one


def NS(**kw):
    """The launcher's own parsed flags (every --hs-* default, so a flag added there is here too) with `kw` set."""
    from sglang_hs.tools.launch_server import split_argv

    ns, _ = split_argv([])
    ns.__dict__.update(kw)
    return ns


def test_the_launcher_flags():
    env = selection_env(NS(hs_capture_sample="0.1", hs_capture_sample_key="ab" * 16, hs_capture_max_bytes="2MiB",
                           hs_capture_accept_below="1.5"))
    assert env["SGLANG_HS_CAPTURE_SAMPLE_KEY"] == "ab" * 16 and env["SGLANG_HS_CAPTURE_MAX_BYTES"] == str(2 << 20)
    assert env["SGLANG_HS_CAPTURE_ACCEPT_BELOW"] == "1.5"
    for kw, msg in ((dict(hs_capture_sample_key="xyz"), "--hs-capture-sample-key: 1 to 64 bytes in hex"),
                    (dict(hs_capture_sample_key="ab" * 65), "--hs-capture-sample-key: 1 to 64 bytes in hex"),
                    (dict(hs_capture_max_bytes="lots"), "--hs-capture-max-bytes: 'lots' is not a size"),
                    (dict(hs_capture_max_bytes="0"), "--hs-capture-max-bytes: must be more than 0 bytes"),
                    (dict(hs_capture_accept_below="inf"), "--hs-capture-accept-below: an accept length L > 1")):
        with pytest.raises(CaptureConfigError, match=msg):
            selection_env(NS(**kw))
