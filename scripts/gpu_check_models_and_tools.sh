#!/usr/bin/env bash
# Real models and the tools people run, on a GPU machine: the transformers tests marked gpu,
# the transformers example on the GPU, gpustat's document and dcgm-exporter's names read from
# the real NVML. Each part time-boxed; logs under OUT_DIR.
# Usage: scripts/gpu_check_models_and_tools.sh [OUT_DIR]
set -u
out=${1:-${OUT:-.}}
mkdir -p "$out"
timeout 240 python -m pytest -p no:cacheprovider -p no:randomly -q -rA -m gpu \
    tests/hf/test_causal_lm_gpu.py >"$out/hf_gpu_tests.log" 2>&1
echo "hf tests: exit $?" | tee -a "$out/hf_gpu_tests.log"
timeout 120 python examples/train_transformers.py --small --out "$out/run" >"$out/example.log" 2>&1
echo "example: exit $?" | tee -a "$out/example.log"
rm -rf "$out/run"
{
    nvidia-smi --query-gpu=index,name,temperature.gpu,fan.speed,utilization.gpu,power.draw,enforced.power.limit,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
    gpukit list --json --format gpustat
} >"$out/gpustat.log" 2>&1
echo "gpustat format: exit $?" | tee -a "$out/gpustat.log"
gpukit serve --port 9477 >"$out/serve.log" 2>&1 &
server=$!
python - "$out/metrics.txt" <<'PY'
import sys, time, urllib.request
for _ in range(100):
    try:
        body = urllib.request.urlopen("http://127.0.0.1:9477/metrics", timeout=2).read()
    except OSError:
        time.sleep(0.2)
        continue
    open(sys.argv[1], "wb").write(body)
    break
PY
kill "$server"
grep -E '^(DCGM_FI_DEV|gpukit_gpu_(memory|utilization|temperature|power))' "$out/metrics.txt" | tee "$out/dcgm.log"
