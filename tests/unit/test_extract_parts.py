"""The extraction CLI's parts without a server: loss masks from chat templates, skip reasons, the two
file layouts (read back the SpecForge way and the safetensors way), atomic writes, the draft-config
layer ids, and the logprob verification."""
import os
import re
import zipfile

import pytest
import torch
from transformers import AutoTokenizer

import specforge_way
from helpers import verify_case
from sglang_hs.tools import tiny_model
from sglang_hs.extract import cli, output
from sglang_hs.extract.dataset import Preparer, SkipSample
from sglang_hs.extract.output import draft_config
from sglang_hs.extract.sinks import SafetensorsSink, SpecForgeSink, record_rows
from sglang_hs.extract.verify import VerificationError, check

CONV = [{"from": "human", "value": "What is the capital of France?"}, {"from": "gpt", "value": "Paris, of course."},
        {"from": "human", "value": "And of Spain?"}, {"from": "gpt", "value": "Madrid."}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_model.ensure())


def _masked_text(tok, s):
    runs, cur = [], []
    for t, m in zip(s.input_ids, s.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_loss_mask_is_exactly_the_replies_and_their_end_of_turn(tok):
    s = Preparer(tok, 4096)(0, {"conversations": CONV})
    eos = tok.eos_token
    assert _masked_text(tok, s) == ["Paris, of course." + eos, "Madrid." + eos]
    assert tok.decode(s.input_ids) == tok.apply_chat_template(
        [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in CONV], tokenize=False)
    # OpenAI style gives the same sample.
    openai = [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in CONV]
    s2 = Preparer(tok, 4096)(0, {"messages": openai})
    assert (s2.input_ids, s2.loss_mask) == (s.input_ids, s.loss_mask)


def test_a_template_that_rewrites_earlier_turns_is_matched_by_the_final_answer(tok):
    """DeepSeek-R1-style: earlier assistant turns lose their reasoning in the rendered text."""
    tok = AutoTokenizer.from_pretrained(tiny_model.ensure())
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
        "{% else %}{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>greet back</think>Hello!"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]
    s = Preparer(tok, 4096)(0, {"messages": conv})
    assert _masked_text(tok, s) == ["Hello!" + tok.eos_token, "Goodbye." + tok.eos_token]


@pytest.mark.parametrize("record, reason", [
    ({"messages": []}, "empty-conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "empty-conversation"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown-role"),
    ({"messages": [{"role": "user", "content": 5}]}, "wrong-type"),
    ({"conversations": "hello"}, "wrong-type"),
    ({"input_ids": [1, 2, 100000]}, "token-out-of-vocab"),
    ({"input_ids": [1, -2]}, "token-out-of-vocab"),
    ({"input_ids": ["a"]}, "wrong-type"),
    ({"input_ids": []}, "empty-input"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "bad-loss-mask"),
    ({"input_ids": list(range(1, 40))}, "too-long"),
    ({"text": "no fields"}, "missing-fields"),
    (["not", "an", "object"], "wrong-type"),
])
def test_bad_records_are_skipped_with_a_reason(tok, record, reason):
    with pytest.raises(SkipSample) as e:
        Preparer(tok, 32)(0, record)
    assert e.value.reason == reason


def test_regenerate_sends_the_prompt_with_the_generation_header(tok):
    s = Preparer(tok, 4096, regenerate=True, max_new_tokens=16)(3, {"conversations": CONV})
    assert tok.decode(s.input_ids).endswith("And of Spain?<｜Assistant｜>") and s.prompt_len == len(s.input_ids)
    with pytest.raises(SkipSample, match="too-long"):
        Preparer(tok, len(s.input_ids) + 8, regenerate=True, max_new_tokens=16)(3, {"conversations": CONV})


def _record(T=7, K=3, H=16):
    g = torch.Generator().manual_seed(T)
    return (torch.arange(T), torch.tensor([0, 0, 1, 1, 1, 0, 1][:T]), torch.randn(T, K, H, generator=g).bfloat16(),
            torch.randn(T, H, generator=g).bfloat16())


def test_specforge_files_load_the_specforge_way(tmp_path):
    sink = SpecForgeSink(str(tmp_path))
    ids, mask, aux, last = _record()
    for i in (0, 1999, 2000, 4711):
        sink.write(i, ids, mask, aux, last)
    files = specforge_way.find_files(str(tmp_path))
    assert [os.path.relpath(f, tmp_path) for f in files] == [
        "rows_0-2000/data_0.ckpt", "rows_0-2000/data_1999.ckpt", "rows_2000-4000/data_2000.ckpt",
        "rows_4000-6000/data_4711.ckpt"]
    s = specforge_way.load_sample(files[0])
    assert torch.equal(s["input_ids"][0], ids) and s["input_ids"].dtype == torch.int64
    assert torch.equal(s["hidden_state"][0], aux.reshape(7, -1)) and s["hidden_state"].shape == (1, 7, 48)
    assert torch.equal(s["target"][0], last) and s["target"].dtype == torch.bfloat16
    assert s["loss_mask"][0].tolist() == mask.tolist()[:-1] + [0]
    assert sink.done(4711) and not sink.done(4712) and sink.existing() == 4


def test_safetensors_files_hold_layers_then_the_final_state(tmp_path):
    from safetensors.torch import load_file

    sink = SafetensorsSink(str(tmp_path))
    ids, mask, aux, last = _record()
    nbytes = sink.write(5, ids, mask, aux, last)
    t = load_file(str(tmp_path / "hs_5.safetensors"))
    assert nbytes == os.path.getsize(tmp_path / "hs_5.safetensors")
    assert t["hidden_states"].shape == (7, 4, 16) and torch.equal(t["hidden_states"][:, :3], aux)
    assert torch.equal(t["hidden_states"][:, 3], last) and torch.equal(t["token_ids"], ids)
    assert torch.equal(t["loss_mask"], mask)


def test_a_records_rows_are_written_as_they_lie_only_when_their_storage_is_the_record(tmp_path):
    """The sinks skip their copies only for aux/last that are the two views of one record's rows whose storage
    holds nothing else (else torch.save would store the bigger storage, or the wrong bytes would be read);
    SpecForge's sink saves without CRC-32 from several threads and leaves torch's flag as it found it."""
    import concurrent.futures as cf

    from safetensors.torch import load_file

    K, H = 3, 256
    rows = torch.randn(7, K + 1, H).bfloat16()
    assert torch.equal(record_rows(rows[:, :K], rows[:, K]), rows)
    assert record_rows(rows[:, :K], rows[:, K]).data_ptr() == rows.data_ptr()
    batch = torch.randn(20, K + 1, H).bfloat16()
    inner = batch[:7]  # a record inside a bigger storage
    for aux, last in [(inner[:, :K], inner[:, K]), (rows[:, :K], rows[:, K - 1]), (rows[:, 1:], rows[:, 0]),
                      (rows[:, :K].clone(), rows[:, K]), (rows[:, :K], None), (rows[:, :K].float(), rows[:, K])]:
        assert record_rows(aux, last) is None
    ids, mask = torch.arange(7), torch.ones(7, dtype=torch.long)
    sf, st = SpecForgeSink(str(tmp_path / "sf")), SafetensorsSink(str(tmp_path / "st"))
    with cf.ThreadPoolExecutor(4) as pool:  # the CLI's writer threads
        list(pool.map(lambda i: sf.write(i, ids, mask, inner[:, :K], inner[:, K]), range(7)))
    sf.write(7, ids, mask, inner[:, :K], inner[:, K])
    assert torch.serialization.get_crc32_options()  # this thread's flag is back
    for i in range(8):  # no CRC-32 computed in any of them (torch's flag is per thread)
        with zipfile.ZipFile(sf.path(i)) as z:
            crcs = [e.CRC for e in z.infolist() if "/data/" in e.filename and e.file_size]
            assert len(crcs) == 4 and not any(crcs), (i, crcs)  # ids, mask, and the copies of aux and last
    assert os.path.getsize(sf.path(0)) < batch.numel() * 2  # the record's rows, not the batch's storage
    s = specforge_way.load_sample(sf.path(7))
    assert torch.equal(s["hidden_state"][0], inner[:, :K].reshape(7, -1)) and torch.equal(s["target"][0], inner[:, K])
    for i, src in enumerate((rows, inner)):
        st.write(i, ids, mask, src[:, :K], src[:, K])
        assert torch.equal(load_file(st.path(i))["hidden_states"], src)


def test_a_failed_write_leaves_no_file_that_looks_done(tmp_path, monkeypatch):
    sink = SpecForgeSink(str(tmp_path))
    ids, mask, aux, last = _record()

    def full_disk(obj, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        sink.write(3, ids, mask, aux, last)
    assert not sink.done(3) and not list(tmp_path.rglob("*.tmp")) and sink.existing() == 0
    # A crash (no exception handler ran) leaves only a temporary name, removed by the next run.
    (tmp_path / "rows_0-2000" / "data_4.ckpt.123.tmp").write_bytes(b"partial")
    assert not sink.done(4) and sink.remove_partial() == 1


@pytest.mark.parametrize("layers, ids", [([2, 4, 5], [1, 3, 4]), ([3, 30, 58], [3, 30, 58]), ([0, 5], [0, 5]),
                                         ([1, 4, 6], None)])
def test_draft_config_ids_make_sglang_capture_the_same_layers(layers, ids):
    cfg = draft_config({"layer_ids": layers, "hidden_size": 64, "last": True, "num_hidden_layers": 61})
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    if ids is not None:  # SGLang's set_eagle3_layers_to_capture: +1 on every id when the first is 1
        assert ([i + 1 for i in ids] if ids[0] == 1 else ids) == layers
    assert cfg["speculators_layer_ids"] == layers  # --target-layer-ids: the aux ids only, never the final state


@pytest.mark.parametrize("fmt, finals, refused", [
    ("specforge", ["post-norm"], None), ("specforge", ["post-norm", "pre-norm"], None),
    ("specforge", ["pre-norm"], "--format specforge trains on the post-norm final state, but S captures the "
                                "pre-norm one (--hs-last pre-norm); restart it with --hs-last post-norm"),
    ("safetensors", ["pre-norm"], None), ("safetensors", ["post-norm", "pre-norm"], None),
    ("safetensors", ["post-norm"], "--format safetensors trains on the pre-norm final state, but S captures the "
                                   "post-norm one (--hs-last post-norm); restart it with --hs-last pre-norm")])
def test_each_format_takes_its_trainers_final_state_and_refuses_the_other(fmt, finals, refused):
    """SpecForge applies lm_head to the state it reads (post-norm); speculators applies the verifier's norm
    first (pre-norm). A server that captured the other one is refused in one line naming --hs-last."""
    from sglang_hs.extract.errors import ExtractError
    from sglang_hs.extract.output import check_final_state
    from sglang_hs.extract.sinks import SINKS

    sink = SINKS[fmt]("/nonexistent")
    manifest = {"last": True, "last_states": finals}
    if refused is None:
        check_final_state(fmt, sink, manifest, "S")
    else:
        with pytest.raises(ExtractError) as e:
            check_final_state(fmt, sink, manifest, "S")
        assert str(e.value).startswith(refused) and "\n" not in str(e.value)


def test_each_format_writes_the_records_state_its_trainer_reads():
    from types import SimpleNamespace

    from sglang_hs.extract.sinks import SINKS

    rec = SimpleNamespace(last_hidden_state="post", last_pre_norm="pre")
    assert SINKS["specforge"]("/x").final_of(rec) == "post" and SINKS["safetensors"]("/x").final_of(rec) == "pre"


@pytest.mark.parametrize("fmt, verify, want", [("specforge", 0.0, "post-norm"), ("specforge", 1.0, "post-norm"),
                                               ("safetensors", 0.0, "pre-norm"), ("safetensors", 0.5, "both")])
def test_a_server_the_cli_starts_captures_what_its_format_needs(fmt, verify, want):
    from sglang_hs.extract.cli import server_last

    ns, _ = cli.parse_args(["--data", "x.jsonl", "--output", "o", "--format", fmt, "--verify", str(verify)])
    assert server_last(ns) == want


def test_training_commands_name_the_aux_ids_and_the_files(tmp_path):
    from sglang_hs.extract.output import specforge_config, training_command

    m = {"model_path": "/m/DeepSeek-V3", "layer_ids": [2, 30, 58], "num_hidden_layers": 61, "context_len": 4096}
    assert training_command(str(tmp_path), m, "safetensors", None) == [
        "speculators", "train", "--speculator-type", "eagle3", "--verifier-name-or-path", "/m/DeepSeek-V3",
        "--data-path", str(tmp_path), "--target-layer-ids", "2", "30", "58", "--hidden-states-backend", "file",
        "--hidden-states-dtype", "bfloat16"]
    assert training_command(str(tmp_path), m, "safetensors", "fp8")[-3] == "fp8"
    # a vocabulary larger than the draft's: the draft head keeps the 32000 most frequent tokens of token_freq.pt
    assert training_command(str(tmp_path), dict(m, vocab_size=129280), "safetensors", None)[-2:] == [
        "--draft-vocab-size", "32000"]
    assert "--draft-vocab-size" not in training_command(str(tmp_path), dict(m, vocab_size=1024), "safetensors", None)
    assert output.model_vocab_size(tiny_model.ensure()) == 1024 and output.model_vocab_size(str(tmp_path)) is None
    assert output.model_vocab_size(tiny_model.ensure("mistral-large-3")) == 1024
    assert training_command(str(tmp_path), m, "specforge", "bf16") == [
        "specforge", "train", "--config", str(tmp_path / "specforge_train.json")]
    cfg = specforge_config(str(tmp_path), m)
    assert cfg["model"]["target_model_path"] == "/m/DeepSeek-V3" and cfg["data"]["hidden_states_path"] == str(tmp_path)
    assert cfg["data"]["max_length"] == 4096 and cfg["training"]["strategy"] == "eagle3"


@pytest.mark.parametrize("argv, want", [([], "bf16"), (["--save-dtype", "bf16"], "bf16")])
def test_specforge_files_are_bf16_whatever_the_server(argv, want):
    """SpecForge 0.2.0's TargetHead computes in bf16 only: a float32 file fails its first step."""
    ns, _ = cli.parse_args(["--data", "x.jsonl", "--output", "o", *argv])
    assert ns.format == "specforge" and ns.save_dtype == want
    ns, _ = cli.parse_args(["--data", "x.jsonl", "--output", "o", "--format", "safetensors"])
    assert ns.save_dtype is None  # speculators takes the server's dtype


def test_a_float32_capture_is_written_bf16_for_specforge(tmp_path):
    from sglang_hs.extract.sinks import SpecForgeSink

    ns, _ = cli.parse_args(["--data", "x.jsonl", "--output", str(tmp_path)])
    sink = SpecForgeSink(str(tmp_path), ns.save_dtype)
    T, K, H = 5, 3, 8
    aux, last = torch.randn(T, K, H), torch.randn(T, H)
    sink.write(0, torch.arange(T), torch.ones(T), aux, last)
    s = torch.load(sink.path(0), weights_only=False)
    assert s["hidden_state"].dtype == s["aux_hidden_state"].dtype == torch.bfloat16
    assert torch.equal(s["hidden_state"][0], last.bfloat16()) and torch.equal(s["aux_hidden_state"][0],
                                                                              aux.bfloat16().reshape(T, -1))


def test_verification_passes_the_true_states_and_fails_wrong_ones_in_any_row_the_last_included():
    head, last, tokens, server = verify_case()
    T = last.shape[0]
    assert check(0, tokens, last.bfloat16().float(), head, server, tokens) < 0.08
    with pytest.raises(VerificationError, match="sample 7: row 0 "):  # shifted by one token
        check(7, tokens, torch.cat([last[1:], last[:1]]), head, server)
    for t in range(T):  # one row from another token, wherever it is
        wrong = last.clone()
        wrong[t] = last[t - 1]
        with pytest.raises(VerificationError, match=rf"sample 7: row {t} .*{', the last row' if t == T - 1 else ''}"):
            check(7, tokens, wrong, head, server)
    for bad in ([tokens, last[:-1]], [tokens[:-1], last]):  # a row missing, or a token
        with pytest.raises(VerificationError, match="captured rows for"):
            check(7, bad[0], bad[1], head, server)
    with pytest.raises(VerificationError, match="the server returned 12 logprobs for 13 tokens"):
        check(7, tokens, last, head, server[:-1])  # the last row's reference missing is an error, not a skip
    with pytest.raises(VerificationError, match="logprobs are of other tokens"):
        check(7, tokens, last, head, server, tokens[:-1] + [tokens[-1] + 1])


def test_verification_of_sampled_tokens_uses_the_temperature_scaled_logprob():
    """--regenerate --temperature: SGLang reports a sampled token's logprob from log softmax(logits / T)
    (the unscaled one with SGLANG_RETURN_ORIGINAL_LOGPROB); the prompt tokens' logprobs are unscaled."""
    head, last, tokens, server = verify_case()
    prompt_len, temp = 5, 0.7
    scaled = torch.log_softmax(last @ head.T / temp, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    mixed = server[:prompt_len] + scaled[prompt_len - 1:].tolist()
    assert check(0, tokens, last, head, mixed, temperature=temp, sampled_from=prompt_len) < 1e-4
    assert check(0, tokens, last, head, server, temperature=temp, sampled_from=prompt_len) < 1e-4  # original
    with pytest.raises(VerificationError, match="row 4 "):  # read as greedy, the sampled rows disagree
        check(0, tokens, last, head, mixed)
    wrong = last.clone()
    wrong[-1] = last[-2]  # the last row, predicting a sampled token, from another token
    with pytest.raises(VerificationError, match="row 11 .*the last row"):
        check(0, tokens, wrong, head, mixed, temperature=temp, sampled_from=prompt_len)
    with pytest.raises(VerificationError, match="row 3 "):  # a prompt row is compared unscaled
        check(0, tokens, last, head, server[:4] + [server[4] + 0.5] + mixed[5:], temperature=temp,
              sampled_from=prompt_len)


def test_a_hugging_face_dataset_on_disk_is_read_like_json_lines(tmp_path, tok):
    datasets = pytest.importorskip("datasets", reason="the datasets library is optional")
    from sglang_hs.extract.dataset import read_records

    rows = [{"conversations": CONV}, {"conversations": CONV[:2]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    got = list(read_records(str(tmp_path / "ds")))
    assert [i for i, _ in got] == [0, 1]
    s = Preparer(tok, 4096)(0, got[0][1])
    assert s.input_ids == Preparer(tok, 4096)(0, rows[0]).input_ids


def test_a_missing_data_file_is_named(tmp_path, capsys):
    from sglang_hs.extract.cli import main

    missing = tmp_path / "nope.jsonl"
    assert main(["--data", str(missing), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--data: {missing} does not exist" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag, message", [
    (["--shard", "3/2"], "--shard: '3/2' is not I/N with 0 <= I < N"),
    (["--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
    (["--verify", "2"], r"--verify: a fraction in \[0, 1\], got 2.0"),
    (["--max-samples", "-1"], "--max-samples: must be >= 0, got -1"),
    (["--torch-threads", "0"], "--torch-threads: must be >= 1, got 0"),
    (["--server", "http://127.0.0.1:9"], "--server needs --hs-dump-dir"),
    (["--hs-owner", "root"], "--hs-owner needs --server"),
    (["--server", "http://127.0.0.1:9", "--hs-dump-dir", "/x", "--hs-owner", "no-such-user-hs"],
     "--hs-owner: no such user 'no-such-user-hs'"),
])
def test_bad_flags_get_one_line_naming_the_flag(tmp_path, capsys, flag, message):
    from sglang_hs.extract.cli import main

    rc = main(["--data", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"), *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("python -m sglang_hs.extract: error: ")
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_torch_threads_apply_to_the_run_and_are_restored(tmp_path, capsys, monkeypatch):
    from sglang_hs.extract import cli

    seen = []

    def model_side(*args):  # runs inside the run: note the threads, then end it
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "_model_side", model_side)
    dump = tmp_path / "hs"
    dump.mkdir(mode=0o700)
    from sglang_hs.server.capture_spec import CaptureSpec
    from sglang_hs.server.store.writer import CaptureWriter

    CaptureWriter(str(dump), CaptureSpec.resolve([1], "pre-norm", 4, 16), 8, torch.bfloat16, 1 << 16)
    (tmp_path / "d.jsonl").write_text('{"input_ids": [5, 6, 7]}\n')
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rc = cli.main(["--data", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"), "--server",
                       "http://127.0.0.1:9", "--hs-dump-dir", str(dump), "--format", "safetensors"])
        assert rc == 1 and "stop here" in capsys.readouterr().err
        assert seen == [1] and torch.get_num_threads() == 2  # 1 during the run (the default), then as it was
    finally:
        torch.set_num_threads(before)


def test_an_interrupt_while_collecting_writes_leaves_no_file_unacked_or_counted_twice():
    """Ctrl-C / SIGTERM (a KeyboardInterrupt here) landing while finished writes are collected: the run's
    shutdown collects again (cli._uninterrupted) and every finished write ends acked exactly once and
    counted once (review finding: the list of writes was emptied before the acks, so an interrupt
    left files in place whose records were never acked nor counted)."""
    import concurrent.futures as cf

    from sglang_hs.extract import cli, writer

    class Reader:
        def __init__(self):
            self.acked, self.interrupt_at = [], 2

        def ack(self, rec):
            if len(self.acked) == self.interrupt_at:
                self.interrupt_at = None
                raise KeyboardInterrupt
            self.acked.append(rec)

    class Bar:
        def update(self, n):
            pass

    ext = cli.Extraction.__new__(cli.Extraction)
    ext.reader, ext.stats, ext.writes = Reader(), output.Stats(), []
    for i in range(5):
        fut = cf.Future()
        fut.set_result(100 + i)
        ext.writes.append((i, 10, fut, f"rec{i}"))
    pending = cf.Future()
    ext.writes.append((5, 10, pending, "rec5"))
    assert writer._uninterrupted(lambda: ext._collect_writes(Bar())) is True
    assert ext.reader.acked == [f"rec{i}" for i in range(5)]
    assert (ext.stats.done, ext.stats.bytes, ext.stats.tokens) == (5, sum(range(100, 105)), 50)
    assert [w[3] for w in ext.writes] == ["rec5"]  # still being written: neither acked nor counted


@pytest.mark.parametrize("streams", ["mean", "full"])
def test_draft_config_of_deepseek_v4_names_sglangs_dspark_ids(streams):
    from sglang_hs.server.capture_spec import CaptureSpec

    m = dict(CaptureSpec.resolve([2, 21, 40], True, 43, 4096, hc_mult=4, streams=streams).describe())
    cfg = draft_config(m)
    # SGLang 0.5.23 has no EAGLE-3 capture for V4; its DSpark capture of id j is layer j's output
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] is None
    assert cfg["dspark_target_layer_ids"] == [1, 20, 39]
    assert [j + 1 for j in cfg["dspark_target_layer_ids"]] == m["layer_ids"]
    assert cfg["hc_mult"] == 4 and cfg["hc_streams"] == streams and cfg["rows_per_layer"] == (4 if streams == "full"
                                                                                               else 1)
    assert ("mean only" in cfg["sglang_id_convention"]) == (streams == "full")
    assert cfg["speculators_layer_ids"] == [2, 21, 40]
