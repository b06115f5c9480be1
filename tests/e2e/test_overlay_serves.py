"""The real server, started by the launcher, serves through the overlay with capture on."""
import pytest

from conftest import CHUNK
from helpers import leftover_server_processes, settled

pytestmark = pytest.mark.e2e


def test_chunked_prefill_and_decode_go_through_the_overlay(capture_server, dump_dir):
    # every forward of a request is counted before its reply leaves: a snapshot taken after the reply has them
    before = settled(capture_server)
    prompt = [(7 * i + 11) % 900 + 5 for i in range(40)]  # 40 tokens, 3 chunks of <= 16
    out = capture_server.generate(
        input_ids=prompt, rid="e2e-chunked-decode", sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert out["meta_info"]["completion_tokens"] == 8
    status = settled(capture_server)
    assert "e2e-chunked-decode" in status["recent_rids"] and len(status["files"]) == 1, status
    # Written by the scheduler process that served the request, not by the launcher.
    assert status["pid"] != capture_server.proc.pid and status["pid"] in leftover_server_processes(capture_server.output)
    assert status["module"] == "sglang_hs.server.models.deepseek_v2" and status["class"] == "DeepseekV3ForCausalLM"
    assert status["capture"]["layer_ids"] == [2, 4, 5] and status["capture"]["last"] is True
    assert status["capture"]["hf_output_hidden_states_index"] == [2, 4, 5, 8]
    assert status["last_aux_shape"][1] == 3 * 256  # K * H, packed
    prev_f, prev_r = before.get("forwards", {}), before.get("rows", {})
    new_extend = status["forwards"]["EXTEND"] - prev_f.get("EXTEND", 0)
    new_rows = status["rows"]["EXTEND"] - prev_r.get("EXTEND", 0)
    assert new_extend >= -(-40 // CHUNK), status  # the prompt really was chunked
    assert new_rows >= 40 - 5  # radix cache may hold a few leading tokens from earlier requests
    assert status["forwards"]["DECODE"] - prev_f.get("DECODE", 0) >= 7


def test_chat_completions_served_with_capture(capture_server, dump_dir):
    out = capture_server.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=6,
                              temperature=0)
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["message"]["content"]


def test_server_warmup_ran_through_the_capture_path(capture_server):
    # The launcher only reports ready after SGLang's own warm-up request succeeded through the overlay.
    out = capture_server.output
    assert "[sglang-hs] overlay ready: sglang_hs.server.models.deepseek_v2.DeepseekV3ForCausalLM" in out
    assert "capture=on [2, 4, 5] +last" in out
    assert out.index("overlay ready") < out.index("The server is fired up")
