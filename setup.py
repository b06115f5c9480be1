"""Build of the sglang_hs._C extension (csrc/), and the long description PyPI shows (README.md with its
relative links written out, see _long_description). Other metadata lives in pyproject.toml.

Switches (environment):
  SGLANG_HS_SKIP_CUDA_BUILD=1   build the CPU extension only, even where a CUDA toolkit exists
  SGLANG_HS_SKIP_EXT_BUILD=1    build no extension at all (pure-Python wheel; the store then refuses to
                                start, naming this switch)
  MAX_JOBS=N                    parallel compile jobs (default: bounded by cores and free memory)
  CUDA_HOME                     the toolkit (default: /usr/local/cuda when it exists)

Build without isolation so the installed torch is used: `pip install --no-build-isolation .`
This file never imports sglang_hs.
"""
import os
import re
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _default_max_jobs() -> str:
    # A translation unit that includes torch/extension.h or torch/python.h needs ~1.5 GB of RAM to compile
    # (only bindings.cpp does; the ops include ATen/core/Tensor.h, ~5 s each instead of 35-50 s).
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(l.split()[1]) for l in f if l.startswith("MemAvailable:"))
        by_mem = max(1, int(avail_kb / (1.5 * 1024 * 1024)))
    except (OSError, StopIteration, ValueError):
        by_mem = 1
    return str(max(1, min(cores, by_mem)))


def _cuda_home():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home and os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
        home = "/usr/local/cuda"  # torch guesses /usr/local, which lacks the headers on some images
    if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        os.environ["CUDA_HOME"] = home
        return home
    return None


def _extensions():
    if _flag("SGLANG_HS_SKIP_EXT_BUILD"):
        warnings.warn("SGLANG_HS_SKIP_EXT_BUILD is set: building sglang-hs without its extension")
        return [], {}
    # Before importing cpp_extension, which reads CUDA_HOME once at import.
    cuda_home = None if _flag("SGLANG_HS_SKIP_CUDA_BUILD") else _cuda_home()
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", _default_max_jobs())
    sources = ["csrc/shm.cpp", "csrc/copy_rows_cpu.cpp", "csrc/gather_rows_cpu.cpp", "csrc/bindings.cpp"]
    cxx = ["-O3"]  # the C++ standard comes from torch (C++20 for torch 2.14)
    if cuda_home:
        ext = CUDAExtension(
            "sglang_hs._C",
            sources + ["csrc/cuda_host.cpp"],
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("SGLANG_HS_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
        )
    else:
        if not _flag("SGLANG_HS_SKIP_CUDA_BUILD"):
            warnings.warn("no CUDA toolkit found (set CUDA_HOME): building the CPU-only extension")
        ext = CppExtension(
            "sglang_hs._C", sources, include_dirs=[os.path.join(ROOT, "csrc")], extra_compile_args=cxx
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


# A markdown link or image: [text](target) / ![alt](target), as tests/unit/test_docs_links.py reads them.
_LINK = re.compile(r"(!?)\[((?:[^\]\[]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_PYPI_NOTE = ("\n\n---\n\n*This is the README of the sglang-hs source repository. A name followed by a path in "
              "code, such as install `docs/install.md`, is a link there to that file of the repository "
              "(docs/, tests/, benchmarks/), which this package does not hold.*\n")


def _plain_link(m: "re.Match") -> str:
    text, target = m.group(2), m.group(3)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        return m.group(0)  # http(s), mailto: resolves anywhere
    return f"{text} `{target}`"


def _long_description() -> str:
    """README.md for PyPI. Its links into the repository (docs/, tests/, benchmarks/) are relative, which
    PyPI cannot resolve, and the project has no repository URL to make them absolute: each becomes its
    text followed by its target in code, `[install](docs/install.md)` -> install `docs/install.md`, and
    a closing note says what those paths are. Web links, fenced blocks and inline code stay as they are."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines, fence = f.read().rstrip("\n").split("\n"), None
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(```|~~~)", line)
        if m and fence in (None, m.group(1)):
            fence = None if fence else m.group(1)
        elif fence is None:  # outside code blocks; a span in backticks is code too
            lines[i] = "".join(part if part.startswith("`") else _LINK.sub(_plain_link, part)
                               for part in re.split(r"(`+[^`]*`+)", line))
    return "\n".join(lines) + _PYPI_NOTE


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass, long_description=_long_description(),
      long_description_content_type="text/markdown")
