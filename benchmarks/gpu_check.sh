#!/usr/bin/env bash
# One prepared script for a machine with a GPU (such as the device tool's H200): build the kernels, check the
# CUDA ones against the reference, time decode attention on the GPU, then run the engine there
# (benchmarks/gpu_engine_check.py: greedy tokens against transformers in fp32 and bf16, the in-process serving
# ceiling, a saturated Llama-3.1-8B-shaped run). Uses the machine's python3, torch and transformers; under
# 10 minutes on an H200 (GPU_CHECK_SKIP_BIG=1 leaves out the 8B run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DINFLIGHT_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >/dev/null \
  && cmake --build build/cmake -j || exit 1
$PY benchmarks/gpu_check.py; status=$?
for dtype in float32 bfloat16; do
  $PY benchmarks/attention.py --device cuda --dtype "$dtype" --repeat 20
done
$PY benchmarks/gpu_engine_check.py ${GPU_CHECK_SKIP_BIG:+--skip-big} || status=1
exit $status
