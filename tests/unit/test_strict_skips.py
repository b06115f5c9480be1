"""Under SGLANG_HS_STRICT_SKIPS=1 (make test, CI) a skip for a missing build or missing trainer readers
fails the run; one for what a machine may lack stays a skip; without the switch both are skips."""
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY = '''
import pytest
try:
    import no_such_module_sglang_hs_C
except ImportError as e:
    pytest.skip(f"extension not built: {e}", allow_module_level=True)
'''
CASES = '''
import pytest

def test_readers():
    pytest.skip("requirements/readers.txt is not installed (run scripts/ensure_env.sh)")

def test_gpu():
    pytest.skip("needs a GPU")
'''


def _run(tmp_path, strict, body):
    (tmp_path / "test_some.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=TESTS, SGLANG_HS_STRICT_SKIPS="1" if strict else "0")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "strict_skips", "-p", "no:cacheprovider",
                           "-rfs", str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_strict_mode_fails_skips_that_hide_a_broken_setup(tmp_path):
    r = _run(tmp_path, True, CASES)
    assert r.returncode == 1 and "1 failed, 1 skipped" in r.stdout, r.stdout
    assert "must not skip" in r.stdout and "needs a GPU" in r.stdout
    r = _run(tmp_path, True, BODY)  # a module-level skip: collection fails, and the run stops there
    assert r.returncode == 2 and "1 error" in r.stdout and "extension not built" in r.stdout, r.stdout


def test_without_the_switch_they_skip(tmp_path):
    r = _run(tmp_path, False, CASES)
    assert r.returncode == 0 and "2 skipped" in r.stdout, r.stdout
    r = _run(tmp_path, False, BODY)
    assert r.returncode == 5 and "1 skipped" in r.stdout, r.stdout  # 5: no test ran
