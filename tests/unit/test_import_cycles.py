"""No import circles among sglang_hs's modules (issue 35, item 3), found statically: every `import` and
`from ... import` of every file under sglang_hs/ is read with ast, none is run.

An edge A -> B is one import of B written in A, kept with where it stands: at module level (run when A is
imported) or inside a function (run when it is called). Both count: a cycle through function-level imports
does not fail at import time, but it is the same circle (two modules that each need the other), only
deferred; it is forbidden as much as one of module-level imports. The failure names every edge of a cycle
with its kind and line, the module-level-only cycles first.

Not edges: a submodule's implicit import of its parent package (every `import sglang_hs.x.y` runs
sglang_hs/__init__.py first; counting that would make every package that names one of its submodules a
cycle), and imports of anything outside sglang_hs. `from P import name` is an edge to P.name when that is a
module (a .py file or the compiled extension sglang_hs._C, which is a leaf), else to P.
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "sglang_hs"
EXTENSIONS = {"sglang_hs._C"}  # built from csrc/ by setup.py; imports nothing of ours

Edges = Dict[Tuple[str, str], List[Tuple[str, int]]]  # (importer, imported) -> [(kind, line)]


def modules(root: str) -> Dict[str, str]:
    """Dotted name -> file, for every .py file of the package under `root`."""
    found = {}
    for dirpath, _, files in os.walk(os.path.join(root, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def import_edges(mods: Dict[str, str]) -> Edges:
    known = set(mods) | EXTENSIONS

    def owner(name: str):
        """The module of ours a dotted name lives in (sglang_hs.reader.HiddenStateReader -> sglang_hs.reader)."""
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: Edges = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]

        def add(target, kind, line):
            if target is not None and target != mod and (kind, line) not in edges.get((mod, target), ()):
                edges.setdefault((mod, target), []).append((kind, line))

        def visit(node, kind):
            for child in ast.iter_child_nodes(node):
                inner = "function" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else kind
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(owner(alias.name), inner, child.lineno)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:  # relative: from its package, one level up per extra dot
                        parts = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                        base = ".".join(parts + ([child.module] if child.module else []))
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        add(full if full in known else owner(base), inner, child.lineno)
                visit(child, inner)

        visit(tree, "module")
    return edges


def cycles(edges: Edges, kinds: Set[str]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), over the edges that have an
    import of one of `kinds`."""
    graph: Dict[str, Set[str]] = {}
    for (a, b), where in edges.items():
        if any(k in kinds for k, _ in where):
            graph.setdefault(a, set()).add(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def describe(comp: List[str], edges: Edges) -> str:
    lines = [" <-> ".join(comp)]
    for (a, b), where in sorted(edges.items()):
        if a in comp and b in comp:
            lines.append(f"  {a} -> {b}: " + ", ".join(f"{k}-level import at line {n}" for k, n in where))
    return "\n".join(lines)


def find(root: str) -> Tuple[List[List[str]], List[List[str]], Edges]:
    edges = import_edges(modules(root))
    return cycles(edges, {"module"}), cycles(edges, {"module", "function"}), edges


def test_no_module_imports_a_module_that_imports_it_back():
    module_level, any_level, edges = find(ROOT)
    for kind, found in (("module-level imports", module_level), ("imports at any level", any_level)):
        print(f"cycles of {kind}: {len(found)}")
    assert not module_level, "import cycles of module-level imports:\n" + "\n".join(
        describe(c, edges) for c in module_level)
    assert not any_level, "import cycles (function-level imports defer a circle, they do not remove it):\n" + \
        "\n".join(describe(c, edges) for c in any_level)
    assert len(edges) > 100  # the walk did see the package's imports


def _tree(tmp_path, files: Dict[str, str]) -> str:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_a_planted_cycle_is_found_at_either_level_with_its_lines(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "def __getattr__(name):\n    from sglang_hs import reader\n    return reader\n",
        "_ext.py": "def ext():\n    from sglang_hs import _C\n    return _C\n",  # the extension: a leaf
        "reader.py": "from sglang_hs._ext import ext\n",
        "extract/__init__.py": "",
        "extract/cli.py": "import os\n\ndef main():\n    from sglang_hs.extract.harvest import run\n",
        "extract/harvest.py": "from .cli import main\n",  # relative, module level
        "a.py": "import sglang_hs.b\n",
        "b.py": "from sglang_hs import a\n",
        "live.py": "class E(Exception):\n    pass\n",
        "live_workers.py": "from sglang_hs.live import E\n",  # one way only: no cycle
    })
    module_level, any_level, edges = find(root)
    assert module_level == [["sglang_hs.a", "sglang_hs.b"]]
    assert any_level == [["sglang_hs.a", "sglang_hs.b"], ["sglang_hs.extract.cli", "sglang_hs.extract.harvest"]]
    text = describe(any_level[1], edges)
    assert "sglang_hs.extract.cli -> sglang_hs.extract.harvest: function-level import at line 4" in text, text
    assert "sglang_hs.extract.harvest -> sglang_hs.extract.cli: module-level import at line 1" in text, text
