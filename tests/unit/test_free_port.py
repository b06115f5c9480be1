"""free_port() (sglang_hs/tools/server_process.py): the port a launched server binds only after its start-up.

It is drawn below the kernel's ephemeral range, which outgoing connections take their local ports from:
a port of that range, free when drawn, was taken by a connection during a server's 20-60 s start-up
(seen in the suite: the HTTP server then failed with "address already in use")."""
import socket

import pytest

from sglang_hs.tools import server_process as sp


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _room_below_the_ephemeral_range() -> int:
    start = sp._ephemeral_start()
    if min(sp.PORTS_TO, start) - sp.PORTS_FROM < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {start}: no room below it")
    return start


def test_ports_are_drawn_below_the_ephemeral_range_and_can_be_bound():
    start = _room_below_the_ephemeral_range()
    ports = {sp.free_port() for _ in range(50)}
    assert all(sp.PORTS_FROM <= p < min(sp.PORTS_TO, start) for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random: concurrent launches do not queue for the same port
    with _listen(ports.pop()):
        pass


def test_a_taken_port_is_never_returned(monkeypatch):
    _room_below_the_ephemeral_range()
    taken = _listen(0)  # a port in use (any: the draw is forced onto it first)
    try:
        busy = taken.getsockname()[1]
        free = next(p for p in range(sp.PORTS_FROM, sp.PORTS_TO) if sp._bindable(p, "127.0.0.1", socket.AF_INET))
        monkeypatch.setattr(sp.random.SystemRandom, "sample", lambda self, population, k: [busy, free])
        assert sp.free_port() == free
    finally:
        taken.close()


def test_an_ipv6_host_gets_an_ipv6_port():
    if not socket.has_ipv6 or not sp._bindable(0, "::1", socket.AF_INET6):
        pytest.skip("no IPv6 loopback here")
    port = sp.free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_no_room_below_the_range_falls_back_to_a_port_of_the_kernels_choosing():
    port = sp.free_port(ephemeral_start=sp.PORTS_FROM + 500)
    assert port > 0
    with _listen(port):
        pass


def test_the_ephemeral_range_is_read_from_the_kernel_or_assumed(tmp_path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t60999\n")
    assert sp._ephemeral_start(str(f)) == 40000
    f.write_text("garbage\n")
    assert sp._ephemeral_start(str(f)) == 32768
    assert sp._ephemeral_start(str(tmp_path / "missing")) == 32768
