"""A server restarted under its readers: the restarted server unlinks its old ring and makes a new one (the
real CaptureWriter does, as a restarted server's does), and every reader notices once it has read what the old
ring holds. The library reader raises ServerRestarted by default and follows the server with reattach=True
(old records read ahead are still acknowledged into the old ring, never into the new one; the new ring is
locked at once, so a second reader is refused); the harvester follows it and harvests both rings' records
into distinct files; the extraction CLI stops with one line saying --resume continues, and --resume does;
the live dataset (one process, and DataLoader workers through the router) follows it and yields every
sample. Every row is checked against what the writer of its generation held.

Run as a script (`python test_server_restart.py SCENARIO DIR`), it runs one DataLoader scenario in its own
process (killed if it hangs) and prints its outcome as JSON on the last line."""
import json
import os
import sys
import threading

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.reader import HiddenStateReader, ServerRestarted  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402
import scenario_process  # noqa: E402
from helpers import ONE_TOKEN_REPLY, json_server  # noqa: E402

H, SLOTS = 8, 64
LIMIT_S = 120  # a scenario in its own process: only a hang reaches this


def start_writer(dump, generation, layers=(1, 2)):
    """What a (re)starting server does to its dump dir: the real writer, its store filled so that every
    value differs by slot, layer, hidden index and server generation (exact in float32)."""
    w = CaptureWriter(str(dump), CaptureSpec.resolve(list(layers), True, 4, H), SLOTS, torch.float32, 1 << 18)
    s, p, h = torch.meshgrid(torch.arange(SLOTS), torch.arange(w.P), torch.arange(H), indexing="ij")
    w.store.copy_(1000 * generation + s + p / 8 + h / 1024)
    return w


def expected_rows(generation, T, P=3):
    s, p, h = torch.meshgrid(torch.arange(T), torch.arange(P), torch.arange(H), indexing="ij")
    return (1000 * generation + s + p / 8 + h / 1024).float()


def publish(w, rid, T, prompt_len=None, next_token=-1):
    ids = torch.arange(T, dtype=torch.int32) + 10
    w.publish_gathered(rid, ids, torch.arange(T), prompt_len=prompt_len, next_token=next_token)


def assert_record(rec, rid, T, generation):
    assert rec.rid == rid and rec.input_ids.tolist() == list(range(10, 10 + T)), rec
    rows = expected_rows(generation, T)
    assert torch.equal(rec.aux_hidden_states, rows[:, :2]) and torch.equal(rec.last_hidden_state, rows[:, 2]), rid


@pytest.fixture
def dump(tmp_path):
    d = tmp_path / "dump"
    d.mkdir(mode=0o700)
    return d


def test_a_reader_not_told_to_reattach_raises_once_it_read_the_old_ring(dump):
    w = start_writer(dump, 0)
    publish(w, "a", 3)
    reader = HiddenStateReader(str(dump), wait=1)
    publish(w, "b", 4)
    start_writer(dump, 1)  # the restarted server
    assert_record(reader.next(timeout=5), "a", 3, 0)
    assert_record(reader.next(timeout=5), "b", 4, 0)  # what the old ring holds comes first
    with pytest.raises(ServerRestarted, match=r"ring-w0.bin: the server was restarted"):
        reader.next(timeout=5)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_an_acknowledging_reader_follows_the_restarted_server_and_acks_go_to_their_own_ring(dump, zero_copy):
    w0 = start_writer(dump, 0)
    for i in range(3):
        publish(w0, f"old{i}", 2 + i)
    reader = HiddenStateReader(str(dump), wait=1, ack=True, zero_copy=zero_copy, reattach=True)
    old = [reader.next(timeout=5) for _ in range(2)]  # read ahead, not acknowledged yet
    for i, rec in enumerate(old):
        assert_record(rec, f"old{i}", 2 + i, 0)
    # the restarted server is half-way up: its old ring is unlinked, no new manifest yet
    os.unlink(dump / "ring-w0.bin")
    assert_record(reader.next(timeout=5), "old2", 4, 0)  # the old mapping's records still come
    with pytest.raises(TimeoutError):
        reader.next(timeout=0.5)  # waits for the new server, no error
    w1 = start_writer(dump, 1)
    publish(w1, "new0", 5)
    publish(w1, "new1", 2)
    new0 = reader.next(timeout=10)
    assert_record(new0, "new0", 5, 1)
    new_id = json.load(open(dump / "manifest.json"))["writers"][0]["ring_id"]
    assert reader.restarts == 1 and new0.ring_id == new_id != old[0].ring_id and new0.seq == 1 == old[0].seq
    with pytest.raises(RuntimeError, match="already read by another HiddenStateReader"):
        HiddenStateReader(str(dump), wait=0)  # the new ring is this reader's from the moment it attached
    before = w1.ring.free_bytes()
    assert reader.unacked() == 5  # old0-2 and new0-1 (read ahead with new0)
    reader.ack(old[0])  # seq 1 of the old ring: must not release seq 1 of the new one
    assert w1.ring.free_bytes() == before and reader.unacked() == 4
    reader.ack(new0)
    assert w1.ring.free_bytes() > before
    assert_record(reader.next(timeout=5), "new1", 2, 1)
    reader.close()


def test_a_reattaching_reader_stops_in_one_line_when_the_server_comes_back_with_another_setup(dump):
    start_writer(dump, 0)
    reader = HiddenStateReader(str(dump), wait=1, reattach=True)
    start_writer(dump, 1, layers=(1, 3))
    with pytest.raises(ServerRestarted, match=r"another capture setup \(layer_ids \[1, 2\] before, \[1, 3\] now\)"):
        reader.next(timeout=5)


# -- the harvester --

def test_the_harvester_follows_a_restarted_server_and_keeps_every_record_of_both(dump, tmp_path, monkeypatch, capsys):
    from sglang_hs.extract import cli, harvest
    from sglang_hs.extract.sinks import SINKS

    out = tmp_path / "out"
    w = start_writer(dump, 0)
    for i in range(3):
        publish(w, f"old{i}", 4 + i, prompt_len=2, next_token=99)
    handled, handle = [], harvest.Harvester.handle

    def handle_then_restart(self, rec):
        handle(self, rec)
        handled.append(rec.rid)
        if len(handled) == 2:  # the server restarts while the harvester runs, one old record still unread
            w1 = start_writer(dump, 1)
            for i in range(2):
                publish(w1, f"new{i}", 3 + i, prompt_len=1, next_token=98)

    monkeypatch.setattr(harvest.Harvester, "handle", handle_then_restart)
    rc = cli.main(["--from-dump", str(dump), "--output", str(out), "--idle-timeout", "2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "was restarted: harvesting its new ring" in err
    assert handled == ["old0", "old1", "old2", "new0", "new1"]
    lines = [json.loads(x) for x in open(out / harvest.JOURNAL)]
    files = {e["rid"]: e for e in lines if "index" in e}
    assert len(files) == 5 and len({e["index"] for e in files.values()}) == 5  # no file over another
    sink = SINKS["specforge"](str(out))
    for rid, e in files.items():
        gen, T, p = (0, 4 + int(rid[3]), 2) if rid.startswith("old") else (1, 3 + int(rid[3]), 1)
        d = torch.load(sink.path(e["index"]))
        rows = expected_rows(gen, T)
        assert d["input_ids"].tolist() == list(range(10, 10 + T)) and d["loss_mask"].tolist() == [0] * p + [1] * (T - p)
        bf16 = rows.to(torch.bfloat16)  # --format specforge files are bf16 whatever the server's dtype
        assert torch.equal(d["aux_hidden_state"][0], bf16[:, :2].reshape(T, -1)), rid
        assert torch.equal(d["hidden_state"][0], bf16[:, 2]), rid


# -- the extraction CLI and the live dataset, against a fake server whose /generate publishes through the
# real writer, and which restarts (a new writer in the same dump dir) before it serves request `restart_at`

class FakeServer:
    def __init__(self, dump, restart_at=None):
        self.dump, self.restart_at = str(dump), restart_at
        self.generation, self.served = 0, 0
        self.generation_of = {}  # rid -> the generation that served it
        self.writer = start_writer(dump, 0)
        self.lock = threading.Lock()
        self.http, self.url = json_server(self.post, get=True)

    def post(self, path, body):
        if path != "/generate":
            return {}
        with self.lock:
            if self.served == self.restart_at:
                self.generation += 1
                self.writer = start_writer(self.dump, self.generation)
            self.served += 1
            self.generation_of[body["rid"]] = self.generation
            ids = body["input_ids"]
            self.writer.publish_gathered(body["rid"], torch.tensor(ids, dtype=torch.int32), torch.arange(len(ids)))
        return ONE_TOKEN_REPLY


class Preparer:
    """Record i -> the sample of ids 10 .. 10+T-1 (T = 3 + i % 3): rows 0..T-1 of the server's store."""

    def __call__(self, index, record):
        from sglang_hs.extract.dataset import Sample

        T = 3 + index % 3
        return Sample(index, list(range(10, 10 + T)), [0] + [1] * (T - 1))


N = 6


def test_the_extraction_cli_stops_in_one_line_saying_resume_continues_and_resume_does(dump, tmp_path, monkeypatch,
                                                                                          capsys):
    from sglang_hs.extract import cli
    from sglang_hs.extract.sinks import SINKS

    monkeypatch.setattr(cli, "_model_side", lambda ns, manifest, url=None: (Preparer(), None))
    from sglang_hs.extract import samples

    monkeypatch.setattr(samples, "RECORD_GRACE_S", 3.0)  # the longest wait for a record that never comes, shortened
    server = FakeServer(dump, restart_at=2)
    (tmp_path / "d.jsonl").write_text("".join('{"input_ids": [1]}\n' for _ in range(N)))
    out = tmp_path / "out"

    def run(*flags):
        return cli.main(["--data", str(tmp_path / "d.jsonl"), "--output", str(out), "--server", server.url,
                         "--hs-dump-dir", str(dump), "--concurrency", "1", "--no-progress", *flags])

    rc = run()
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 1 and len(err) == 1, err
    assert "the server was restarted" in err[0] and "rerun with --resume to continue" in err[0], err[0]
    sink = SINKS["specforge"](str(out))
    assert sink.existing() == 2  # the samples served before the restart
    assert run("--resume") == 0, capsys.readouterr().err  # against the restarted server: the rest
    assert sink.existing() == N
    for i in range(N):
        T = 3 + i % 3
        d = torch.load(sink.path(i))
        rows = expected_rows(0 if i < 2 else 1, T)
        assert d["input_ids"].tolist() == list(range(10, 10 + T))
        bf16 = rows.to(torch.bfloat16)  # --format specforge files are bf16 whatever the server's dtype
        assert torch.equal(d["aux_hidden_state"][0], bf16[:, :2].reshape(T, -1)), i
        assert torch.equal(d["hidden_state"][0], bf16[:, 2]), i


def scenario(name: str, tmp: str) -> dict:
    """The live dataset across a restart of its server: each sample's rows as served, in dataset order."""
    from torch.utils.data import DataLoader

    from sglang_hs.extract import samples
    from sglang_hs.live import LiveHiddenStates

    samples.RECORD_GRACE_S = 3.0  # today's wait for a record that never comes, shortened
    dump = os.path.join(tmp, "dump")
    os.mkdir(dump, 0o700)
    server = FakeServer(dump, restart_at=3)
    ds = LiveHiddenStates(list(range(N)), server=server.url, dump_dir=dump, concurrency=1, reader_wait=5,
                          dtype=None)  # the stand-in server's float32 rows, compared exactly
    ds._preparer = Preparer()
    workers = {"one-process": 0, "two-workers": 2}[name]
    out = [[s["input_ids"].tolist(), s["aux_hidden_state"][0].tolist(), s["hidden_state"][0].tolist()]
           for s in DataLoader(ds, batch_size=None, num_workers=workers)]
    generation = {int(rid.rsplit("-", 1)[1]): g for rid, g in server.generation_of.items()}  # by sample index
    return {"samples": out, "generation": [generation[i] for i in range(N)]}


def run_scenario(name, tmp_path):
    return scenario_process.run_scenario(__file__, name, tmp_path, LIMIT_S)


@pytest.mark.parametrize("name", ["one-process", "two-workers"])
def test_the_live_dataset_follows_a_restarted_server(tmp_path, name):
    got = run_scenario(name, tmp_path)
    assert len(got["samples"]) == N and sorted(got["generation"]) == [0] * 3 + [1] * (N - 3)
    for i in range(N):  # dataset order (two workers: one sample of each in turn)
        T = 3 + i % 3
        ids, aux, last = got["samples"][i]
        assert ids == list(range(10, 10 + T)), (i, ids)
        rows = expected_rows(got["generation"][i], T)
        assert torch.equal(torch.tensor(aux), rows[:, :2].reshape(T, -1)), i
        assert torch.equal(torch.tensor(last), rows[:, 2]), i


def test_a_server_that_never_became_ready_leaves_none_of_its_ring_files(dump):
    """The launcher removes the dump files of a server that failed to start, so the next one starts clean:
    the reader's offset file (ring-w0.offset) with the ring."""
    from sglang_hs.tools import supervisor

    start_writer(dump, 0)
    assert {"ring-w0.bin", "ring-w0.offset", "store-w0.bin", "manifest.json"} <= set(os.listdir(dump))
    sup = supervisor.Supervisor(["true"], 300, str(dump))
    sup.ready = False
    sup._cleanup_dump_dir()
    assert os.listdir(dump) == []


if __name__ == "__main__":
    print(json.dumps(scenario(sys.argv[1], sys.argv[2])))
