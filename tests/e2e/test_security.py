"""Request ids never become paths, and nothing listens beyond loopback when the server binds 127.0.0.1,
but for one known upstream exception: torch.distributed's rendezvous store (SGLang's process-group
init on its `nccl_port`, chosen below the ephemeral port range) binds the wildcard address; torch has
no option to bind it elsewhere (docs/security.md#the-network). The test pins that to exactly that one
socket, so any new exposure fails it."""
import os
import re

import pytest

from helpers import leftover_server_processes
from sglang_hs import HiddenStateReader

pytestmark = pytest.mark.e2e
EXPECTED = {"manifest.json", "ring-w0.bin", "ring-w0.offset", "store-w0.bin", ".lock"}


def _names(dump_dir):
    """The dump dir's entries, less the temporary file of a status rewrite in flight (the overlay's thread
    writes `.overlay-<pid>.json.<hex>.tmp` and renames it over its status file every tick)."""
    return {n for n in os.listdir(dump_dir) if not re.fullmatch(r"\.overlay-\d+\.json\.[0-9a-f]{8}\.tmp", n)}


@pytest.mark.parametrize("rid", ["../../../tmp/evil", "a/b/c", "x\x00y", "..", "/abs/path", "é 漢字 ✓"])
def test_request_ids_are_data_never_paths(capture_server, dump_dir, rid, tmp_path):
    before = _names(dump_dir)
    out = capture_server.generate(input_ids=[5, 6, 7, 8], rid=rid, sampling_params={"max_new_tokens": 1})
    with HiddenStateReader(str(dump_dir)) as reader:
        rec = reader.take(rid, timeout=60)
    assert rec.rid == rid and rec.input_ids.tolist() == [5, 6, 7, 8] and out["meta_info"]["id"] == rid
    after = _names(dump_dir)
    assert after == before and {n for n in after if not n.startswith("overlay-")} <= EXPECTED
    assert not os.path.exists("/tmp/evil") and not os.path.exists(os.path.join(dump_dir, "a"))


def _listening_inodes():
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    out[cols[9]] = cols[1]
    return out


def _addr(hexaddr):
    ip, port = hexaddr.split(":")
    if len(ip) == 8:
        ip = ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return ip, int(port, 16)


def test_server_listens_on_loopback_only(capture_server):
    listening = _listening_inodes()
    bound = []
    for pid in leftover_server_processes(capture_server.output):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                bound.append(_addr(listening[target[8:-1]]))
    assert ("127.0.0.1", capture_server.port) in bound, bound
    loopback = ("127.0.0.1", "00000000000000000000000001000000")
    exposed = [(ip, port) for ip, port in bound if ip not in loopback]
    assert len(exposed) <= 1 and all(port < 32768 for _, port in exposed), bound  # the torch store only
