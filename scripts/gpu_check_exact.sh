#!/usr/bin/env bash
# Exact mode on a GPU machine: the CUDA tests, then the exact suite of the benchmarks (which
# needs 4 GPUs, and says so where fewer are visible).
# Usage: scripts/gpu_check_exact.sh [OUT_DIR]   (each part time-boxed; logs under OUT_DIR)
set -u
out=${1:-${OUT:-.}}
mkdir -p "$out"
timeout 300 python -m pytest -p no:cacheprovider -q -m gpu \
    tests/train/test_same_bits_gpu.py >"$out/exact_gpu_tests.log" 2>&1
echo "tests: exit $?" | tee -a "$out/exact_gpu_tests.log"
timeout 240 gpukit bench --only exact --quick --json "$out/exact_bench.json" \
    >"$out/exact_bench.log" 2>&1
echo "bench: exit $?" | tee -a "$out/exact_bench.log"
