"""TritonTarget: our backend through a real tritonserver, driven like every target of benchmarks/targets.py.

Over gRPC (the default) one stream carries every request and the client requests `output_ids` only (it counts
tokens), so the backend builds no text tensors for it; over HTTP (`+http`) each request streams from
`/generate_stream` through the peers' own client (benchmarks/sse_client.py) and receives every output, text
included. Besides the records it reports the engine's phase seconds and prefix-cache tokens (from /metrics) and
the CPU seconds of tritonserver, the model's stub and this client.
"""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks import proc_stat
from benchmarks.ceiling_clients import grpc_input
from benchmarks.targets import Submitter, new_records


class TritonTarget:
    """Starts its own tritonserver serving the checkpoint with `params`; stop() shuts it down."""

    def __init__(self, checkpoint: str, workdir: str | Path, sampling: tuple[float, float] = (0.0, 1.0),
                 transport: str = "grpc", **params) -> None:
        """`sampling`: the timed requests' (temperature, top_p); (0, 1): greedy. `transport`: "grpc" (one stream
        for every request, `output_ids` only) or "http" (`/generate_stream`, one connection and thread per
        request, every output: the peers' client, benchmarks/sse_client.py)."""
        from inflight_backend.repository import model_config, write_repository
        from inflight_backend.server import TritonServer, free_port

        self.sampling, self.transport = sampling, transport
        repo = write_repository(Path(workdir) / "repo", {"bench": model_config(checkpoint, "bench", **params)})
        self.server = TritonServer(repo, free_port(), free_port(), free_port(),
                                   log_file=Path(workdir) / "tritonserver.log").start()

    def stop(self) -> None:
        self.server.stop()

    def run(self, items, arrivals, concurrency=None):
        before = self._phase_seconds()
        cache_before = self._prompt_tokens()
        cpu_before = self._cpu_seconds()
        if self.transport == "http":
            records = self._run_http(items, arrivals, concurrency)
        else:
            records = self._run_grpc(items, arrivals, concurrency)
        after = self._phase_seconds()
        cpu = {k: v - cpu_before[k] for k, v in self._cpu_seconds().items()}
        spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        busy = spent.get("schedule", 0) + spent.get("model", 0) + spent.get("sample", 0)
        overhead = spent.get("schedule", 0) + spent.get("sample", 0) + spent.get("respond", 0)
        cache = {k: v - cache_before[k] for k, v in self._prompt_tokens().items()}
        return records, {"overhead_fraction": overhead / max(busy, 1e-9), "cpu_seconds": cpu, **cache}

    def _run_http(self, items, arrivals, concurrency):
        from benchmarks import sse_client

        def body(prompt_ids, n):
            payload = {"input_ids": prompt_ids, "max_tokens": n, "min_tokens": n, "stream": True}
            if self.sampling != (0.0, 1.0):
                payload.update(temperature=self.sampling[0], top_p=self.sampling[1])
            return "/v2/models/bench/generate_stream", payload

        def tokens_in(event):
            if "error" in event:
                raise RuntimeError(f"triton: {event['error']}")
            ids = event.get("output_ids", [])
            return (len(ids) if isinstance(ids, list) else 1), False  # the stream ends after the last

        return sse_client.stream_all(self.server.http_port, "triton", items, arrivals, concurrency, body, tokens_in)

    def _run_grpc(self, items, arrivals, concurrency):
        import tritonclient.grpc as grpcclient

        records = new_records(items, arrivals)
        sub = Submitter(records, concurrency)

        def callback(result, error):
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            i = int(response.id)
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:  # a coalesced response carries several tokens, all arrived now
                now = sub.now()
                for _ in range(ids.size):
                    sub.token(i, now)
            if response.parameters["triton_final_response"].bool_param:
                sub.finished()

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}")
        wanted = [grpcclient.InferRequestedOutput("output_ids")]  # token ids are all this client reads
        client.start_stream(callback=callback)

        def submit(i):
            client.async_stream_infer("bench", _stream_inputs(items[i].prompt_ids, items[i].output_len, forced=True,
                                                              sampling=self.sampling),
                                      request_id=str(i), outputs=wanted, enable_empty_final_response=True)

        try:
            sub.run(submit)
        finally:
            client.stop_stream()
            client.close()
        return records

    def greedy_ids(self, prompt_ids: list[int], n: int) -> list[int]:
        """At most `n` greedy tokens for one prompt (the model's default sampling), streamed over gRPC."""
        import queue

        import tritonclient.grpc as grpcclient

        ids: list[int] = []
        done: queue.Queue = queue.Queue()

        def callback(result, error):
            if error is not None:
                done.put(str(error))
                return
            got = result.as_numpy("output_ids")
            if got is not None:
                ids.extend(int(t) for t in got.reshape(-1))
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.put(None)

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}")
        client.start_stream(callback=callback)
        try:
            client.async_stream_infer("bench", _stream_inputs(prompt_ids, n, forced=False), request_id="greedy-check",
                                      outputs=[grpcclient.InferRequestedOutput("output_ids")],
                                      enable_empty_final_response=True)
            error = done.get(timeout=600)
        finally:
            client.stop_stream()
            client.close()
        if error is not None:
            raise RuntimeError(error)
        return ids

    def _prompt_tokens(self) -> dict[str, float]:
        """Prompt tokens served from the prefix cache and computed, so far (from /metrics)."""
        from inflight_backend.server import read_metrics

        values = {name: v for (name, _), v in read_metrics(self.server.metrics_port).items()}
        return {"cached_prompt_tokens": values.get("inflight_prefix_cache_tokens_total", 0.0),
                "computed_prompt_tokens": values.get("inflight_prompt_tokens_total", 0.0)}

    def _cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of tritonserver, of the model's stub process, and of this client."""
        return {**proc_stat.server_cpu(self.server.started().pid), "client": time.process_time()}

    def _phase_seconds(self) -> dict[str, float]:
        from inflight_backend.server import read_metrics

        values = read_metrics(self.server.metrics_port)
        return {dict(labels)["phase"]: v for (name, labels), v in values.items()
                if name == "inflight_step_seconds_total"}


def _stream_inputs(prompt_ids: list[int], n: int, forced: bool, sampling: tuple[float, float] = (0.0, 1.0)) -> list:
    """A streamed request's gRPC inputs: the prompt's ids and at most `n` new tokens (exactly `n` when `forced`),
    sampled at `sampling`'s (temperature, top_p) unless that is greedy (0, 1)."""
    import numpy as np

    limit = np.array([n], dtype=np.int32)
    inputs = [grpc_input("input_ids", np.array(prompt_ids, dtype=np.int32), "INT32"),
              grpc_input("max_tokens", limit, "INT32"), grpc_input("stream", np.array([True]), "BOOL")]
    if sampling != (0.0, 1.0):
        inputs += [grpc_input(name, np.array([value], dtype=np.float32), "FP32")
                   for name, value in zip(("temperature", "top_p"), sampling)]
    return inputs + [grpc_input("min_tokens", limit, "INT32")] if forced else inputs
