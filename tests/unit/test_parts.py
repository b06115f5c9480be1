"""tests/parts.py (`--part K/N`) and scripts/run_tests.py: the parts are disjoint and cover the selection,
modules sharing a session fixture of this suite stay together, and the runner fails when any part fails."""
import os
import subprocess
import sys
import textwrap

import pytest

import parts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_split_balances_heaviest_first_and_is_deterministic():
    groups = [["a.py"], ["b.py", "c.py"], ["d.py"], ["e.py"]]
    seconds = {"a.py": 100, "b.py": 30, "c.py": 40, "d.py": 60, "e.py": 5}
    two = parts.split(groups, 2, seconds)
    assert two == [["a.py", "e.py"], ["b.py", "c.py", "d.py"]]  # 105 s and 130 s
    assert parts.split(groups, 2, seconds) == two
    assert sorted(m for p in parts.split(groups, 3, {}) for m in p) == ["a.py", "b.py", "c.py", "d.py", "e.py"]
    assert parts.split(groups, 1, seconds) == [["a.py", "b.py", "c.py", "d.py", "e.py"]]


@pytest.mark.parametrize("text", ["0/2", "3/2", "x", "1/0", "1-2"])
def test_a_bad_part_is_a_usage_error(text):
    with pytest.raises(pytest.UsageError, match=r"--part: K/N with 1 <= K <= N, got"):
        parts.parse_part(text)


SUITE = {
    "conftest.py": """
        import pytest
        pytest_plugins = ["parts"]

        @pytest.fixture(scope="session")
        def shared_server():
            return "one server"

        @pytest.fixture(scope="session")
        def via_shared(shared_server):
            return shared_server

        @pytest.fixture(scope="session")
        def reference():
            return "cheap: made in each part"

        def pytest_configure(config):
            config.addinivalue_line("markers", "many_servers: several servers at once")
            config.addinivalue_line("markers", "shares: shared servers reached by name")
    """,
    "test_a.py": "def test_a(shared_server):\n    pass\n",
    "test_b.py": "def test_b(via_shared):\n    pass\n",  # through another fixture: still joined to test_a
    "test_c.py": "def test_c(tmp_path_factory, reference):\n    pass\n",  # neither joins: not a *_server
    "test_d.py": "def test_d(reference):\n    pass\ndef test_d2():\n    pass\n",
    "test_f.py": "import pytest\npytestmark = pytest.mark.many_servers\ndef test_f():\n    pass\n",
    "test_g.py": "import pytest\n@pytest.mark.many_servers\ndef test_g():\n    pass\n",
    # reaches the shared server by name (request.getfixturevalue): says so with the marker
    "test_h.py": "import pytest\npytestmark = pytest.mark.shares('shared_server')\n"
                 "def test_h(request):\n    assert request.getfixturevalue('shared_server')\n",
    "test_e.py": "import pytest\n@pytest.mark.parametrize('x', [1, 2])\ndef test_e(x):\n    assert x < 2\n",
}


@pytest.fixture()
def suite(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def _run(suite, *args):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests"))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=suite,
                          capture_output=True, text=True, env=env)


def _ran(out):
    return sorted(l.split(" ")[0] for l in out.splitlines() if l.startswith("test_") and "::" in l)


def test_the_parts_cover_the_selection_once_and_keep_shared_fixtures_together(suite):
    seen, parts_of_cd = [], []
    for k in (1, 2, 3, 4):
        r = _run(suite, "-rA", "--part", f"{k}/4", "-k", "not test_e")
        assert r.returncode in (0, 5), r.stdout + r.stderr
        ran = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("PASSED ")]
        seen += ran
        mods = {n.split("::")[0] for n in ran}
        assert ("test_a.py" in mods) == ("test_b.py" in mods) == ("test_h.py" in mods), ran  # one server: one part
        assert ("test_f.py" in mods) == ("test_g.py" in mods), ran  # several servers at once: one part
        parts_of_cd.append(("test_c.py" in mods, "test_d.py" in mods))
    assert sorted(seen) == ["test_a.py::test_a", "test_b.py::test_b", "test_c.py::test_c", "test_d.py::test_d",
                            "test_d.py::test_d2", "test_f.py::test_f", "test_g.py::test_g", "test_h.py::test_h"]
    assert (True, True) not in parts_of_cd  # a cheap session fixture does not join: 4 groups, 4 parts
    r = _run(suite, "--part", "3/2")
    assert r.returncode != 0 and "--part: K/N with 1 <= K <= N, got '3/2'" in r.stderr


def test_the_runner_fails_when_a_part_fails_and_prints_every_log(suite, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    script = os.path.join(REPO, "scripts", "run_tests.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests"))
    r = subprocess.run([sys.executable, script, "--parts", "2", "--log-dir", str(logs), "--", "-q",
                        "-p", "no:cacheprovider", str(suite)], capture_output=True, text=True, env=env, cwd=suite)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "part 1 of 2" in r.stdout and "part 2 of 2" in r.stdout and "1 failed" in r.stdout
    assert sorted(os.listdir(logs)) == ["part-1-of-2.log", "part-1-of-2.xml", "part-2-of-2.log", "part-2-of-2.xml"]
    r = subprocess.run([sys.executable, script, "--parts", "2", "--log-dir", str(logs), "--", "-q",
                        "-p", "no:cacheprovider", "-k", "not test_e", str(suite)],
                       capture_output=True, text=True, env=env, cwd=suite)
    assert r.returncode == 0, r.stdout + r.stderr
