import pytest

from helpers import run_launcher

pytestmark = pytest.mark.e2e


def test_help_lists_sglang_and_sglang_hs_flags():
    r = run_launcher(["--help"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "sglang-hs (hidden-state capture)" in out
    for flag in ("--hs-dump-dir", "--hs-layers", "--hs-last", "--hs-ring-size", "--hs-startup-timeout"):
        assert flag in out
    for flag in ("--model-path", "--tp-size", "--chunked-prefill-size", "--disable-radix-cache"):
        assert flag in out  # SGLang's own
