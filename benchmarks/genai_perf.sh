#!/usr/bin/env bash
# Profile the served model with NVIDIA genai-perf (its TensorRT-LLM profile: our inputs use the same names).
#
#   benchmarks/genai_perf.sh [CHECKPOINT] [CONCURRENCY] [INPUT_TOKENS] [OUTPUT_TOKENS]
#
# genai-perf 0.0.16 lives in its own virtualenv (build/genai-perf-venv): its pins do not fit beside
# nvidia-pytriton's. It drives the perf_analyzer from .venv (see perf_analyzer.sh for its two system needs).
# Results: benchmarks/results/genai-perf/.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKPOINT=${1:-build/models/bench-small}
CONCURRENCY=${2:-4}
ISL=${3:-64}
OSL=${4:-32}
WORK=build/genai-perf
GP=build/genai-perf-venv
mkdir -p "$WORK" benchmarks/results/genai-perf
[ -x "$GP/bin/genai-perf" ] || { /usr/bin/python3.11 -m venv "$GP" && "$GP/bin/pip" install -q "genai-perf==0.0.16"; }
benchmarks/perf_analyzer.sh --setup-only

source benchmarks/serve_in_background.sh
start_server "$CHECKPOINT" "$WORK"
cd benchmarks/results/genai-perf
PATH="$OLDPWD/.venv/bin:$PATH" LD_LIBRARY_PATH="$OLDPWD/build/perf_analyzer/lib:${LD_LIBRARY_PATH:-}" \
  "$OLDPWD/$GP/bin/genai-perf" profile -m llm --endpoint-type kserve --backend tensorrtllm --streaming \
  -u "localhost:$GRPC" --tokenizer "$OLDPWD/$CHECKPOINT" --synthetic-input-tokens-mean "$ISL" \
  --output-tokens-mean "$OSL" --output-tokens-mean-deterministic --concurrency "$CONCURRENCY" \
  --measurement-interval 10000
