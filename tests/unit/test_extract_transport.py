"""The transport stage (sglang_hs/extract/transport/): the node-local ring is HiddenStateReader as it is, opened
the way each run reads it, its refusals one line naming the flag; TRANSPORTS is the registry a new transport
(Mooncake) joins with one line. On a dump the real writer and ring fill, without a server."""
import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from sglang_hs.extract.errors import ExtractError  # noqa: E402
from sglang_hs.extract.transport import TRANSPORTS, Transport  # noqa: E402
from sglang_hs.extract.transport.ring import RingTransport  # noqa: E402
from sglang_hs.reader import HiddenStateReader  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402

H, SLOTS = 8, 32


@pytest.fixture
def dump(tmp_path):
    d = tmp_path / "dump"
    d.mkdir(mode=0o700)
    w = CaptureWriter(str(d), CaptureSpec.resolve([1, 2], True, 4, H), SLOTS, torch.float32, 1 << 16)
    w.store.copy_(torch.arange(w.store.numel(), dtype=torch.float32).view_as(w.store))
    w.folder = str(d)
    return w


def test_the_registry_holds_the_node_local_ring_and_mooncake():
    from sglang_hs.extract.transport.mooncake import MooncakeTransport  # importing it needs no Mooncake

    assert TRANSPORTS == {"ring": RingTransport, "mooncake": MooncakeTransport}
    for t in TRANSPORTS.values():  # what a transport offers the runs
        assert callable(t.for_requests) and callable(t.for_harvest)


@pytest.mark.parametrize("opening", ["for_requests", "for_harvest"])
def test_the_ring_is_a_transport_and_gives_records_back_on_ack(dump, opening):
    dump.publish_gathered("r1", torch.arange(4, dtype=torch.int32), torch.arange(4), prompt_len=2, next_token=9)
    reader = getattr(RingTransport, opening)(dump.folder, None)
    try:
        assert isinstance(reader, HiddenStateReader) and isinstance(reader, Transport)
        assert reader.manifest["layer_ids"] == [1, 2]
        rec = reader.next(timeout=5)
        assert rec.rid == "r1" and rec.input_ids.tolist() == [0, 1, 2, 3] and rec.prompt_len == 2
        assert torch.equal(rec.aux_hidden_states, dump.store[:4, :2])
        assert dump.ring.free_bytes() < dump.ring.capacity
        reader.ack(rec)
        assert dump.ring.free_bytes() == dump.ring.capacity
    finally:
        reader.close()


def test_a_dump_another_reader_holds_is_refused_in_one_line(dump):
    d = dump.folder
    with HiddenStateReader(d):
        with pytest.raises(ExtractError) as e:
            RingTransport.for_requests(d, None)
        assert str(e.value).startswith("--hs-dump-dir: ") and "already read by another HiddenStateReader" in str(
            e.value) and "\n" not in str(e.value)
        with pytest.raises(ExtractError, match="^--from-dump: .*already read by another HiddenStateReader"):
            RingTransport.for_harvest(d, None)


def test_a_harvest_refuses_what_is_no_dump_in_one_line(tmp_path):
    with pytest.raises(ExtractError, match=f"^--from-dump: {tmp_path / 'nope'} is not a folder$"):
        RingTransport.for_harvest(str(tmp_path / "nope"), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExtractError, match="^--from-dump: .*empty holds no manifest.json \\(is a server running"):
        RingTransport.for_harvest(str(tmp_path / "empty"), None)
