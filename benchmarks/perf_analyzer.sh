#!/usr/bin/env bash
# Drive the served model with NVIDIA perf_analyzer (gRPC streaming, decoupled) over a concurrency sweep.
#
#   benchmarks/perf_analyzer.sh [CHECKPOINT] [CONCURRENCY_RANGE] [OUTPUT_TOKENS]
#   e.g. benchmarks/perf_analyzer.sh build/models/bench-small 1:16:2 64
#
# Starts its own tritonserver on free loopback ports (model `llm` on CHECKPOINT), writes the generated input
# data, runs perf_analyzer --async --streaming, and records its summary and CSV under benchmarks/results/.
# perf_analyzer comes with tritonclient 2.50 (requirements.txt); it needs Debian's libb64-0d and a
# libcudart.so.12, which nvidia-pytriton carries under another name (linked into build/perf_analyzer/lib).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ONLY=0
if [ "${1:-}" = "--setup-only" ]; then SETUP_ONLY=1; shift; fi  # just libb64 and the libcudart link
CHECKPOINT=${1:-build/models/bench-small}
RANGE=${2:-1:16:2}
TOKENS=${3:-64}
BIN=.venv/bin
OUT=benchmarks/results
WORK=build/perf_analyzer
mkdir -p "$OUT" "$WORK/lib"

if ! dpkg -s libb64-0d >/dev/null 2>&1; then
  $( [ "$(id -u)" -eq 0 ] || echo sudo ) apt-get install -y -q libb64-0d
fi
CUDART=$(ls .venv/lib/python3.*/site-packages/nvidia_pytriton.libs/libcudart-*.so.12* | head -n1)
ln -sf "$(realpath "$CUDART")" "$WORK/lib/libcudart.so.12"
[ "$SETUP_ONLY" = 1 ] && exit 0

$BIN/python - "$WORK/input.json" "$TOKENS" <<'PY'
import json, random, sys
rng = random.Random(0)
words = ["serving", "tokens", "batch", "latency", "paged", "cache", "stream", "triton", "model", "engine"]
data = [{"text_input": {"content": [" ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))], "shape": [1]},
         "max_tokens": [int(sys.argv[2])], "min_tokens": [int(sys.argv[2])], "stream": [True]} for _ in range(64)]
json.dump({"data": data}, open(sys.argv[1], "w"))
PY

source benchmarks/serve_in_background.sh
start_server "$CHECKPOINT" "$WORK"

LD_LIBRARY_PATH="$PWD/$WORK/lib:${LD_LIBRARY_PATH:-}" $BIN/perf_analyzer -m llm -i grpc -u "127.0.0.1:$GRPC" \
  --async --streaming --input-data "$WORK/input.json" --concurrency-range "$RANGE" \
  --measurement-interval 8000 --stability-percentage 50 -f "$OUT/perf_analyzer.csv" | tee "$OUT/perf_analyzer.txt"
echo "recorded $OUT/perf_analyzer.txt and $OUT/perf_analyzer.csv"
