"""`python -m sglang_hs.extract --from-dump DIR` (sglang_hs/extract/harvest.py) on a dump written by the real
writer and ring (no server): each record of a request becomes one training file whose rows are the store
rows it was gathered from and whose loss mask is 1 exactly on the generated rows; markers and records with
no generated row are skipped and counted; a harvester that dies between writing a file and acknowledging
its record, or between writing it and journaling it, and is started again, ends with every record's file
exactly once; bad flags get one line. The real server, SIGKILL and the trainers' readers:
tests/e2e/test_harvest.py."""
import json
import os
import shlex
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.extract import cli, harvest, output
from sglang_hs.server.store.writer import CaptureWriter

H, SLOTS = 8, 64


class Crash(BaseException):
    """Stands in for the process dying at that point (nothing below catches a BaseException)."""


def _dump(path, last="both"):
    path.mkdir(mode=0o700)
    w = CaptureWriter(str(path), CaptureSpec.resolve([1, 2], last, 4, H), SLOTS, torch.float32, 1 << 18)
    s, p, h = torch.meshgrid(torch.arange(SLOTS), torch.arange(w.P), torch.arange(H), indexing="ij")
    w.store.copy_(s + p / 8 + h / 1024)  # differs per slot, layer and index
    return w


# (rid, prompt length, generated tokens); the record holds prompt + generated[:-1]
REQUESTS = [("a", 5, 3), ("b", 4, 1), ("c", 3, 6), ("d", 6, 2), ("e", 2, 4)]


def _speculative(i):
    """The metadata a speculative server's finish hook gives request i's record (capture_hooks.record_meta)."""
    steps = [i % 3, 2, 0][: 1 + i % 3]
    return {"speculative": {"verify_steps": len(steps), "accepted_drafts": steps}}


def _publish(w, requests=REQUESTS, first_slot=0):
    """Each request's record from its own KV slots, odd ones with speculative metadata; a marker between each.
    Returns rid -> (ids, slots, p, next)."""
    from sglang_hs.server.store.ring import encode_meta

    out, slot = {}, first_slot
    for i, (rid, p, g) in enumerate(requests):
        tokens = [100 * i + t for t in range(p + g)]
        T = p + g - 1
        slots = torch.arange(slot, slot + T) % SLOTS
        slot += T
        w.publish_gathered(rid, torch.tensor(tokens[:T], dtype=torch.int32), slots, prompt_len=p,
                           next_token=tokens[T], meta=encode_meta(_speculative(i)) if i % 2 else b"")
        w.publish_marker(f"unsampled-{i}", "not_sampled")
        out[rid] = tokens[:T], slots, p, tokens[T]
    return out


def m_server(dump):
    """The server's manifest, as the harvester reads it."""
    return json.load(open(os.path.join(dump, "manifest.json")))


def _run(dump, out, *flags):
    return cli.main(["--from-dump", str(dump), "--output", str(out), "--idle-timeout", "0.5", *flags])


def _journal(out):
    lines = [json.loads(x) for x in open(os.path.join(out, harvest.JOURNAL))]
    return {e["rid"]: e for e in lines if "index" in e}, lines


def _check_files(w, out, sent, fmt="specforge"):
    """Every request with a generated row has one file, exactly its rows and mask; returns the journal."""
    from sglang_hs.extract.sinks import SINKS

    sink = SINKS[fmt](str(out))
    files, lines = _journal(out)
    assert len([e for e in lines if "index" in e]) == len(files), "a record journaled twice"
    want = {rid for rid, (ids, _, p, _) in sent.items() if len(ids) > p}
    assert set(files) == want and sink.existing() == len(want)
    for rid in want:
        ids, slots, p, nxt = sent[rid]
        e = files[rid]
        assert (e["prompt_len"], e["next_token"], e["tokens"]) == (p, nxt, len(ids))
        i = next((k for k, r in enumerate(REQUESTS) if r[0] == rid), None)  # the speculative meta, where it was
        assert e.get("speculative") == (_speculative(i)["speculative"] if i is not None and i % 2 else None), e
        rows, K = w.store[slots], w.spec.num_aux  # [layers, post-norm, pre-norm] per token (_dump: --hs-last both)
        if fmt == "specforge":  # the post-norm state, in bf16 (SpecForge's TargetHead reads bf16 only)
            d = torch.load(sink.path(e["index"]))
            got_ids, mask, aux, last = d["input_ids"], d["loss_mask"], d["aux_hidden_state"][0], d["hidden_state"][0]
            assert aux.dtype == last.dtype == torch.bfloat16
            assert torch.equal(aux, rows[:, :K].reshape(len(ids), -1).bfloat16())
            assert torch.equal(last, rows[:, K].bfloat16())
        else:  # the pre-norm state, in the server's dtype
            from safetensors.torch import load_file

            d = load_file(sink.path(e["index"]))
            got_ids, mask = d["token_ids"], d["loss_mask"]
            assert torch.equal(d["hidden_states"], torch.cat([rows[:, :K], rows[:, K + 1:K + 2]], dim=1))
        assert got_ids.tolist() == ids
        assert mask.tolist() == [0] * p + [1] * (len(ids) - p), (rid, mask)
    return files


@pytest.mark.parametrize("part", [[], ["--part-mb", "0.0002"]], ids=["whole", "chunked"])
@pytest.mark.parametrize("fmt", ["specforge", "safetensors"])
def test_records_become_files_masked_on_the_generated_rows(tmp_path, fmt, part, capsys):
    """chunked: --part-mb of 209 bytes, every record (512-1,024 bytes of rows) a long one: views of the ring
    written a row or two at a time, the same files."""
    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    assert _run(tmp_path / "dump", tmp_path / "out", "--format", fmt, *part) == 0
    _check_files(w, tmp_path / "out", sent, fmt)
    m = json.load(open(tmp_path / "out" / "manifest.json"))
    assert m["samples_written"] == 4 and m["status"] == "complete" and m["from_dump"] == str(tmp_path / "dump")
    assert m["skipped"] == {"no_generated_rows": 1, "served_without_capture": 5}, m["skipped"]
    if fmt == "safetensors":  # finalized as a completed extraction run: speculators' dataset over the files
        assert m["speculators_dataset_rows"] == 4 and os.path.exists(tmp_path / "out" / "state.json")
    said = capsys.readouterr().err  # the trainer's command on these files, as a --data run prints it
    cmd = shlex.join(output.training_command(str(tmp_path / "out"), m_server(tmp_path / "dump"), fmt, None))
    trainer = "SpecForge 0.2.0" if fmt == "specforge" else "speculators 0.9.0"
    assert f"[extract] train with {trainer}:\n  {cmd}\n" in said, said
    if fmt == "specforge":  # the run config it names, beside the files
        run = json.load(open(tmp_path / "out" / output.SPECFORGE_CONFIG))
        assert run["data"]["hidden_states_path"] == str(tmp_path / "out")
    assert w.ring.free_bytes() == w.ring.capacity  # every record acknowledged
    # more traffic later: a second run continues in the same folder, same ring numbering
    more = _publish(w, [("f", 3, 3)], first_slot=40)
    assert _run(tmp_path / "dump", tmp_path / "out", "--format", fmt, *part) == 0
    files = _check_files(w, tmp_path / "out", {**sent, **more}, fmt)
    assert len({e["index"] >> harvest.RING_SHIFT for e in files.values()}) == 1


@pytest.mark.parametrize("where", ["before the ack", "before the journal line"])
def test_a_harvester_killed_mid_record_and_restarted_loses_and_duplicates_nothing(tmp_path, monkeypatch, where):
    from sglang_hs.reader import HiddenStateReader

    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    calls = []
    name, owner = ("ack", HiddenStateReader) if where == "before the ack" else ("add_file", harvest.Journal)
    original = getattr(owner, name)

    def dies_on_the_third(self, *a):
        calls.append(a)
        if len(calls) == 3:
            raise Crash(where)
        return original(self, *a)

    monkeypatch.setattr(owner, name, dies_on_the_third)
    with pytest.raises(Crash):
        _run(tmp_path / "dump", tmp_path / "out")
    monkeypatch.setattr(owner, name, original)
    assert w.ring.free_bytes() < w.ring.capacity  # records not acknowledged stayed in the ring
    assert _run(tmp_path / "dump", tmp_path / "out") == 0
    _check_files(w, tmp_path / "out", sent)
    m = json.load(open(tmp_path / "out" / "manifest.json"))
    # before the ack: a and c written, c acknowledged never; before the journal: d's file there, unjournaled
    assert m["samples_already_done"] == 1 and m["samples_written"] == {"before the ack": 2}.get(where, 1)
    assert w.ring.free_bytes() == w.ring.capacity


def test_max_samples_stops_after_that_many_files_and_the_rest_wait_in_the_ring(tmp_path):
    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    assert _run(tmp_path / "dump", tmp_path / "out", "--max-samples", "2") == 0
    assert len(_journal(tmp_path / "out")[0]) == 2
    assert _run(tmp_path / "dump", tmp_path / "out") == 0
    _check_files(w, tmp_path / "out", sent)


def test_idle_timeout_waits_while_the_server_has_requests_in_flight(tmp_path, monkeypatch, capsys):
    """--idle-timeout counts only while the server is idle too: with a captured request in flight (its
    status file says unaccounted 1), a harvester goes on waiting past the timeout and takes that request's
    record when it comes; once nothing is in flight and nothing more arrives, it stops. (The old form
    stopped at the timeout and left the late record in the ring.)"""
    import threading

    from sglang_hs.server import overlay_status

    monkeypatch.setattr(overlay_status, "FLUSH_INTERVAL_S", 0.02)
    w = _dump(tmp_path / "dump")
    served = overlay_status.OverlayStatus(str(tmp_path / "dump"), "DeepseekV3ForCausalLM", w.spec)
    served.sources.update(writer=w.stats)
    in_flight = [1]
    served.unaccounted = lambda: in_flight[0]
    waited, idle = threading.Semaphore(0), harvest._idle

    def watched(*a):
        busy = not idle(*a)
        if busy:
            waited.release()
        return not busy

    monkeypatch.setattr(harvest, "_idle", watched)
    sent = {}

    def the_server():  # once the harvester has outlived two idle timeouts: the long request's record, then idle
        assert waited.acquire(timeout=60) and waited.acquire(timeout=60)
        sent.update(_publish(w, [("late", 4, 3)]))
        in_flight[0] = 0

    t = threading.Thread(target=the_server)
    t.start()
    try:
        assert _run(tmp_path / "dump", tmp_path / "out", "--idle-timeout", "0.2") == 0  # signals: the main thread
    finally:
        t.join(60)
        served.stop()
    assert "the server has 1 request(s) in flight" in capsys.readouterr().err
    _check_files(w, tmp_path / "out", sent)
    assert w.ring.free_bytes() == w.ring.capacity  # taken and acknowledged, not left in the ring


def test_a_journal_line_cut_by_a_crash_is_dropped(tmp_path):
    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    assert _run(tmp_path / "dump", tmp_path / "out", "--max-samples", "1") == 0
    with open(tmp_path / "out" / harvest.JOURNAL, "a") as f:
        f.write('{"index": 12, "rid": "half')
    assert _run(tmp_path / "dump", tmp_path / "out") == 0
    _check_files(w, tmp_path / "out", sent)


@pytest.mark.parametrize("flags, message", [
    (["--data", "x.jsonl"], "--data does not go with --from-dump"),
    (["--server", "http://x"], "--server does not go with --from-dump"),
    (["--regenerate"], "--regenerate does not go with --from-dump"),
    (["--tp", "2"], "--tp: --from-dump reads a running server's dump; it starts no server"),
    (["--finalize", "--format", "safetensors"], "--finalize does not go with --from-dump"),
    (["--idle-timeout", "0"], "--idle-timeout: seconds > 0"),
    (["--max-samples", "0"], "--max-samples: must be >= 1 with --from-dump"),
])
def test_flags_that_do_not_go_with_from_dump_are_refused_in_one_line(tmp_path, capsys, flags, message):
    assert cli.main(["--from-dump", str(tmp_path), "--output", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bad_dumps_and_outputs_are_refused_in_one_line(tmp_path, capsys):
    def refused(args, message):
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err

    refused(["--idle-timeout", "5", "--data", "x", "--output", str(tmp_path / "o")], "--idle-timeout is for --from-dump")
    refused(["--from-dump", str(tmp_path / "nope"), "--output", str(tmp_path / "o")], "is not a folder")
    (tmp_path / "empty").mkdir()
    refused(["--from-dump", str(tmp_path / "empty"), "--output", str(tmp_path / "o")], "holds no manifest.json")
    _dump(tmp_path / "no-last", last=False)
    refused(["--from-dump", str(tmp_path / "no-last"), "--output", str(tmp_path / "o")],
            "--format specforge needs the final hidden state")
    _dump(tmp_path / "dump")
    from sglang_hs.extract.sinks import SpecForgeSink

    other = SpecForgeSink(str(tmp_path / "other"))
    other.write(0, torch.arange(3), torch.ones(3), torch.zeros(3, 2, H), torch.zeros(3, H))
    refused(["--from-dump", str(tmp_path / "dump"), "--output", str(tmp_path / "other")], "(no harvest journal)")


def test_a_second_harvester_into_the_same_output_is_refused_and_touches_nothing(tmp_path, capsys):
    """Two harvesters (of two servers) into one --output would both number their ring 0 and overwrite each
    other's files: the journal's lock lets one in and refuses the other before it removes or writes anything."""
    from sglang_hs.extract.sinks import TMP_SUFFIX

    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    out = tmp_path / "out"
    out.mkdir()
    first = harvest.Journal(str(out))  # the running harvester (flock: another open of the file is refused)
    manifest = json.load(open(tmp_path / "dump" / "manifest.json"))  # of the same server: only the lock refuses
    first.check_setup(harvest.setup_of(SimpleNamespace(format="specforge", save_dtype=None), manifest), str(out))
    (out / "rows_0").mkdir()
    partial = out / "rows_0" / f"data_7.ckpt{TMP_SUFFIX}"  # the running harvester's file in the making
    partial.write_bytes(b"half")
    before = (out / harvest.JOURNAL).read_bytes()
    assert _run(tmp_path / "dump", out) == 2
    err = capsys.readouterr().err.strip()
    assert f"--output {out} is being harvested into by another harvester" in err and len(err.splitlines()) == 1, err
    assert partial.read_bytes() == b"half" and (out / harvest.JOURNAL).read_bytes() == before
    assert not (out / "manifest.json").exists() and w.ring.free_bytes() < w.ring.capacity  # nothing read
    first.close()  # the first one ends (the kernel drops the lock of a killed one just the same)
    os.remove(out / harvest.JOURNAL)
    partial.unlink()
    assert _run(tmp_path / "dump", out) == 0
    _check_files(w, out, sent)


def test_a_harvester_started_again_against_another_setup_is_refused(tmp_path, capsys):
    def refused(dump, flags, *said):
        assert _run(dump, tmp_path / "out", *flags) == 2
        err = capsys.readouterr().err.strip()
        assert f"--output {tmp_path / 'out'} holds files harvested with another setup" in err, err
        assert all(s in err for s in said) and len(err.splitlines()) == 1, err

    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    assert _run(tmp_path / "dump", tmp_path / "out") == 0
    capsys.readouterr()
    journal = (tmp_path / "out" / harvest.JOURNAL).read_bytes()
    refused(tmp_path / "dump", ["--format", "safetensors"], "format 'specforge' there, 'safetensors' now")
    refused(tmp_path / "dump", ["--format", "safetensors", "--save-dtype", "fp8"],
            "save_dtype 'bf16' there, 'fp8' now")  # --format specforge is written in bf16 by default
    other = tmp_path / "other-model"  # another model's server: other layers, hidden size and dtype
    other.mkdir(mode=0o700)
    w2 = CaptureWriter(str(other), CaptureSpec.resolve([1, 3], True, 4, 2 * H), SLOTS, torch.bfloat16, 1 << 18)
    w2.publish_gathered("x", torch.arange(4, dtype=torch.int32), torch.arange(4), prompt_len=2, next_token=1)
    refused(other, [], "dtype 'float32' there, 'bfloat16' now", f"hidden_size {H} there, {2 * H} now",
            "layer_ids [1, 2] there, [1, 3] now")
    assert (tmp_path / "out" / harvest.JOURNAL).read_bytes() == journal  # refused before writing anything
    assert w2.ring.free_bytes() < w2.ring.capacity  # and before taking a record
    # an output of the version before the setup line: the last manifest says what its files are
    lines = [x for x in journal.splitlines(True) if b'"setup"' not in x]
    (tmp_path / "out" / harvest.JOURNAL).write_bytes(b"".join(lines))
    refused(other, [], "layer_ids [1, 2] there, [1, 3] now")
    assert _run(tmp_path / "dump", tmp_path / "out") == 0  # the same setup goes on
    _check_files(w, tmp_path / "out", sent)


def test_a_torn_record_stops_the_harvester_in_one_line_and_keeps_the_files_written(tmp_path, capsys):
    from sglang_hs.server.store.ring import HEADER_BYTES, OFF_HEAD

    w = _dump(tmp_path / "dump")
    sent = _publish(w)
    out = tmp_path / "out"
    assert _run(tmp_path / "dump", out, "--format", "safetensors") == 0
    capsys.readouterr()
    pos = w.ring.r.load_acquire(OFF_HEAD) % w.ring.capacity
    w.publish_gathered("torn", torch.arange(5, dtype=torch.int32), torch.arange(5), prompt_len=2, next_token=9)
    w.ring.r.buf[HEADER_BYTES + pos] ^= 0xFF  # its header's magic: bytes that are not what the server wrote
    assert _run(tmp_path / "dump", out, "--format", "safetensors") == 1
    err = capsys.readouterr().err.strip().splitlines()
    errors = [x for x in err if "error" in x]
    assert len(errors) == 1 and "corrupt record header" in errors[0] and "files written before it are kept" in errors[0]
    assert "Traceback" not in "\n".join(err)
    m = json.load(open(out / "manifest.json"))
    assert m["status"] == "stopped by a torn record" and m["speculators_dataset_rows"] == 4, m
    _check_files(w, out, sent, "safetensors")  # the files before it: whole, journaled, and the training set


def test_a_record_with_inf_or_nan_rows_is_skipped_by_rid_and_the_queue_moves_on(tmp_path, capsys):
    """FP8 has no scale for inf or NaN: such a record is skipped, counted and reported with its rid, and
    acknowledged, so the records behind it are harvested and a restarted harvester does not stop at it."""
    w = _dump(tmp_path / "dump")
    w.store[12, 1, 3] = float("inf")  # a row of request c (slots 11-18)
    w.store[27, 0, 0] = float("nan")  # and of request e (slots 26-30)
    sent = _publish(w)
    out = tmp_path / "out"
    assert _run(tmp_path / "dump", out, "--format", "safetensors", "--save-dtype", "fp8") == 0
    err = capsys.readouterr().err
    files, _ = _journal(out)
    assert sorted(files) == ["a", "d"], files  # the records behind c's and e's too
    assert w.ring.free_bytes() == w.ring.capacity  # every record acknowledged, the skipped ones with them
    m = json.load(open(out / "manifest.json"))
    assert m["status"] == "complete" and m["samples_written"] == 2, m
    assert m["skipped"] == {"no_generated_rows": 1, "non_finite_rows": 2, "served_without_capture": 5}, m["skipped"]
    ring = files["a"]["ring"]
    skipped = [(r["rid"], r["ring"], r["seq"]) for r in m["skipped_records"] if r["reason"] == "non_finite_rows"]
    assert skipped == [("c", ring, files["a"]["seq"] + 4), ("e", ring, files["a"]["seq"] + 8)], m["skipped_records"]
    for rid, _, seq in skipped:
        assert (f"[extract] skipped record {rid} (ring {ring}, sequence number {seq}): non_finite_rows: its hidden "
                "states hold inf or NaN, which --save-dtype fp8 cannot store") in err, err
    from safetensors.torch import load_file

    for rid in ("a", "d"):  # the others' files are whole FP8 files of their rows
        ids, slots, _, _ = sent[rid]
        d = load_file(os.path.join(out, f"hs_{files[rid]['index']}.safetensors"))
        assert d["hidden_states"].dtype == torch.float8_e4m3fn and d["token_ids"].tolist() == ids
    more = _publish(w, [("f", 3, 3)], first_slot=40)  # a restart goes on behind them
    assert _run(tmp_path / "dump", out, "--format", "safetensors", "--save-dtype", "fp8") == 0
    assert sorted(_journal(out)[0]) == ["a", "d", "f"] and more
