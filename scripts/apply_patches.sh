#!/usr/bin/env bash
# Apply patches/NNNN-*.patch to an installed sglang, idempotently:
#   scripts/apply_patches.sh [SITE_PACKAGES]     (default: the one of `python3 -c 'import sglang'`)
# For each patch, in order: already applied (reverse-check passes) -> skip; applies cleanly -> apply;
# otherwise fail, naming the patch (the installed sglang is not the 0.5.23 the patches target).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
site=${1:-$(${PYTHON:-python3} -c 'import os, sglang; print(os.path.dirname(os.path.dirname(sglang.__file__)))')}
cd "$site"
for p in "$here"/patches/[0-9][0-9][0-9][0-9]-*.patch; do
    name=$(basename "$p")
    if git apply --reverse --check "$p" 2>/dev/null; then
        echo "[patches] $name: already applied"
    elif git apply --check "$p" 2>/dev/null; then
        git apply "$p"
        echo "[patches] $name: applied"
    else
        echo "[patches] $name: does not apply to $site (is this sglang 0.5.23?)" >&2
        git apply --check "$p"
        exit 1
    fi
done
