#!/usr/bin/env bash
# Apply patches/NNNN-*.patch to an installed sglang, idempotently:
#   scripts/apply_patches.sh [SITE_PACKAGES]     (default: the one of `python3 -c 'import sglang'`)
# For each patch, in order: already applied (reverse-check passes) -> skip; applies cleanly -> apply;
# otherwise fail, naming the patch (the installed sglang is not the 0.5.23 the patches target).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
site=${1:-$(${PYTHON:-python3} -c 'import os, sglang; print(os.path.dirname(os.path.dirname(sglang.__file__)))')}
cd "$site"
if command -v git >/dev/null; then
    applied() { git apply --reverse --check "$1" 2>/dev/null; }
    applies() { git apply --check "$1" 2>/dev/null; }
    apply() { git apply "$1"; }
else  # images without git: the same three steps with patch(1)
    applied() { patch -p1 -R -s -f --dry-run <"$1" >/dev/null 2>&1; }
    applies() { patch -p1 -N -s -f --dry-run <"$1" >/dev/null 2>&1; }
    apply() { patch -p1 -N -s <"$1"; }
fi
for p in "$here"/patches/[0-9][0-9][0-9][0-9]-*.patch; do
    name=$(basename "$p")
    if applied "$p"; then
        echo "[patches] $name: already applied"
    elif applies "$p"; then
        apply "$p"
        echo "[patches] $name: applied"
    else
        echo "[patches] $name: does not apply to $site (is this sglang 0.5.23?)" >&2
        exit 1
    fi
done
