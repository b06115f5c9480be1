#!/usr/bin/env bash
# Everything about the capture copy that only a GPU shows, in one run of about 5 minutes on an H200:
# the extension build, every test in tests/gpu (one pytest per file, so a hang loses one file, with
# every thread's stack dumped after 90 s), then benchmarks/bench_gpu_copy.py at DeepSeek-V3 sizes into
# a 16 GiB store. Needs only PyTorch, Triton, pytest and this repo (no sglang). Results go to $OUT
# (default benchmarks/results), each as soon as it is measured; summary.txt says what passed and what
# the benchmark concluded (bench_gpu_copy_verdict.txt), timeline.txt where the minutes went.
#
#   OUT=/some/dir scripts/gpu_check.sh            # everything
#   GPU_CHECK_SKIP_TESTS=1 scripts/gpu_check.sh   # only the build and the benchmark (a rerun)
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
mark() { echo "$(( $(date +%s) - START )) s  $*" | tee -a "$OUT/timeline.txt"; }
: > "$OUT/timeline.txt"
: > "$OUT/summary.txt"

mark "start"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, triton, pytest; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'pytest', pytest.__version__)" | tee -a "$OUT/gpu.txt"
nproc | sed 's/^/cpus /' | tee -a "$OUT/gpu.txt"
df -h /dev/shm | tee -a "$OUT/gpu.txt"

# The extension (shm mapping, cudaHostRegister, the scatter op); tests fall back to torch's cudart for
# registration, but the staging scatter needs it.
if ( time MAX_JOBS=8 timeout 240 python3 setup.py -q build_ext --inplace ) > "$OUT/build.log" 2>&1; then
    echo "extension: built" | tee -a "$OUT/summary.txt"
else
    echo "extension: build FAILED (build.log)" | tee -a "$OUT/summary.txt"
    tail -5 "$OUT/build.log"
fi
mark "extension"

if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    for f in tests/gpu/test_*.py; do
        name=$(basename "$f" .py)
        timeout 150 python3 -m pytest -q -rA -p no:cacheprovider -o faulthandler_timeout=90 "$f" \
            > "$OUT/$name.log" 2>&1
        rc=$?
        counts=$(grep -E "^[=]* ?[0-9]+ (passed|failed|error|skipped)" "$OUT/$name.log" | tail -1)
        [ $rc -eq 124 ] && counts="TIMED OUT after 150 s (stacks in the log)"
        echo "tests $name: rc $rc ${counts:-no summary line}" | tee -a "$OUT/summary.txt"
        grep -E "^(FAILED|ERROR) " "$OUT/$name.log" | head -10 | tee -a "$OUT/summary.txt"
        mark "$name"
    done
fi

timeout 360 python3 benchmarks/bench_gpu_copy.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "benchmark: rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
[ -f "$OUT/bench_gpu_copy_verdict.txt" ] && cat "$OUT/bench_gpu_copy_verdict.txt" >> "$OUT/summary.txt"
mark "benchmark"
echo "----- summary"
cat "$OUT/summary.txt"
