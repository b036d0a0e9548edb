#!/usr/bin/env bash
# One prepared script for a machine with a GPU (such as the device tool's H200): build the kernels, check the
# CUDA ones against the reference, and time decode attention on the GPU. Uses the machine's python3 and torch.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DINFLIGHT_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >/dev/null \
  && cmake --build build/cmake -j || exit 1
$PY benchmarks/gpu_check.py; status=$?
for dtype in float32 bfloat16; do
  $PY benchmarks/attention.py --device cuda --dtype "$dtype" --repeat 20
done
exit $status
