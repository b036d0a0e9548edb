# Sourced by the benchmark scripts: `start_server CHECKPOINT WORKDIR` writes a one-model repository (`llm`) for
# CHECKPOINT under WORKDIR, starts `inflight serve` on free loopback ports in the background, waits until it is
# ready, and stops it when the calling script exits. Sets HTTP, GRPC and METRICS.
start_server() {
  local checkpoint=$1 work=$2
  read -r HTTP GRPC METRICS <<<"$(.venv/bin/python -c \
    "from inflight_backend.server import free_port; print(free_port(), free_port(), free_port())")"
  .venv/bin/python - "$work/repo" "$checkpoint" <<'PY'
import sys
from inflight_backend.repository import model_config, write_repository
write_repository(sys.argv[1], {"llm": model_config(sys.argv[2], "llm")})
PY
  # perf_analyzer reads the model config over gRPC and cannot send the admin key: leave model-config open.
  .venv/bin/inflight serve --model-repository "$work/repo" --http-port "$HTTP" --grpc-port "$GRPC" \
    --metrics-port "$METRICS" --restricted-api shared-memory,model-repository,logging,trace \
    > "$work/server.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  until grep -q "inflight: ready" "$work/server.log"; do
    kill -0 $SERVER 2>/dev/null || { cat "$work/server.log"; exit 1; }
    sleep 1
  done
}
