"""Bad input files skip the records they spoil and nothing else (sglang_hs/extract/dataset.py, sinks.py):
a byte that is not UTF-8 in the middle of a JSON Lines file (the valid lines of the same read-ahead chunk
around it still read, at their own indices), JSON nested 100,000 deep, a chat template that raises for a
record, a lone surrogate a JSON escape spells; `--finalize` over a folder with a sample file cut short
names that file in one line and leaves every file and the dataset already there as they were; a sample
whose rows FP8 cannot store (inf, NaN) is skipped, not failed."""
import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from helpers import ProgressLines
from sglang_hs.tools import tiny_model
from sglang_hs.extract import cli, output
from sglang_hs.extract.dataset import Preparer, SkipSample, read_records
from sglang_hs.extract.sinks import SafetensorsSink

CONV = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_model.ensure())


def _records(n):
    return [{"messages": CONV, "n": i} for i in range(n)]


def _read(path):
    got = list(read_records(str(path)))
    assert [i for i, _ in got] == list(range(len(got))), "record i is line i + 1"
    return [r for _, r in got]


def test_a_byte_that_is_not_utf8_skips_its_line_only(tmp_path):
    """All of it within one read-ahead chunk (8 KB): a strict decode fails for the chunk, the lines before
    the bad byte with it, and every later run of the same file at the same place."""
    good = _records(6)
    lines = [json.dumps(r).encode() for r in good]
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'  # Latin-1, not UTF-8
    data = b"\n".join(lines[:3] + [bad] + lines[3:5]) + b"\n" + lines[5] + b"\r\n" + b'{"cut": "\xe2\x82'  # ends mid-char
    assert len(data) < 8192
    (tmp_path / "d.jsonl").write_bytes(data)
    got = _read(tmp_path / "d.jsonl")
    assert len(got) == 8
    assert got[:3] + got[4:7] == good, "a valid line was lost or changed"
    assert all(isinstance(got[i], SkipSample) and got[i].reason == "invalid-utf8" for i in (3, 7)), got
    assert got[3].detail == f"byte 0xe9 at character {bad.index(0xE9) + 1} is not UTF-8"
    assert got[7].detail == "byte 0xe2 at character 10 is not UTF-8"


def test_deeply_nested_json_skips_its_line(tmp_path):
    good = _records(2)
    (tmp_path / "d.jsonl").write_text("\n".join([json.dumps(good[0]), DEEP, '{"messages": ' + DEEP + "}",
                                                 json.dumps(good[1])]) + "\n")
    got = _read(tmp_path / "d.jsonl")
    assert got[0] == good[0] and got[3] == good[1]
    assert [(r.reason, r.detail) for r in got[1:3]] == [("too-deep", "nested deeper than the JSON decoder goes")] * 2


def test_a_template_that_raises_skips_the_record(tok):
    tok = AutoTokenizer.from_pretrained(tiny_model.ensure())
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'odd' %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                         "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    prep = Preparer(tok, 4096)
    assert prep(0, {"messages": CONV}).input_ids  # the template works for other records
    for regenerate in (False, True):
        with pytest.raises(SkipSample) as e:
            Preparer(tok, 4096, regenerate=regenerate, max_new_tokens=8)(
                1, {"messages": [{"role": "user", "content": "odd"}, CONV[1]]})
        assert e.value.reason == "chat-template-error"
        assert e.value.detail == "TemplateError: Conversation roles must alternate user/assistant"
    tok.chat_template = "{{ messages[0]['content'] + 1 }}"  # a TypeError for every string content
    with pytest.raises(SkipSample, match="chat-template-error: TypeError"):
        Preparer(tok, 4096)(2, {"messages": CONV})


def test_a_template_that_cannot_compile_is_one_error_not_a_skip_per_record(tok):
    tok = AutoTokenizer.from_pretrained(tiny_model.ensure())
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}"  # no endfor
    with pytest.raises(ValueError, match="the model's chat template does not compile"):
        Preparer(tok, 4096)(0, {"messages": CONV})


def test_a_lone_surrogate_escape_skips_the_record(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "x\\ud800"}, '
                                      '{"role": "assistant", "content": "y"}]}\n')
    (record,) = _read(tmp_path / "d.jsonl")
    with pytest.raises(SkipSample, match="invalid-unicode"):
        Preparer(tok, 4096)(0, record)


def _sample_files(out, n):
    sink = SafetensorsSink(str(out))
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        T = 5 + i
        rows = torch.randn(T, 4, 16, generator=g).bfloat16()
        sink.write(i, torch.arange(T), torch.ones(T, dtype=torch.long), rows[:, :3], rows[:, 3])


def test_finalize_names_a_sample_file_cut_short_and_loses_nothing(tmp_path, capsys):
    out = tmp_path / "out"  # --shard outputs copied into one folder: no manifest.json
    _sample_files(out, 3)
    assert cli.main(["--finalize", "--format", "safetensors", "--output", str(out)]) == 0
    capsys.readouterr()
    before = {p: (out / p).read_bytes() for p in sorted(os.listdir(out)) if (out / p).is_file()}
    hs = sorted(os.listdir(out / "hidden_states"))
    for cut in (100, 5):  # the data cut short; the header cut short
        cut_copy = out / "hs_7.safetensors"
        cut_copy.write_bytes((out / "hs_1.safetensors").read_bytes()[:cut])  # a copy that did not finish
        assert cli.main(["--finalize", "--format", "safetensors", "--output", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"{out / 'hs_7.safetensors'} is not a whole sample file" in err and "cut short" in err, err
        assert "--resume" in err and "no speculators dataset written" in err, err
        assert cut_copy.exists(), "the cut file was removed"
        assert {p: (out / p).read_bytes() for p in before} == before, "a file of the folder changed"
        assert sorted(os.listdir(out / "hidden_states")) == hs, "the dataset already there changed"


def test_skips_are_reported_with_their_place_counted_all_and_listed_first():
    stats = output.Stats()
    lines = [stats.skip("invalid-utf8", "byte 0xe9 at character 46 is not UTF-8", f"sample {i} (line {i + 1} of d.jsonl)",
                        sample=i, line=i + 1) for i in range(output.SKIPS_PRINTED + 5)]
    assert lines[0] == ("[extract] skipped sample 0 (line 1 of d.jsonl): invalid-utf8: byte 0xe9 at character 46 is "
                        "not UTF-8")
    assert lines[output.SKIPS_PRINTED - 1].endswith(f"(the next skips are only counted; manifest.json lists the first "
                                                 f"{output.SKIPS_LISTED})")
    assert all(lines[:output.SKIPS_PRINTED]) and not any(lines[output.SKIPS_PRINTED:])
    s = stats.summary()
    assert s["skipped"] == {"invalid-utf8": output.SKIPS_PRINTED + 5}
    assert s["skipped_records"][7] == {"sample": 7, "line": 8, "reason": "invalid-utf8",
                                       "detail": "byte 0xe9 at character 46 is not UTF-8"}


def test_an_extracted_sample_with_inf_or_nan_rows_is_skipped_not_failed(tmp_path):
    """--data with --save-dtype fp8: the sample no FP8 scale stores is skipped (it failed the run, exit 1,
    and failed again at every --resume); its record is acknowledged, the other samples are written."""
    from types import SimpleNamespace

    class Reader:
        acked = []

        def ack(self, rec):
            self.acked.append(rec)

    bar = ProgressLines()
    ns = SimpleNamespace(data=str(tmp_path / "d.jsonl"))
    ext = cli.Extraction(ns, "http://unused", Reader(), SafetensorsSink(str(tmp_path / "out"), "fp8"), None, None)
    rows = torch.randn(2, 6, 4, 16).bfloat16()
    rows[1, 3, 2, 5] = float("nan")
    for index in (0, 1):
        fut = ext.write_pool.submit(ext._write, index, torch.arange(6), torch.ones(6), rows[index, :, :3],
                                    rows[index, :, 3], False)
        ext.writes.append((index, 6, fut, f"record {index}"))
    ext.write_pool.shutdown(wait=True)
    assert ext._collect_writes(bar) == 2
    assert (ext.stats.done, dict(ext.stats.skipped), ext.stats.failed) == (1, {"non_finite_rows": 1}, [])
    assert Reader.acked == ["record 0", "record 1"] and ext.sink.done(0) and not ext.sink.done(1)
    assert bar.lines == ["[extract] skipped sample 1: non_finite_rows: its hidden states hold inf or NaN, which "
                         "--save-dtype fp8 cannot store"]
