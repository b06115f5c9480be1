"""The docs hold together: README.md and docs/*.md link only to files and headings that exist, and every
command they show runs a module, script or make target that exists, with flags it accepts.

- Links: every relative link and image in the pages (outside code) resolves to a file or folder of the
  repository; an anchor (`page.md#heading`, `#heading`) names a heading of that page by GitHub's rules
  (lower case, punctuation but `-` and `_` dropped, spaces to `-`, repeats numbered `-1`, `-2`).
- Commands: every `python -m sglang_hs...` in a code block or an inline code span names a runnable module
  and only flags its `--help` lists (the extraction CLI also passes launcher flags on, the self-test and
  the demo take launcher flags); every `python benchmarks/X.py` names a script and only flags its
  argparse parser adds (read from its source: importing a benchmark costs seconds); every `make X` is a
  Makefile target, every `scripts/X` exists; every `from sglang_hs... import name` in a python block
  imports.
- Code: every `docs/page.md` or `docs/page.md#heading` a comment or docstring of the code names (sglang_hs,
  tests, benchmarks, scripts, docker, csrc, setup.py, Makefile) is a page, and the heading one of its
  headings; a `README "Section"` or `(README, Section)` names a heading the README still has (sections moved
  to docs/).
- PyPI: the long description setuptools generates is the README with its relative links written out.

No server: the one slow part is the launcher's --help (it imports SGLang for its flags), run once.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
# Modules whose flags are (also) another module's: the extraction CLI hands unknown flags to the launcher,
# the self-test and the demo take launcher flags only (their --help lists none / starts a server).
FLAG_SOURCES = {
    "sglang_hs.extract": ("sglang_hs.extract", "sglang_hs.launch_server"),
    "sglang_hs.selftest": ("sglang_hs.launch_server",),
    "sglang_hs.demo": ("sglang_hs.launch_server",),
}


def doc_pages() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def split_code(text: str) -> Tuple[str, List[Tuple[str, str, int]]]:
    """(the text outside fenced blocks, each block blanked to keep line numbers; [(info, body, line)])."""
    prose, blocks, block, info, start, fence = [], [], None, "", 0, None
    for i, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if block is None and m:
            block, info, start, fence = [], line.strip()[3:].strip(), i, m.group(2)
            prose.append("")
        elif block is not None and line.strip().startswith(fence):
            blocks.append((info, "\n".join(block), start))
            block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def github_slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> Set[str]:
    prose, _ = split_code(text)
    seen: Dict[str, int] = {}
    out: Set[str] = set(HTML_ANCHOR.findall(prose))
    for line in prose.split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_errors(page: Path, text: str) -> List[str]:
    prose, _ = split_code(text)
    prose = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)  # a link in code is text
    errors = []
    for m in LINK.finditer(prose):
        target = m.group(1)
        line = prose.count("\n", 0, m.start()) + 1
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http(s), mailto: not ours to check offline
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if ROOT not in (dest, *dest.parents):
            errors.append(f"{where}: leaves the repository")
            continue
        if not dest.exists():
            errors.append(f"{where}: no such file {dest.relative_to(ROOT)}")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                errors.append(f"{where}: an anchor into a file that is not a markdown page")
            elif anchor not in anchors(text if dest == page else dest.read_text(encoding="utf-8")):
                errors.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return errors


def command_lines(text: str) -> Iterator[Tuple[str, str]]:
    """(kind, command text) for every shell line of a code block and every inline code span."""
    prose, blocks = split_code(text)
    for info, body, _ in blocks:
        if info in ("python", "py"):
            yield "python", body
            body = "\n".join(re.findall(r"^\s*#\s*(?:the server:\s*)?(python -m .*)$", body, re.M))
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.split("\n"):
            yield "shell", re.split(r"(?:^|\s)#", line)[0]  # a comment is prose
    for m in INLINE_CODE.finditer(prose):
        yield "shell", " ".join(m.group(2).split())


def _tokens_after(line: str, start: int) -> List[str]:
    rest = re.split(r"\s#|&&|\|\||[|;)]", line[start:])[0]
    try:
        return shlex.split(rest)
    except ValueError:
        return rest.split()


def _flags(tokens: List[str]) -> List[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and len(t) > 2 and not t.startswith("--hs-*")]


@lru_cache(maxsize=None)
def module_help_flags(module: str) -> frozenset:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, f"python -m {module} --help failed: {out.stderr[-2000:]}"
    flags = set()
    for line in out.stdout.split("\n"):
        m = re.match(r"^ {2}(-.*?)(?: {2,}|$)", line)  # argparse's invocation column
        if m:
            flags.update(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", m.group(1)))
    assert "--help" in flags, f"python -m {module} --help listed no flags"
    return frozenset(flags)


@lru_cache(maxsize=None)
def script_flags(script: Path) -> frozenset:
    flags = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return frozenset(flags | {"--help"})


def accepted(flag: str, allowed: Set[str]) -> bool:
    """As the parsers take it: exact, or (SGLang's flags: argparse's allow_abbrev, e.g. `--tp` for
    `--tp-size`) the unique prefix of one; the launcher takes --hs-* flags whole only."""
    if flag in allowed:
        return True
    return not flag.startswith("--hs-") and len([a for a in allowed if a.startswith(flag)]) == 1


def runnable(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        return importlib.util.find_spec(module + ".__main__") is not None
    return "__main__" in Path(spec.origin).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def make_targets() -> frozenset:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return frozenset(re.findall(r"^([A-Za-z0-9_-]+):", text, re.M))


def command_errors(page: Path, text: str, help_flags=module_help_flags) -> List[str]:
    errors = []
    where = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
    for kind, line in command_lines(text):
        if kind == "python":
            for m in re.finditer(r"^\s*from (sglang_hs[\w.]*) import ([\w, ]+)", line, re.M):
                try:
                    mod = importlib.import_module(m.group(1))
                except ImportError as e:
                    errors.append(f"{where}: from {m.group(1)} import: {e}")
                    continue
                for name in (n.strip() for n in m.group(2).split(",")):
                    # a name, or a submodule (`from sglang_hs import status`: an attribute only once imported)
                    if not hasattr(mod, name) and importlib.util.find_spec(f"{m.group(1)}.{name}") is None:
                        errors.append(f"{where}: {m.group(1)} has no {name}")
            continue
        for m in re.finditer(r"python3? -m (sglang_hs(?:\.\w+)*)(\.\.\.|\.<)?", line):
            module = m.group(1)
            if m.group(2):
                continue  # a placeholder: `python -m sglang_hs...`, `sglang_hs.<tool>`
            if not runnable(module):
                errors.append(f"{where}: python -m {module}: no such runnable module")
                continue
            allowed = set().union(*(help_flags(src) for src in FLAG_SOURCES.get(module, (module,))))
            for flag in _flags(_tokens_after(line, m.end(1))):
                if not accepted(flag, allowed):
                    errors.append(f"{where}: python -m {module}: unknown flag {flag}")
        for m in re.finditer(r"python3? (benchmarks/[\w/]+\.py)", line):
            script = ROOT / m.group(1)
            if not script.is_file():
                errors.append(f"{where}: python {m.group(1)}: no such script")
                continue
            for flag in _flags(_tokens_after(line, m.end())):
                if flag not in script_flags(script):
                    errors.append(f"{where}: python {m.group(1)}: unknown flag {flag}")
        for m in re.finditer(r"(?:^|&&|;)\s*make ([a-z][\w-]*)", line):
            if m.group(1) not in make_targets():
                errors.append(f"{where}: make {m.group(1)}: no such Makefile target")
        for m in re.finditer(r"(?:^|\s)(scripts/[\w.-]+)", line):
            if not (ROOT / m.group(1)).is_file():
                errors.append(f"{where}: {m.group(1)}: no such script")
    return errors


CODE_DIRS = ("sglang_hs", "tests", "benchmarks", "scripts", "docker", "csrc")
CODE_FILES = ("setup.py", "Makefile")
CODE_SUFFIXES = {".py", ".sh", ".cpp", ".h", ".cu", ".cuh"}
DOCS_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
README_SECTION = re.compile(r"\bREADME(?:\.md)?,?\s+\"([^\"]{1,80})\"|\(README(?:\.md)?,\s+([A-Z][\w /-]*)\)")


def code_files() -> List[Path]:
    """The repository's code that may cite the docs (not this file: its synthetic cases cite broken ones)."""
    out = [ROOT / name for name in CODE_FILES if (ROOT / name).is_file()]
    for d in CODE_DIRS:
        out += [p for p in sorted((ROOT / d).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                and (p.suffix in CODE_SUFFIXES or p.name == "Dockerfile") and p != Path(__file__).resolve()]
    return out


def code_reference_errors(path: Path, text: str, readme: Set[str] = None) -> List[str]:
    """A docs page or heading the code names that is not there; a README section the README (its anchors:
    `readme`, else README.md's) no longer has."""
    errors = []
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    for m in DOCS_REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        page = ROOT / "docs" / m.group(1)
        if not page.is_file():
            errors.append(f"{where}:{line}: docs/{m.group(1)}: no such page")
        elif m.group(2) and m.group(2) not in anchors(page.read_text(encoding="utf-8")):
            errors.append(f"{where}:{line}: docs/{m.group(1)}#{m.group(2)}: no such heading")
    if readme is None:
        readme = anchors((ROOT / "README.md").read_text(encoding="utf-8"))
    for m in README_SECTION.finditer(text):
        section = " ".join((m.group(1) or m.group(2)).split())
        if github_slug(section) not in readme:
            line = text.count("\n", 0, m.start()) + 1
            errors.append(f"{where}:{line}: README section {section!r}: not in README.md (moved to docs/?)")
    return errors


# -- the docs as they stand -------------------------------------------------------------------------------

@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    errors = link_errors(page, page.read_text(encoding="utf-8"))
    assert not errors, "broken links:\n" + "\n".join(errors)


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_exist(page):
    errors = command_errors(page, page.read_text(encoding="utf-8"))
    assert not errors, "commands that would not run:\n" + "\n".join(errors)


def test_code_cites_docs_that_exist():
    files = code_files()
    assert any(p.name == "ring.py" for p in files) and any(p.name == "Dockerfile" for p in files), files
    errors = [e for p in files for e in code_reference_errors(p, p.read_text(encoding="utf-8", errors="replace"))]
    assert not errors, "code comments that cite what the docs do not hold:\n" + "\n".join(errors)


def test_every_page_is_linked_and_starts_with_a_command():
    """Every docs page is reachable from the docs index, and its first block (after the title) is code."""
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name == "README.md":
            continue
        assert f"]({page.name}" in index, f"docs/README.md does not link {page.name}"
        body = [b for b in page.read_text(encoding="utf-8").split("\n\n") if b.strip()]
        assert body[0].startswith("# "), f"{page.name}: no title"
        assert body[1].lstrip().startswith("```"), f"{page.name}: does not start with the command a user runs"


# -- the README as PyPI shows it ------------------------------------------------------------------------------

def test_pypi_description_writes_out_the_relative_links(monkeypatch):
    """The package's long description, from setuptools' own metadata generation (`build`, not isolated: no
    network), is README.md with each relative link, which PyPI cannot resolve, written out as its text and
    its target in code; web links stay; every other line is the README's; a closing note says what the
    paths are."""
    build_util = pytest.importorskip("build.util", reason="`build` is not installed (requirements/pinned.txt)")
    monkeypatch.setenv("SGLANG_HS_SKIP_EXT_BUILD", "1")  # metadata only: setup.py then skips torch's build_ext
    meta = build_util.project_wheel_metadata(str(ROOT), isolated=False)
    assert meta["Description-Content-Type"] == "text/markdown"
    desc = meta.get_payload()
    body, sep, note = desc.rpartition("\n\n---\n\n")
    assert sep and "docs/install.md" in note, desc[-300:]
    prose, _ = split_code(body)
    prose = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    left = [m.group(0) for m in LINK.finditer(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1), re.I)]
    assert not left, f"relative links PyPI cannot resolve: {left}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8").rstrip("\n").split("\n")
    lines = body.split("\n")
    assert len(lines) == len(readme)
    relative = 0
    for want, got in zip(readme, lines):
        links = [m for m in LINK.finditer(want) if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1), re.I)]
        relative += len(links)
        for m in links:  # in order, each as its text and its target in code
            text = re.match(r"!?\[(.*)\]", m.group(0), re.S).group(1)
            want = want.replace(m.group(0), f"{text} `{m.group(1)}`", 1)
        assert got == want, (want, got)
    assert relative > 20, relative  # the README's links into docs/ and tests/


# -- the checker catches what it is for (synthetic pages) ----------------------------------------------------

def _fake_flags(module):
    return frozenset({"--help", "--model-path", "--hs-dump-dir", "--hs-last", "--tp-size", "--tokenizer-path"}) \
        if module == "sglang_hs.launch_server" else frozenset({"--help", "--data", "--output"})


def test_checker_finds_a_broken_link_and_anchor():
    page = ROOT / "docs" / "README.md"  # resolved relative to docs/, as a page there would be
    text = ("# T\n\n[ok](serving.md) [ok](serving.md#sizing-devshm) [ok](#t) [web](https://example.com)\n"
            "[gone](no-such-page.md) [bad](serving.md#no-such-heading) `[in code](nowhere.md)`\n"
            "```\n[in a block](nowhere.md)\n```\n")
    errors = link_errors(page, text)
    assert len(errors) == 2, errors
    assert "no such file docs/no-such-page.md" in errors[0]
    assert "no heading #no-such-heading" in errors[1]


def test_checker_finds_broken_docs_references_in_code():
    text = ('"""Fine: docs/security.md#the-network, docs/harvest.md, (see docs/serving.md#sizing-devshm).\n'
            "Broken: docs/no-such-page.md and docs/security.md#no-such-heading.\n"
            '(README "Security") and (README,\nSecurity) moved; README "Two commands" is still there."""\n'
            "# a comment: docs/reading.md#zero-copy, docs/reading.md#zero_copy\n")
    errors = code_reference_errors(ROOT / "sglang_hs" / "x.py", text, readme={"two-commands", "install"})
    assert errors == [
        "sglang_hs/x.py:2: docs/no-such-page.md: no such page",
        "sglang_hs/x.py:2: docs/security.md#no-such-heading: no such heading",
        "sglang_hs/x.py:5: docs/reading.md#zero_copy: no such heading",
        "sglang_hs/x.py:3: README section 'Security': not in README.md (moved to docs/?)",
        "sglang_hs/x.py:3: README section 'Security': not in README.md (moved to docs/?)",
    ], errors


def test_github_slugs():
    assert github_slug("Sizing `/dev/shm`") == "sizing-devshm"
    assert github_slug("The finish path, off the scheduler thread") == "the-finish-path-off-the-scheduler-thread"
    assert github_slug("Resume, shards and several nodes") == "resume-shards-and-several-nodes"
    assert github_slug("DeepSeek-V3.2 and `--hs-last`") == "deepseek-v32-and---hs-last"


def test_checker_finds_an_unknown_flag_module_and_script():
    text = ("```bash\npython -m sglang_hs.launch_server --model-path M --tp 8 \\\n    --hs-dump-dir /x --hs-lats\n"
            "python -m sglang_hs.extract --data d --output o --tp 8 --model-p M  # passed on; a prefix\n"
            "python -m sglang_hs.launch_server --hs-dump /x --t 8   # --hs-* flags whole; --t is ambiguous\n"
            "python -m sglang_hs.no_such_tool --x\n"
            "python benchmarks/bench_ring.py --out r --no-such-flag\n"
            "make no-such-target\n# python -m sglang_hs.no_such_tool in a comment is prose\n```\n\nProse: `python -m sglang_hs.launch_server --hs-bogus 1`. Placeholders: `python -m sglang_hs...`, `python -m sglang_hs.<tool>`.\n")
    errors = command_errors(ROOT / "README.md", text, help_flags=_fake_flags)
    assert any("unknown flag --hs-lats" in e for e in errors), errors
    assert any("unknown flag --hs-bogus" in e for e in errors), errors
    assert any("sglang_hs.no_such_tool: no such runnable module" in e for e in errors), errors
    assert any("bench_ring.py: unknown flag --no-such-flag" in e for e in errors), errors
    assert any("make no-such-target" in e for e in errors), errors
    assert any("unknown flag --hs-dump" in e for e in errors), errors
    assert any("unknown flag --t" in e for e in errors), errors
    assert len(errors) == 7, errors
