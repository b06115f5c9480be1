"""One real server per configuration, shared by the tests of a session."""
import glob

import pytest

from helpers import serving

CHUNK = 16


@pytest.fixture(scope="session")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hs") / "dump"


@pytest.fixture(scope="session")
def capture_server(dump_dir):
    """The embedded tiny DeepSeek-V3 on the CPU engine with capture on, chunked prefill of 16 tokens,
    radix cache, overlap scheduler and the server's own warm-up all left on."""
    yield from _serve(dump_dir, ["--hs-last", "--chunked-prefill-size", str(CHUNK)])


@pytest.fixture(scope="session")
def staging_dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hs-staging") / "dump"


@pytest.fixture(scope="session")
def staging_server(staging_dump_dir):
    """The capture server's configuration with `--hs-copy staging` and an 8-row stage: each 16-token
    prefill chunk and each batch of more than 8 decode rows is shipped in several chunks."""
    yield from _serve(staging_dump_dir, ["--hs-last", "--chunked-prefill-size", str(CHUNK), "--hs-copy", "staging",
                                         "--hs-staging-rows", "8"])


@pytest.fixture(scope="session")
def plain_dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hs-plain") / "dump"


@pytest.fixture(scope="session")
def plain_sched_server(plain_dump_dir):
    """The same model with the scheduling features off: no chunking (prompts fit one chunk), no radix
    cache, no overlap scheduler. Records must agree with the capture server's."""
    yield from _serve(plain_dump_dir, ["--hs-last", "--disable-radix-cache", "--disable-overlap-schedule"])


def _sglang_shm():
    return set(glob.glob("/dev/shm/sglang_loads_*.shm"))


def _serve(dump_dir, args):
    before = _sglang_shm()
    yield from serving(dump_dir, ["--hs-ring-size", "64MiB", *args])
    assert not list(dump_dir.glob("overlay-*.json")) and not list(dump_dir.glob("store-*.bin"))
    assert not _sglang_shm() - before  # nor SGLang's own start-up segments
