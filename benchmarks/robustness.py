"""Robustness timings through a real tritonserver (issue 17's acceptance figures; tests assert the behaviour,
this measures the times):

    .venv/bin/python -m benchmarks.robustness [--checkpoint build/models/tiny-llama] [--streams 64]

1. oversized prompts: how fast a 10 MB `text_input` is refused, and the longest gap between tokens of 8 streams
   running meanwhile, against their median gap; the same for a 2 MB prompt that a model with a raised
   `max_prompt_bytes` does tokenize (then refuses for its tokens): tokenizing must not stall the streams.
2. cancellation at N open streams: each client cancels once it has received 10 tokens; the time from its
   cancel to the engine ending its request (the model prints that moment with INFLIGHT_TRACE_CANCELS=1;
   CLOCK_MONOTONIC is one clock for every process on the machine): p50, p99, max; how many ended as cancelled.
3. the cancel watcher's cost: tokens/s of N streams with every stream asked every 50 ms whatever the sweeps cost
   (`cancel_check_max_share` 1), as the defaults ask (50 ms, sweeps at most a tenth of the time) and every
   second, alternating, three rounds.
4. shutdown: `inflight serve` with N open streams gets SIGTERM: time until every stream has its final response
   or error, and until the process exits (and its exit code).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.repository import model_config, write_repository  # noqa: E402
from inflight_backend.server import TritonServer, free_port  # noqa: E402
from tests.triton_helpers import grpc_generate, infer_inputs, metric  # noqa: E402


def run_threads(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    return threads


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def oversized(url: str, model: str, size: int) -> dict:
    background = [None] * 8
    threads = run_threads([lambda i=i: background.__setitem__(i, grpc_generate(
        url, model, {"text_input": f"bg {i}", "max_tokens": 600, "min_tokens": 600, "stream": True}))
        for i in range(8)])
    time.sleep(1.0)
    start = time.monotonic()
    out = grpc_generate(url, model, {"text_input": "x" * size, "max_tokens": 4})
    refused = time.monotonic()
    for t in threads:
        t.join()
    window = [g for r in background for a, g in zip(r.token_times, gaps(r.token_times)) if start - 0.2 <= a <= refused]
    every = [g for r in background for g in gaps(r.token_times)]
    return {"model": model, "prompt_mb": size / 2**20, "refused_s": refused - start, "error": (out.error or "")[:70],
            "max_gap_during_ms": 1e3 * max(window, default=0.0), "median_gap_ms": 1e3 * statistics.median(every)}


def cancelled_stream(url: str, model: str, i: int, after: int) -> tuple[int, float]:
    """One stream whose client cancels once it has `after` responses. Returns (its prompt length in tokens, when
    it called stop_stream, time.monotonic(): the same clock as the server's on this machine)."""
    client, count, reached = grpcclient.InferenceServerClient(url), [0], threading.Event()
    prompt = "c" + "x" * i  # the byte-level tokenizer: BOS + i + 1 tokens, one length per stream

    def on_response(result, error):
        count[0] += 1
        if count[0] >= after:
            reached.set()

    client.start_stream(callback=on_response)
    client.async_stream_infer(model, infer_inputs({"text_input": prompt, "max_tokens": 1900, "min_tokens": 1900,
                                                   "stream": True}))
    reached.wait(120)
    cancelled_at = time.monotonic()
    client.stop_stream(cancel_requests=True)
    client.close()
    return i + 2, cancelled_at


def cancellation(url: str, port: int, model: str, n: int, log: Path) -> dict:
    """Per stream: from the client's cancel to the engine ending its request (CLOCK_MONOTONIC on both sides)."""
    cancelled = metric(port, "inflight_requests_finished_total", model, reason="cancelled")
    results = [None] * n
    for t in run_threads([lambda i=i: results.__setitem__(i, cancelled_stream(url, model, i, 10)) for i in range(n)]):
        t.join()
    deadline = time.monotonic() + 60
    while metric(port, "inflight_requests_finished_total", model, reason="cancelled") < cancelled + n:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.5)  # the trace lines of the last ones
    ended = {}  # prompt length -> when the engine ended it (the model traces each cancelled request)
    for line in log.read_text(errors="replace").splitlines():
        if "inflight-trace: cancelled: prompt" in line:
            words = line.split()
            ended[int(words[-5])] = float(words[-1])
    latency = sorted(1e3 * (ended[p] - at) for p, at in results if p in ended)
    return {"streams": n, "cancelled": metric(port, "inflight_requests_finished_total", model, reason="cancelled")
            - cancelled, "traced": len(latency), "cancel_latency_ms_p50": round(latency[len(latency) // 2], 1),
            "p99": round(latency[int(0.99 * (len(latency) - 1))], 1), "max": round(latency[-1], 1)}


def watcher_cost(url: str, models: list[str], n: int, rounds: int) -> dict:
    """Tokens/s of N streams x 200 tokens on models that differ only in how often they ask about cancellation,
    alternating."""
    rates: dict[str, list[float]] = {m: [] for m in models}
    for _ in range(rounds):
        for model in models:
            results = [None] * n
            start = time.monotonic()
            for t in run_threads([lambda i=i: results.__setitem__(i, grpc_generate(
                    url, model, {"text_input": f"w {i}", "max_tokens": 200, "min_tokens": 200, "stream": True}))
                    for i in range(n)]):
                t.join()
            rates[model].append(sum(len(r.ids) for r in results) / (time.monotonic() - start))
            errors = {r.error for r in results if r.error}
            assert not errors, errors
    return {m: [round(r) for r in v] for m, v in rates.items()}


def shutdown(checkpoint: str, n: int, work: Path) -> dict:
    repo = write_repository(work / "serve-repo", {"llm": model_config(checkpoint, "llm")})
    ports = [free_port() for _ in range(3)]
    log = work / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "inflight_backend.cli", "serve", "--model-repository", str(repo),
                              "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port",
                              str(ports[2])], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    while "inflight: ready." not in log.read_text(errors="replace"):
        assert serve.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    url, results, ended = f"127.0.0.1:{ports[1]}", [None] * n, [0.0] * n

    def send(i):
        results[i] = grpc_generate(url, "llm", {"text_input": f"s {i}", "max_tokens": 1900, "min_tokens": 1900,
                                                "stream": True})
        ended[i] = time.monotonic()

    threads = run_threads([lambda i=i: send(i) for i in range(n)])
    while sum(metric(ports[2], "inflight_requests", "llm", state=s) for s in ("running", "waiting")) < n:
        time.sleep(0.1)
    start = time.monotonic()
    serve.send_signal(signal.SIGTERM)
    code = serve.wait(120)
    exited = time.monotonic()
    for t in threads:
        t.join()
    text = log.read_text(errors="replace")
    return {"streams": n, "all_final": all(r.final for r in results), "last_stream_end_s": max(ended) - start,
            "exit_s": exited - start, "exit_code": code,
            "crash_lines": sum(text.count(m) for m in ("malloc", "Segmentation", "SIGSEGV", "Aborted"))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="build/models/tiny-llama")
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ["INFLIGHT_TRACE_CANCELS"] = "1"  # the served model prints how far each cancelled request got
    work = Path(tempfile.mkdtemp(prefix="inflight-robustness-"))
    repo = write_repository(work / "repo", {
        "llm": model_config(args.checkpoint, "llm"),
        "llm_big_prompts": model_config(args.checkpoint, "llm_big_prompts", max_prompt_bytes=4 << 20),
        "llm_unbounded": model_config(args.checkpoint, "llm_unbounded", cancel_check_max_share=1.0),
        "llm_poll_1s": model_config(args.checkpoint, "llm_poll_1s", cancel_check_interval_ms=1000)})
    with TritonServer(repo, free_port(), free_port(), free_port(), log_file=work / "server.log") as server:
        url = f"127.0.0.1:{server.grpc_port}"
        print(oversized(url, "llm", 10 << 20))
        print(oversized(url, "llm_big_prompts", 2 << 20))
        for model in ("llm", "llm_unbounded"):
            print(model, cancellation(url, server.metrics_port, model, args.streams, work / "server.log"))
        print("tokens/s, cancel checks every 50 ms unbounded, the default (50 ms, at most a tenth of the time), 1 s:",
              watcher_cost(url, ["llm_unbounded", "llm", "llm_poll_1s"], args.streams, rounds=3))
    print(shutdown(args.checkpoint, args.streams, work))


if __name__ == "__main__":
    main()
