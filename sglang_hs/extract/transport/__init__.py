"""How the captured records reach this process: one transport per kind, behind transport/base.py's interface
(sglang_hs.HiddenStateReader is the node-local ring's). A new transport is a file here with a class of
`name`, for_requests(dump_dir, owner) and for_harvest(dump_dir, owner), and its line in TRANSPORTS."""
from sglang_hs.extract.transport.base import Transport  # noqa: F401 (the interface)
from sglang_hs.extract.transport.mooncake import MooncakeTransport
from sglang_hs.extract.transport.ring import RingTransport

TRANSPORTS = {t.name: t for t in (
    RingTransport,
    MooncakeTransport,  # another host's server, through its publisher (sglang_hs/publish.py) and Mooncake
)}
