#!/usr/bin/env bash
# One prepared script for a machine with a GPU (such as the device tool's H200): build the kernels, check the
# CUDA ones against the reference (attention, then the fused ops of plugins/cuda_ops), time decode attention on
# the GPU, then run the engine there (benchmarks/gpu_engine_check.py: greedy tokens against transformers in fp32
# and bf16, the in-process serving ceiling, saturated Llama-3.1-8B-shaped runs eager, with CUDA graphs and with
# the fused ops, torch.profiler's tables of 3 decode steps at the largest batch). Uses the machine's python3, torch
# and transformers; under 10 minutes on an H200 (GPU_CHECK_SKIP_BIG=1 leaves out the 8B run). Each stage has its
# own time limit, so one that hangs does not take the later ones with it; when the CUDA attention kernels fail
# their check, the engine runs with the torch attention reference, so its other parts are still checked.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
stage() {  # stage SECONDS NAME COMMAND...: run with a time limit, print its wall time and exit status
  local limit=$1 name=$2 start=$SECONDS rc
  shift 2
  echo "=== $name"
  timeout -k 10 "$limit" "$@"; rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
stage 180 build bash -c "cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release \
  -DINFLIGHT_CUDA_ARCHITECTURES='${CUDA_ARCH:-90}' >/dev/null && cmake --build build/cmake -j" || exit 1
status=0 attention=auto
stage 150 kernels $PY benchmarks/gpu_check.py || { status=1; attention=torch; }
stage 60 "fused ops" $PY benchmarks/gpu_check.py --ops || status=1
for dtype in float32 bfloat16; do
  stage 60 "attention timings $dtype" $PY benchmarks/attention.py --device cuda --dtype "$dtype" --repeat 20
done
# Decode attention at Llama 3 8B's heads and a saturated run's batches, the kernel's own time (20 calls a
# timing); GPU_CHECK_BASELINE_CU=an older paged_attention.cu: that build timed beside this one.
baseline=()
if [ -n "${GPU_CHECK_BASELINE_CU:-}" ] && mkdir -p build/baseline && stage 120 "baseline kernel" \
    nvcc -O3 -arch="sm_${CUDA_ARCH:-90}" -shared -Xcompiler -fPIC -Iplugins/paged_attention/include \
    "$GPU_CHECK_BASELINE_CU" -o build/baseline/libinflight_pa_cuda.so; then
  baseline=(--baseline-lib build/baseline/libinflight_pa_cuda.so)
fi
stage 90 "attention timings bfloat16, 8B heads" $PY benchmarks/attention.py --device cuda --dtype bfloat16 \
  --repeat 10 --calls 20 --shape 32 8 128 --batches 256 1024 --contexts 128 512 "${baseline[@]}"
stage 480 engine $PY benchmarks/gpu_engine_check.py --attention "$attention" --profile 3 \
  ${GPU_CHECK_SKIP_BIG:+--skip-big} || status=1
exit $status
