"""The source stage (sglang_hs/extract/sources/): --data's records this run takes, with the places its messages
and manifest.json give them; and the samples sent to a running server, each record taken from the transport by
its rid and written by the sink stage, through a stand-in server and an in-memory transport (no ring)."""
import threading
from types import SimpleNamespace

import torch

from helpers import json_server
from sglang_hs.extract.config import RequestSettings
from sglang_hs.extract.dataset import Sample, SkipSample
from sglang_hs.extract.selection import Selection
from sglang_hs.extract.sinks import SINKS, TrainingSample
from sglang_hs.extract.sources.dataset_file import DatasetSource
from sglang_hs.extract.sources.launch import last_state_for
from sglang_hs.extract.sources.server import Extraction
from sglang_hs.extract.transport import Transport

K, H = 2, 8


def _data(tmp_path, n):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"input_ids": {list(range(1, 2 + i % 3))}}}\n' for i in range(n)))
    return str(path)


def test_a_dataset_source_yields_its_shard_up_to_max_samples_with_file_indices(tmp_path):
    path = _data(tmp_path, 10)
    source = DatasetSource(path, Selection("1/3", given=True), max_samples=8)
    assert [i for i, _ in source] == [1, 4, 7] and source.total() == 3
    assert dict(source)[4] == {"input_ids": [1, 2]}
    assert source.place(4) == (f"sample 4 (line 5 of {path})", {"sample": 4, "line": 5})
    assert [i for i, _ in DatasetSource(path, Selection())] == list(range(10))


def test_a_started_server_captures_the_final_state_its_format_needs():
    assert [last_state_for(f, v) for f in ("specforge", "safetensors") for v in (0.0, 0.5)] == [
        "post-norm", "post-norm", "pre-norm", "both"]


class MemoryTransport:
    """The transport interface over a dict: the stand-in server puts each request's record here before it
    replies, as the real server publishes before its reply leaves."""

    def __init__(self, dump_dir):
        self.manifest, self.dump_dir, self.markers, self.restarts = {}, dump_dir, 0, 0
        self.ready, self.acked, self.discarded, self.lock = {}, [], [], threading.Lock()

    def publish(self, rid, ids):
        T = len(ids)
        rows = torch.arange(T * (K + 1) * H, dtype=torch.float32).view(T, K + 1, H) + 1000 * ids[0]
        with self.lock:
            self.ready[rid] = SimpleNamespace(rid=rid, input_ids=torch.tensor(ids), num_tokens=T,
                                              aux_hidden_states=rows[:, :K], last_hidden_state=rows[:, K],
                                              last_pre_norm=None)

    def poll(self):
        return 0

    def pop_ready(self, rid):
        with self.lock:
            return self.ready.pop(rid, None)

    def ready_rids(self):
        with self.lock:
            return list(self.ready)

    def not_captured(self, rid):
        return None

    def discard(self, rid):
        with self.lock:
            self.discarded += [rid] if self.ready.pop(rid, None) is not None else []
        return 0

    def next(self, timeout=None):
        raise TimeoutError

    def ack(self, rec):
        self.acked.append(rec.rid)

    def intact(self, rec):
        return True

    def unread_bytes(self):
        return 0

    def close(self):
        pass


def _preparer(index, record):
    if not record["input_ids"][1:]:
        raise SkipSample("too-short", "one token")
    return Sample(index, record["input_ids"], [1] * len(record["input_ids"]))


def test_samples_go_to_the_server_and_their_records_through_the_transport_to_the_sink(tmp_path):
    path = _data(tmp_path, 7)  # samples 0, 3, 6 hold one token: skipped by the preparer
    transport = MemoryTransport(str(tmp_path))
    assert isinstance(transport, Transport)
    sent = []

    def post(route, body):
        sent.append(body)
        transport.publish(body["rid"], body["input_ids"])
        if body["rid"].endswith("-1"):
            transport.publish("another-client-1", [5, 6])  # not ours: given back, counted
        return {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"}}}

    http, url = json_server(post, get=True)
    try:
        sink = SINKS["specforge"](str(tmp_path / "out"))
        rows = torch.zeros(2, K + 1, H)
        sink.write(TrainingSample(4, torch.tensor([1, 2]), torch.ones(2), rows[:, :K], rows[:, K]))  # a run before
        requests = RequestSettings(2, 0.0, 30.0, False, 1, 0.0, 1.0)
        ext = Extraction(requests, url, transport, sink, _preparer, None, progress=False)
        ext.run(DatasetSource(path, Selection()), sink.resume_state())
    finally:
        http.shutdown()
    assert sorted(b["rid"].rsplit("-", 1)[1] for b in sent) == ["1", "2", "5"]  # 4's file is there
    assert all(b["sampling_params"]["max_new_tokens"] == 1 and b["rid"].startswith("hsx-") for b in sent)
    assert sorted(transport.acked) == sorted(b["rid"] for b in sent)  # each record once, once its file is in place
    assert transport.discarded == ["another-client-1"] and ext.stats.foreign == 1
    s = ext.stats
    assert (s.done, s.resumed, dict(s.skipped), s.failed) == (3, 1, {"too-short": 3}, [])
    assert s.skipped_records[0] == {"sample": 0, "line": 1, "reason": "too-short", "detail": "one token"}
    for i, ids in ((1, [1, 2]), (2, [1, 2, 3]), (5, [1, 2, 3])):
        d = torch.load(sink.path(i))
        assert d["input_ids"].tolist() == ids and d["loss_mask"].tolist() == [1] * len(ids)
        want = torch.arange(len(ids) * (K + 1) * H, dtype=torch.float32).view(len(ids), K + 1, H) + 1000
        assert torch.equal(d["hidden_state"][0], want[:, K])  # the record's rows, as the server published them
        assert torch.equal(d["aux_hidden_state"][0], want[:, :K].reshape(len(ids), -1))
