#!/usr/bin/env bash
# Everything about the capture copy that only a GPU shows, in one run of about 5 minutes on an H200:
# the extension build, every test in tests/gpu (one pytest per file, so a hang loses one file, with
# every thread's stack dumped after 90 s), then benchmarks/bench_gpu_copy.py at DeepSeek-V3 sizes into
# a 16 GiB store. Needs only PyTorch, Triton, pytest and this repo (no sglang). Results go to $OUT
# (default benchmarks/results), each as soon as it is measured, in six files at most (the device tool
# brings back eight): summary.txt (what passed, the GPU, what the benchmark concluded), timeline.txt
# (where the minutes went), bench_gpu_copy.csv (row by row), .png and _verdict.txt, and logs.tar.gz
# (the build, each test file's and the benchmark's log; refreshed after every step, so a run stopped
# at its limit still brings back what it did).
#
#   OUT=/some/dir scripts/gpu_check.sh            # everything
#   GPU_CHECK_SKIP_TESTS=1 scripts/gpu_check.sh   # only the build and the benchmark (a rerun)
#   GPU_CHECK_BENCH_ARGS="--store-gib 4 --reps 10" scripts/gpu_check.sh   # the benchmark's own flags
#   GPU_CHECK_SKIP_BENCH=1 scripts/gpu_check.sh   # everything but the copy benchmark (a rerun after fixes
#                                                   that leave the copy path as it was)
#   GPU_CHECK_SKIP_SYNC_BENCH=1 ...               # without the synchronous finish's benchmark (~20 s)
#   GPU_CHECK_DEADLINE=240 GPU_CHECK_BENCH_RESERVE=60 ...   # a short rerun: tests until 60 s before the end
#
# Besides tests/gpu, the unit tests of the extension's host side (HOST_UNIT_TESTS) run there: that machine's
# toolchain builds the extension differently (its g++ links libstdc++ statically: issue 49's segfaults).
#
# The whole run ends within GPU_CHECK_DEADLINE seconds (default 560: the device tool allows 600 per
# command): test files not started by then minus BENCH_RESERVE (200 s) are skipped and say so.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE:-560}
BENCH_RESERVE=${GPU_CHECK_BENCH_RESERVE:-200}
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
mark() {
    echo "$(( $(date +%s) - START )) s  $*" | tee -a "$OUT/timeline.txt"
    tar -czf "$OUT/logs.tar.gz.tmp" -C "$LOGS" . && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
}
: > "$OUT/timeline.txt"
: > "$OUT/summary.txt"

mark "start"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv | tee -a "$OUT/summary.txt"
python3 -c "import sys, torch, triton, pytest; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'pytest', pytest.__version__)" | tee -a "$OUT/summary.txt"
nproc | sed 's/^/cpus /' | tee -a "$OUT/summary.txt"
df -h /dev/shm | tee -a "$OUT/summary.txt"

# The extension (shm mapping, cudaHostRegister, the scatter op); tests fall back to torch's cudart for
# registration, but the staging scatter needs it.
if ( time MAX_JOBS=8 timeout -k 10 180 python3 setup.py -q build_ext --inplace ) > "$LOGS/build.log" 2>&1; then
    python3 -c "from sglang_hs._ext import ext; print('extension: built, with CUDA:', ext().with_cuda)" 2>&1 \
        | tail -1 | tee -a "$OUT/summary.txt"
else
    echo "extension: build FAILED (build.log in logs.tar.gz)" | tee -a "$OUT/summary.txt"
    tail -5 "$LOGS/build.log" | tee -a "$OUT/summary.txt"
fi
mark "extension"

HOST_UNIT_TESTS="tests/unit/test_ext_refusals.py"
if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    for f in $HOST_UNIT_TESTS tests/gpu/test_*.py; do
        name=$(basename "$f" .py)
        budget=$(( $(left) - BENCH_RESERVE ))
        [ $budget -gt 150 ] && budget=150
        if [ $budget -lt 30 ]; then
            echo "tests $name: SKIPPED, no time left before the benchmark" | tee -a "$OUT/summary.txt"
            continue
        fi
        timeout -k 10 $budget python3 -m pytest -q -rA -p no:cacheprovider -o faulthandler_timeout=90 "$f" \
            > "$LOGS/$name.log" 2>&1
        rc=$?
        counts=$(grep -E "^[=]* ?[0-9]+ (passed|failed|error|skipped)" "$LOGS/$name.log" | tail -1)
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && counts="TIMED OUT after $budget s (stacks in the log)"
        echo "tests $name: rc $rc ${counts:-no summary line}" | tee -a "$OUT/summary.txt"
        grep -E "^(FAILED|ERROR) " "$LOGS/$name.log" | head -10 | tee -a "$OUT/summary.txt"
        mark "$name"
    done
fi

# The synchronous finish's cost to the scheduler under the overlap scheduler, before and after issue 48's
# item 5 (about 15 s); its CSV goes into logs.tar.gz, its lines into the summary
if [ -z "${GPU_CHECK_SKIP_SYNC_BENCH:-}" ]; then
    timeout -k 10 60 python3 benchmarks/bench_sync_finish_gpu.py --out "$LOGS" 2>&1 | tee "$LOGS/bench_sync_finish.log" \
        | grep -E "^(before|after) " | sed 's/^/sync finish: /' | tee -a "$OUT/summary.txt"
    mark "bench_sync_finish"
fi

if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    budget=$(( $(left) - 10 ))
    [ $budget -lt 60 ] && budget=60
    timeout -k 15 $budget python3 benchmarks/bench_gpu_copy.py --out "$OUT" ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee "$LOGS/bench.log"
    echo "benchmark: rc ${PIPESTATUS[0]} (limit $budget s)" | tee -a "$OUT/summary.txt"
    rm -rf /dev/shm/bench_gpu_copy-*  # a store left by a benchmark killed before its cleanup
    [ -f "$OUT/bench_gpu_copy_verdict.txt" ] && cat "$OUT/bench_gpu_copy_verdict.txt" >> "$OUT/summary.txt"
else
    echo "benchmark: skipped (GPU_CHECK_SKIP_BENCH)" | tee -a "$OUT/summary.txt"
fi
mark "benchmark"
rm -rf "$LOGS"
echo "----- summary"
cat "$OUT/summary.txt"
