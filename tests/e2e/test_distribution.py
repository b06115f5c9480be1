"""How users get sglang-hs: the wheel (installed into a fresh venv, served from there) and the
Docker image (linted with hadolint; no Docker engine runs here)."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from helpers import REPO, Launcher, leftover_server_processes
from sglang_hs.version import SGLANG_VERSION, __version__

pytestmark = pytest.mark.e2e
DOCKERFILE = os.path.join(REPO, "docker", "Dockerfile")


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (make setup installs it from requirements/tools.txt)")
    r = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_shape():
    text = open(DOCKERFILE).read()
    assert re.search(rf"^ARG SGLANG_IMAGE=lmsysorg/sglang:v{re.escape(SGLANG_VERSION)}", text, re.M)
    assert len(re.findall(r"^FROM ", text, re.M)) == 2  # build stage + runtime stage
    assert re.search(r"^USER [1-9]\d*$", text, re.M)  # numeric, non-root
    assert 'ENTRYPOINT ["python3", "-m", "sglang_hs.launch_server"]' in text
    assert "HEALTHCHECK" in text and "/health" in text and "apply_patches.sh" in text
    # what the build stage COPYs is what the wheel needs: the same list as the wheel test below
    build_stage = text.split("\nFROM ")[1]
    copied = {src for line in re.findall(r"^COPY (.+)$", build_stage, re.M) for src in line.split()[:-1]}
    assert copied == {"pyproject.toml", "setup.py", "README.md", "csrc/", "sglang_hs/"}, copied


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel the way the Dockerfile's build stage does, from the files it copies."""
    src = tmp_path_factory.mktemp("src")
    for path in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(REPO, path), src / path)
    for path in ("csrc", "sglang_hs"):
        shutil.copytree(os.path.join(REPO, path), src / path,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(dist), str(src)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = dist.glob("sglang_hs-*.whl")
    return whl


def test_wheel_contents(wheel):
    assert wheel.name.startswith(f"sglang_hs-{__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.match(r"sglang_hs/_C\..*\.so$", n) for n in names)
    for n in ("sglang_hs/data/tiny_deepseek_v3/config.json", "sglang_hs/data/tiny_deepseek_v3/tokenizer.json",
              "sglang_hs/data/tiny_deepseek_v3/tokenizer_config.json",
              "sglang_hs/server/cpu/stubs/sgl_kernel/__init__.py", "sglang_hs/server/cpu/stubs/sgl_kernel/spec_ops.py",
              "sglang_hs/server/cpu/stubs/sgl_kernel/speculative.py",
              "sglang_hs/server/cpu/stubs/flashinfer/__init__.py",
              "sglang_hs/server/models/deepseek_v2.py"):
        assert n in names, n
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert f"Requires-Dist: sglang=={SGLANG_VERSION}" in meta
    eps = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "sglang-hs-server = sglang_hs.launch_server:main" in eps


def test_sdist_holds_every_file_the_extension_includes(tmp_path):
    """`python -m build --sdist` (not isolated: this setuptools and torch) of the tracked build files holds
    every csrc/ file the extension's sources include by name: setuptools adds the .cpp sources setup.py lists
    on its own, not the headers they include, and pip compiles the sdist where no wheel fits."""
    pytest.importorskip("build", reason="`build` is not installed (requirements/pinned.txt)")
    src = tmp_path / "src"
    src.mkdir()
    for path in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy(os.path.join(REPO, path), src / path)
    for path in ("csrc", "sglang_hs"):
        shutil.copytree(os.path.join(REPO, path), src / path, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                        "--outdir", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "SGLANG_HS_SKIP_EXT_BUILD"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("sglang[-_]hs-*.tar.gz")  # the name per setuptools version
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = sorted(n for n in names if n.startswith("csrc/") and n.endswith(".cpp"))
    assert sources, sorted(names)
    included = {f"csrc/{h}" for c in sources
                for h in re.findall(r'^#include "([^"]+)"', open(os.path.join(REPO, c)).read(), re.M)}
    print("sdist: sources", sources, "includes", sorted(included))
    assert included and included <= names, f"missing from the sdist: {sorted(included - names)}"


def test_wheel_serves_from_a_fresh_venv(wheel, tmp_path):
    """A fresh venv that sees the cached pinned sglang (as `make setup` arranges), the wheel installed
    into it, the launcher run from an unrelated folder: nothing depends on the source tree."""
    venv = tmp_path / "venv"
    # without a pip of its own (bootstrapping one costs ~5-15 s): this pip installs into it (pip --python)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    vsite = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "sglang"))][0]
    with open(os.path.join(vsite, "_deps.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({deps!r})\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    where = subprocess.run([py, "-c", "import sglang_hs; print(sglang_hs.__file__)"], capture_output=True,
                           text=True, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ""}).stdout.strip()
    assert where.startswith(vsite), where
    env = {"PYTHONPATH": ""}
    server = Launcher(["--hs-dump-dir", str(tmp_path / "hs"), "--hs-last"], env=env, python=py)
    try:
        server.wait_ready()
        out = server.generate(input_ids=[5, 6, 7, 8, 9], rid="wheel", sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["completion_tokens"] == 2
        assert "overlay ready: sglang_hs.server.models.deepseek_v2.DeepseekV3ForCausalLM" in server.output
    finally:
        server.stop()
        assert not leftover_server_processes(server.output)
