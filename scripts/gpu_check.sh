#!/usr/bin/env bash
# Everything about the capture copy that only a GPU shows, in one run (a few minutes on an H200).
# Needs only PyTorch, Triton and this repo (no sglang). Results go to $OUT (default benchmarks/results),
# each as soon as it is measured.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
df -h /dev/shm | tee -a "$OUT/gpu.txt"
# The extension (shm mapping + cudaHostRegister); the tests fall back to torch's cudart if this fails.
( time timeout 240 python3 setup.py -q build_ext --inplace ) > "$OUT/build.log" 2>&1 && echo "extension built" \
    || { echo "extension build FAILED (see build.log)"; tail -5 "$OUT/build.log"; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout 240 python3 benchmarks/bench_gpu_copy.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
