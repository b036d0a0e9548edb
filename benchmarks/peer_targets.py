"""The servers users would pick instead, as serve_bench targets: vLLM's CPU build (`vllm:`) and llama.cpp's server
(`llamacpp:`), installed by `make bench-peers` (benchmarks/peers/install.sh) under build/peers/.

Both are driven like TritonTarget: the same workload items, the same arrival processes (benchmarks/targets.py's
Submitter), streaming over HTTP with one thread per request (benchmarks/sse_client.py, which `triton:...+http`
shares), every token's arrival time recorded, prompts sent as token ids (so every server computes the same tokens),
outputs forced to their length (min_tokens / ignore_eos), greedy, in the run's dtype. `targets.check_greedy`
compares a server's greedy ids with transformers' before anything is timed.
"""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
import time
from pathlib import Path

from benchmarks import proc_stat, sse_client

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # serve_bench --dtype -> the converted GGUF's (install.sh)


class _HTTPServerTarget:
    """A server process on a loopback port; subclasses give its command and its streaming request."""

    name = "peer"
    startup_timeout_s = 300.0

    def __init__(self, command: list[str], port: int, log_file: Path, env: dict | None = None) -> None:
        self.port = port
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_file, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, start_new_session=True)
        self._wait_ready(log_file)

    def _wait_ready(self, log_file: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log: {log_file}")
            try:
                status, _ = self._get("/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready in {self.startup_timeout_s:.0f} s; log: {log_file}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _post(self, path: str, body: dict):
        return sse_client.post(self.port, path, body)

    # --- what a subclass defines ---
    def stream_body(self, prompt_ids: list[int], n: int) -> tuple[str, dict]:
        raise NotImplementedError

    def tokens_in(self, event: dict) -> tuple[int, bool]:
        """(tokens this streamed event carries, whether it is the last)."""
        raise NotImplementedError

    def greedy_ids(self, prompt_ids: list[int], n: int) -> list[int]:
        raise NotImplementedError

    # --- driving a workload ---
    def run(self, items, arrivals, concurrency=None):
        cpu_before, client_before = _cpu(self.process.pid), time.process_time()
        records = sse_client.stream_all(self.port, self.name, items, arrivals, concurrency, self.stream_body,
                                        self.tokens_in)
        # the client's CPU beside the server's, as TritonTarget reports it: every client shares the server's cores
        return records, {"cpu_seconds": {self.name: _cpu(self.process.pid) - cpu_before,
                                         "client": time.process_time() - client_before}}


class VLLMTarget(_HTTPServerTarget):
    """vLLM's OpenAI server (CPU build), in `dtype` (float32 or bfloat16), its KV cache sized in bytes."""

    name = "vllm"

    def __init__(self, checkpoint: str, workdir: Path, port: int, max_batch_size: int, max_num_tokens: int,
                 max_model_len: int = 2048, kv_cache_bytes: int = 2 * 2**30, chunk_budget: int = 0,
                 prefix_caching: bool = True, sampling: tuple[float, float] = (0.0, 1.0),
                 dtype: str = "float32") -> None:
        """`chunk_budget`: tokens per step with chunked prefill (`--max-num-batched-tokens`, which may then be below
        the model's context); 0: `max_num_tokens`, at least the context. `prefix_caching`: vLLM's default, on."""
        self.temperature, self.top_p = sampling  # the timed requests'; the greedy check stays greedy
        python = PEERS / "vllm" / "bin" / "python"
        if not python.exists():
            raise SystemExit("vLLM is not installed: run `make bench-peers`")
        self.model = checkpoint
        cache = PEERS / "cache"
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes",
                   str(kv_cache_bytes), "--max-num-seqs", str(max_batch_size), "--max-num-batched-tokens",
                   str(chunk_budget or max(max_num_tokens, max_model_len)), "--host", "127.0.0.1", "--port", str(port)]
        if chunk_budget:
            command.append("--enable-chunked-prefill")
        if not prefix_caching:
            command.append("--no-enable-prefix-caching")
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",  # by default it keeps a core to itself
               "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
        super().__init__(command, port, workdir / "vllm.log", env)

    def stream_body(self, prompt_ids, n):
        return "/v1/completions", {"model": self.model, "prompt": prompt_ids, "max_tokens": n, "min_tokens": n,
                                   "ignore_eos": True, "temperature": self.temperature, "top_p": self.top_p,
                                   "stream": True, "return_token_ids": True}

    def tokens_in(self, event):
        choices = event.get("choices") or []
        if not choices:
            return 0, False
        choice = choices[0]
        ids = choice.get("token_ids")
        count = len(ids) if ids is not None else int(bool(choice.get("text")))
        return count, choice.get("finish_reason") is not None

    def greedy_ids(self, prompt_ids, n):
        conn, response = self._post("/v1/completions", {"model": self.model, "prompt": prompt_ids, "max_tokens": n,
                                                        "temperature": 0.0, "return_token_ids": True})
        try:
            return json.loads(response.read())["choices"][0]["token_ids"]
        finally:
            conn.close()


class LlamaCppTarget(_HTTPServerTarget):
    """llama.cpp's server on the checkpoint's GGUF in `dtype` (float32 or bfloat16), continuous batching over
    `max_batch_size` slots."""

    name = "llamacpp"

    def __init__(self, checkpoint: str, workdir: Path, port: int, max_batch_size: int, context: int = 65536,
                 sampling: tuple[float, float] = (0.0, 1.0), dtype: str = "float32") -> None:
        self.temperature, self.top_p = sampling  # the timed requests'; the greedy check stays greedy
        binary = PEERS / "llama.cpp" / "bin" / "llama-server"
        gguf = PEERS / "gguf" / f"{Path(checkpoint).name}.{GGUF_TYPES[dtype]}.gguf"
        if not binary.exists() or not gguf.exists():
            raise SystemExit(f"llama.cpp or {gguf.name} is missing: run `make bench-peers`")
        threads = str(os.cpu_count())
        command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np",
                   str(max_batch_size), "-c", str(context), "--cont-batching", "-t", threads, "-tb", threads,
                   "--poll", "0"]
        super().__init__(command, port, workdir / "llamacpp.log")

    def stream_body(self, prompt_ids, n):
        # Only temperature and top-p: llama.cpp's other default samplers (top-k 40, min-p 0.05) off, as elsewhere
        return "/completion", {"prompt": prompt_ids, "n_predict": n, "ignore_eos": True,
                               "temperature": self.temperature, "top_p": self.top_p, "top_k": 0, "min_p": 0.0,
                               "stream": True, "cache_prompt": False, "return_tokens": True}

    def tokens_in(self, event):
        # Chunks leave out the ids of tokens held back for UTF-8; the last one says how many there were in all.
        if event.get("stop"):
            seen = getattr(self._tls, "seen", 0)
            self._tls.seen = 0
            return max(event.get("tokens_predicted", seen) - seen, 0), True
        count = len(event.get("tokens") or [])
        self._tls.seen = getattr(self._tls, "seen", 0) + count
        return count, False

    _tls = threading.local()

    def greedy_ids(self, prompt_ids, n):
        conn, response = self._post("/completion", {"prompt": prompt_ids, "n_predict": n, "temperature": 0.0,
                                                    "cache_prompt": False, "return_tokens": True})
        try:
            return json.loads(response.read())["tokens"]
        finally:
            conn.close()


def _cpu(pid: int) -> float:
    """CPU seconds so far of a process and all its descendants (vLLM runs its engine in a child process)."""
    stats = {p: proc_stat.stat(p) for p in proc_stat.pids()}
    family, total, grew = {pid}, 0.0, True
    while grew:
        grew = False
        for p, (parent, _) in stats.items():
            if parent in family and p not in family:
                family.add(p)
                grew = True
    for p in family:
        total += stats.get(p, proc_stat.stat(p))[1]
    return total
