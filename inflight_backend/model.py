"""Triton entry point: the `inflight` Python-based backend (decoupled).

Thin by design: `execute()` parses each request, registers its response sender and hands it to the batch
loop; the loop's responder thread turns engine outputs into streamed responses. No scheduling or tensors here.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from inflight_backend import protocol, vllm_protocol
from inflight_backend.batch_loop import BatchLoop
from inflight_backend.cancel_watcher import CancelWatcher
from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine, RequestOutput, RequestTimes
from inflight_backend.metrics import TritonMetrics
from inflight_backend.request import QueueFull, RequestError, ServerStopping
from inflight_backend.stats import EngineStats
from inflight_backend.stop_signal import StopSignal

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_TRACE_CANCELS = os.environ.get("INFLIGHT_TRACE_CANCELS") == "1"  # one stderr line per cancelled request
_METRICS_INTERVAL_S = 0.2  # each metric update is an IPC round trip: publish stats at most this often


@dataclass(slots=True)
class _Stream:
    """One open request: where its responses go and, when not streaming, what has accumulated."""

    sender: object
    stream: bool
    prefix_text: str  # prompt text prepended to a non-streamed output (exclude_input_in_output=false)
    prefix_ids: list[int]
    arrival: float  # time.monotonic() when execute() received it
    return_perf_metrics: bool
    outputs: frozenset[str] | None  # the outputs the client asked for; None: all of them
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    first_token_seen: bool = False
    closed: bool = False  # its FINAL is about to go or went: never ask is_cancelled() again (see _asks_cancelled)


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        """Force decoupled mode and max_batch_size 0; declare every input/output the protocol defines."""
        declared = config.as_dict()
        have_inputs = {i["name"] for i in declared.get("input", [])}
        have_outputs = {o["name"] for o in declared.get("output", [])}
        for name, (dtype, dims) in protocol.all_inputs().items():
            if name not in have_inputs:
                config.add_input({"name": name, "data_type": dtype, "dims": dims, "optional": True})
        for name, (dtype, dims) in {**protocol.OUTPUTS, **protocol.PERF_OUTPUTS}.items():
            if name not in have_outputs:
                config.add_output({"name": name, "data_type": dtype, "dims": dims})
        config.set_max_batch_size(0)
        config.set_model_transaction_policy({"decoupled": True})
        return config

    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        self.config = EngineConfig.from_parameters(params, base_dir=args["model_repository"])
        self.engine = InflightEngine(self.config)
        self.limits = self.engine.prompt_limits()
        self.metrics = TritonMetrics(pb_utils, args["model_name"])
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._final_lock = threading.Lock()  # between a FINAL and an is_cancelled() on the same sender
        self._ids = itertools.count()
        self._last_publish = 0.0
        self._unpublished: EngineStats | None = None
        self._respond_seconds = 0.0
        self._rejected: Counter[str] = Counter()  # by reason, since the last publish (execute's thread adds)
        self._stop_signal = StopSignal.from_environment()
        self._stopping: str | None = None  # once set: the message every open and new request ends with
        self.loop = BatchLoop(self.engine, self._emit, on_idle=self._on_idle)
        self._watcher = CancelWatcher(self._open_senders, self.loop.cancel, self._check_stop,
                                      self.config.cancel_check_interval_ms / 1000.0)
        pb_utils.Logger.log_info(
            f"inflight: model {args['model_name']} ready: {self.config} on {self.config.resolved_device()}, "
            f"{self.engine.blocks.num_blocks} KV blocks of {self.config.block_size} tokens, "
            f"engine: {self.engine.runner.describe()}; prompts up to {self.limits.max_bytes} bytes and "
            f"{self.limits.max_tokens} tokens")

    def execute(self, requests):
        for request in requests:
            self._enqueue(request)
        return None

    def finalize(self):
        """Stop watching, then end every open stream and stop both threads, bounded so that Triton's exit
        timeout is never reached; no thread touches pb_utils once this returns."""
        self._watcher.stop()
        if not self.loop.stop():
            pb_utils.Logger.log_warn("inflight: the engine thread did not stop in time; its outputs are dropped")

    def _enqueue(self, request) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        try:
            if self._stopping is not None:
                raise ServerStopping(self._stopping)
            sampling = _sampling_parameters(request)
            parsed = protocol.parse_request(lambda name: _input(request, name), self.engine.encode,
                                            self.config.default_max_tokens, self.limits, sampling)
            self.engine.validate(parsed.prompt_ids, parsed.params)
            self._check_queue()
        except Exception as exc:  # anything unforeseen still ends this request alone, with FINAL
            reason = exc.reason if isinstance(exc, RequestError) else "invalid"
            message = str(exc) if isinstance(exc, RequestError) else f"invalid request: {type(exc).__name__}: {exc}"
            with self._lock:
                self._rejected[reason] += 1
            _send_error(sender, message)
            return
        req_id = str(next(self._ids))
        keep_input = not parsed.stream and not parsed.exclude_input_in_output
        prefix_text = (parsed.prompt_text or self.engine.tokenizer.decode(parsed.prompt_ids)) if keep_input else ""
        with self._lock:
            self._streams[req_id] = _Stream(sender, parsed.stream, prefix_text,
                                            parsed.prompt_ids if keep_input else [], arrival,
                                            parsed.return_perf_metrics, _requested(request))
        self.loop.submit(req_id, parsed.prompt_ids, parsed.params, parsed.priority, arrival)

    def _open_senders(self) -> list[tuple[str, Callable[[], bool]]]:
        with self._lock:
            return [(req_id, partial(self._asks_cancelled, stream)) for req_id, stream in self._streams.items()]

    def _asks_cancelled(self, stream: _Stream) -> bool:
        """Watcher thread. python_backend 2.51 frees a request's response factory once its FINAL is sent, and
        is_cancelled() on it afterwards crashes tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled):
        the responder closes a stream under this lock before sending its FINAL, so no ask can overlap it."""
        with self._final_lock:
            return not stream.closed and stream.sender.is_cancelled()

    def _check_stop(self) -> None:
        """Watcher thread: once the supervisor asks (or is gone), end every stream and refuse new ones."""
        if self._stopping is None and self._stop_signal.is_set():
            self._stopping = "the server is shutting down: request ended early; retry on another instance"
            pb_utils.Logger.log_info("inflight: stop requested: ending every open stream")
            self.loop.drain(self._stopping)

    def _check_queue(self) -> None:
        limit = self.config.max_queue_size
        if limit and self.loop.queue_depth() >= limit:
            raise QueueFull(f"queue full: {limit} requests are already waiting (max_queue_size); retry later")

    def _emit(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Responder thread: one response per streamed token; one in all for non-streamed requests.

        When these outputs end the last open stream, metrics are published before the responses go out, so a
        client that has its last final response sees every count in /metrics (tests rely on it)."""
        start = time.perf_counter()
        ready = []
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            if out.finished:
                with self._lock:
                    del self._streams[out.req_id]
                with self._final_lock:
                    stream.closed = True
            self._observe(stream, out)
            ready.append((stream, out))
        self._unpublished = stats
        if not self._streams:
            self._publish_metrics()
        for stream, out in ready:
            self._deliver(stream, out)
        self._respond_seconds += time.perf_counter() - start
        if time.monotonic() - self._last_publish >= _METRICS_INTERVAL_S:
            self._publish_metrics()

    def _on_idle(self) -> None:
        """Responder thread, nothing to send: publish what changed (stats after a failure, rejections)."""
        if self._unpublished is not None or self._rejected:
            self._publish_metrics()

    def _publish_metrics(self) -> None:
        with self._lock:
            rejected, self._rejected = self._rejected, Counter()
        if self._unpublished is not None:
            self.metrics.update(self._unpublished, self._respond_seconds)
        self.metrics.record_rejections(rejected)
        self._unpublished, self._respond_seconds = None, 0.0
        self._last_publish = time.monotonic()

    def _deliver(self, stream: _Stream, out: RequestOutput) -> None:
        if out.error is not None:
            _send_error(stream.sender, out.error)
        elif stream.stream:
            _send(stream.sender, _response(out.text, out.token_ids, out, stream), _FINAL if out.finished else 0)
        elif out.finished:
            text = stream.prefix_text + "".join(stream.texts) + out.text
            ids = stream.prefix_ids + stream.ids + out.token_ids
            _send(stream.sender, _response(text, ids, out, stream), _FINAL)
        else:
            stream.texts.append(out.text)
            stream.ids += out.token_ids

    def _observe(self, stream: _Stream, out: RequestOutput) -> None:
        """Latency histograms, observed once or twice per request (each observation is an IPC round trip)."""
        if out.token_ids and not stream.first_token_seen:
            stream.first_token_seen = True
            self.metrics.observe_first_token(out.token_time - stream.arrival)
        if out.finished:
            per_token, times = None, out.times  # the engine's own first/last token times and token count
            if times is not None and out.num_output_tokens > 1:
                per_token = (times.last_token - times.first_token) / (out.num_output_tokens - 1)
            self.metrics.observe_finished(out.finish_reason, time.monotonic() - stream.arrival, per_token)
            # benchmarks/robustness.py reads these lines
            if _TRACE_CANCELS and out.finish_reason == "cancelled" and times is not None:
                print(f"inflight-trace: cancelled: prompt {out.num_input_tokens} tokens, ended at {times.finished:.6f}",
                      file=sys.stderr, flush=True)

def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _sampling_parameters(request) -> dict:
    """vLLM sampling parameters: the `sampling_parameters` input, else the request's parameters."""
    tensor = _input(request, "sampling_parameters")
    if tensor is not None and tensor.size != 1:
        raise RequestError(f"input 'sampling_parameters' must hold one JSON string, got shape {list(tensor.shape)}")
    raw = None if tensor is None else tensor.reshape(-1)[0]
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return vllm_protocol.sampling_parameters(text, request.parameters())


def _requested(request) -> frozenset[str] | None:
    names = request.requested_output_names()
    return frozenset(names) if names else None


def _response(text: str, token_ids: list[int], out: RequestOutput, stream: _Stream):
    """The response tensors, built only for the outputs the client asked for (one response per token: a client
    that reads output_ids alone skips the text tensor's serialization)."""
    wanted = stream.outputs
    tensors = []
    if wanted is None or "text_output" in wanted:
        tensors.append(pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)))
    if wanted is None or "output_ids" in wanted:
        tensors.append(pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int32)))
    if out.finished:
        final = {"finish_reason": lambda: np.array([out.finish_reason.encode()], dtype=np.object_),
                 "num_input_tokens": lambda: np.array([out.num_input_tokens], dtype=np.int32),
                 "num_output_tokens": lambda: np.array([out.num_output_tokens], dtype=np.int32)}
        tensors += [pb_utils.Tensor(name, make()) for name, make in final.items() if wanted is None or name in wanted]
        if stream.return_perf_metrics and out.times is not None:
            tensors += [t for t in _perf_tensors(out.times) if wanted is None or t.name() in wanted]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _perf_tensors(times: RequestTimes) -> list:
    stamps = {"arrival_time_ns": times.arrival, "first_scheduled_time_ns": times.first_scheduled,
              "first_token_time_ns": times.first_token, "last_token_time_ns": times.last_token}
    return [pb_utils.Tensor(name, np.array([-1 if t is None else int(t * 1e9)], dtype=np.int64))
            for name, t in stamps.items()]


def _send_error(sender, message: str) -> None:
    _send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), _FINAL)


def _send(sender, response, flags: int) -> None:
    try:
        sender.send(response, flags=flags)
    except Exception as exc:  # (not is_cancelled() here: after a FINAL the sender's factory may be gone)
        pb_utils.Logger.log_error(f"inflight: failed to send a response: {exc}")
