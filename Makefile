# Two entry points for a fresh machine (both idempotent):
#   make serve   - set up, then serve model_repository/ with a real tritonserver
#   make test    - set up, then run the whole test suite
SHELL := /bin/bash
PYTHON ?= $(shell test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
MODEL_DIR := build/models/tiny-llama
PYTEST_ARGS ?=

.PHONY: setup system-deps venv native model serve test clean bench-deps bench-models bench-quick bench-attention \
	bench-peers

setup: venv native model

# Debian packages the Triton Python stub and the virtualenv need (no-op when present).
system-deps:
	@missing=""; for p in python3.11-venv libpython3.11; do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $$( [ $$(id -u) -eq 0 ] || echo sudo ) apt-get update -q && \
	  $$( [ $$(id -u) -eq 0 ] || echo sudo ) apt-get install -y -q $$missing; fi

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml | system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# Native plugins (paged-attention kernels) are built by CMake into build/.
native: venv
	cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build/cmake -j

model: venv
	$(BIN)/inflight make-model $(MODEL_DIR) --if-missing

serve: setup
	$(BIN)/inflight serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Benchmarks (see docs/PERFORMANCE.md); the quick run fits in a few minutes on 2 cores.
bench-deps: venv
	$(BIN)/python -m pip install -q -r requirements-bench.txt

bench-models: venv
	$(BIN)/inflight make-model build/models/bench-small --hidden-size 256 --intermediate-size 688 --layers 4 \
	  --heads 4 --kv-heads 2 --if-missing
	$(BIN)/inflight make-model build/models/bench-medium --hidden-size 512 --intermediate-size 1376 --layers 8 \
	  --heads 8 --kv-heads 2 --vocab-size 32000 --if-missing
	$(BIN)/inflight make-model build/models/bench-large --hidden-size 1024 --intermediate-size 2752 --layers 16 \
	  --heads 16 --kv-heads 4 --vocab-size 32000 --if-missing

# vLLM's CPU build and llama.cpp's server, pinned, under build/peers/, and the bench models as GGUF (idempotent;
# llama.cpp's build takes ~11 minutes on 2 cores). serve_bench's vllm: and llamacpp: targets use them.
bench-peers: bench-models
	benchmarks/peers/install.sh

bench-quick: setup bench-deps bench-models
	$(BIN)/python -m benchmarks.workload --num-requests 48 --out build/bench/quick.jsonl
	$(BIN)/python -m benchmarks.serve_bench --checkpoint build/models/bench-small --workload build/bench/quick.jsonl \
	  --max-batch-size 16 --targets engine:static engine:prefill_first engine:fused engine:fused+chunked \
	  triton:fused hf:static hf:batch --out benchmarks/results/quick.json
	$(BIN)/python -m benchmarks.plots benchmarks/results/quick.json --out benchmarks/results

bench-attention: native
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf build
