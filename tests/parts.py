"""`--part K/N`: run the K-th of N disjoint parts of the selection, so that N pytest processes share the
machine's cores (scripts/run_tests.py; `make test` runs two). A part is whole modules. Modules that use
the same session-scoped `*_server` fixture of this suite (a shared server: tests/e2e/conftest.py) stay in
one part, so no server starts twice; the modules marked `many_servers` (several servers at once: two nodes,
TP/DP ranks, a draft beside a plain twin, four failing starts) stay in one part too, so the two parts never
hold two such sets at once (memory: a server on the CPU engine is ~3.5 GB over its processes, the machine
24 GB; cheap session fixtures such as the HF reference are simply made in each part). Parts are balanced on each module's measured seconds (tests/module_seconds.json,
refreshed by `scripts/run_tests.py --update-seconds`), the heaviest group first, each to the lightest part;
the split depends only on the selection, so every process computes the same one. Loaded by
tests/conftest.py as a plugin."""
import inspect
import json
import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SECONDS_FILE = os.path.join(TESTS, "module_seconds.json")
UNMEASURED_SECONDS = 60.0  # a module with no measurement yet (a new one) weighs this much
# scripts/run_tests.py: the file each part appends a line to per server started (tests/helpers.py Launcher:
# test, seconds to ready, flags)
STARTS_LEDGER = "SGLANG_HS_TEST_STARTS_LEDGER"


def pytest_addoption(parser):
    parser.addoption("--part", default=None, metavar="K/N",
                     help="run the K-th (1-based) of N parts of the selection: whole modules, balanced on "
                          "tests/module_seconds.json (scripts/run_tests.py runs the N parts at once)")


def parse_part(text: str):
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--part: K/N with 1 <= K <= N, got {text!r}")
    return k, n


def module_of(item) -> str:
    return item.nodeid.split("::")[0]


def _joining(item):
    """What joins `item`'s module to others: the session-scoped `*_server` fixtures defined in this suite's
    files (a conftest.py or a test module: not pytest's nor a plugin's) it uses, directly or through other
    fixtures (or names with the `shares` marker, for one reached through `request.getfixturevalue`), and the
    `many_servers` marker."""
    info = getattr(item, "_fixtureinfo", None)
    names = set()
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        for d in defs:
            try:
                where = os.path.abspath(inspect.getfile(d.func))
            except TypeError:  # a built-in fixture
                continue
            if d.scope == "session" and name.endswith("_server") and \
                    (os.path.basename(where) == "conftest.py" or where == str(item.path)):
                names.add(name)
    if item.get_closest_marker("many_servers") is not None:
        names.add("@many_servers")
    for mark in item.iter_markers("shares"):  # a server the module reaches by request.getfixturevalue
        names.update(mark.args)
    return names


def module_groups(items):
    """[[module, ...], ...]: modules joined when they share a shared server or the `many_servers` marker
    (_joining), in order of first appearance."""
    parent = {}

    def find(m):
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    owner = {}  # fixture name -> a module that uses it
    for item in items:
        m = module_of(item)
        parent.setdefault(m, m)
        for name in _joining(item):
            other = owner.setdefault(name, m)
            parent[find(m)] = find(other)
    groups = {}
    for m in parent:  # dicts keep insertion order: modules in collection order
        groups.setdefault(find(m), []).append(m)
    return list(groups.values())


def load_seconds(path: str = SECONDS_FILE) -> dict:
    try:
        with open(path) as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


def split(groups, n: int, seconds: dict):
    """N lists of modules: groups heaviest first (ties: first collected), each to the lightest part so far
    (ties: the lowest index)."""
    weight = [sum(seconds.get(m, UNMEASURED_SECONDS) for m in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda i: (-weight[i], i))
    parts, load = [[] for _ in range(n)], [0.0] * n
    for i in order:
        j = min(range(n), key=lambda p: (load[p], p))
        parts[j].extend(groups[i])
        load[j] += weight[i]
    return parts


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the selected modules are split
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--part")
    if not spec:
        return
    k, n = parse_part(spec)
    seconds = load_seconds()
    parts = split(module_groups(items), n, seconds)
    mine = set(parts[k - 1])
    keep = [it for it in items if module_of(it) in mine]
    drop = [it for it in items if module_of(it) not in mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    weight = lambda p: sum(seconds.get(m, UNMEASURED_SECONDS) for m in p)  # noqa: E731
    config.stash[_SAID] = (f"part {k}/{n}: {len(parts[k - 1])} module(s), ~{weight(parts[k - 1]) / 60:.0f} of "
                           f"~{sum(map(weight, parts)) / 60:.0f} measured minutes")


_SAID = pytest.StashKey[str]()


def pytest_collection_finish(session):
    said = session.config.stash.get(_SAID, None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if said and reporter is not None:
        reporter.write_line(said)
