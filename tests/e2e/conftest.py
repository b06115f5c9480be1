"""One real server per configuration, shared by the tests of a session."""
import pytest

from helpers import Launcher

CHUNK = 16


@pytest.fixture(scope="session")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hs") / "dump"


@pytest.fixture(scope="session")
def capture_server(dump_dir):
    """The embedded tiny DeepSeek-V3 on the CPU engine with capture on, chunked prefill of 16 tokens,
    radix cache, overlap scheduler and the server's own warm-up all left on."""
    server = Launcher(["--hs-dump-dir", str(dump_dir), "--hs-last", "--chunked-prefill-size", str(CHUNK)])
    try:
        yield server.wait_ready()
    finally:
        rc = server.stop()
        assert rc == 128 + 15, f"launcher exit {rc}:\n{server.tail()}"  # stopped by our SIGTERM
