"""Triton entry point: the `inflight` Python-based backend (decoupled).

Thin by design: `execute()` parses each request (a call: B rows in TensorRT-LLM's batched layout, each with
num_return_sequences sequences), registers its response sender and hands every sequence to the batch loop; the
loop's responder thread turns engine outputs into responses (`responses.py` builds the tensors). Decoupled
models stream; a non-decoupled one (unary calls) answers each call once, when all its sequences are done, and
its execute() still returns at once, so concurrent unary calls share iterations. No scheduling here.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np

import triton_python_backend_utils as pb_utils

from inflight_backend import (calls, declared_io, gc_tuning, openmp_pool, protocol, responses, trtllm_layout,
                              vllm_protocol)
from inflight_backend.batch_loop import BatchLoop
from inflight_backend.calls import Call, Sequence
from inflight_backend.cancel_watcher import CancelWatcher
from inflight_backend.config import EngineConfig, instance_count
from inflight_backend.engine import InflightEngine, RequestOutput
from inflight_backend.metrics import TritonMetrics
from inflight_backend.request import QueueFull, RequestError, ServerStopping
from inflight_backend.stats import EngineStats
from inflight_backend.stop_signal import StopSignal

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_TRACE_CANCELS = os.environ.get("INFLIGHT_TRACE_CANCELS") == "1"  # one stderr line per cancelled request
_METRICS_INTERVAL_S = 0.2  # each metric update is an IPC round trip: publish stats at most this often


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        """Declare every input/output the protocol defines. `max_batch_size` 0 (the default) is this backend's
        layout; above 0, TensorRT-LLM's batched one. `decoupled: false` serves unary calls (ModelInfer)."""
        declared = config.as_dict()
        have_inputs = {i["name"] for i in declared.get("input", [])}
        have_outputs = {o["name"] for o in declared.get("output", [])}
        for name, (dtype, dims) in declared_io.all_inputs().items():
            if name not in have_inputs:
                config.add_input({"name": name, "data_type": dtype, "dims": dims, "optional": True})
        if declared.get("max_batch_size", 0) > 0:
            _allow_ragged_batches(config, have_inputs)
        for name, (dtype, dims) in declared_io.all_outputs().items():
            if name not in have_outputs:
                config.add_output({"name": name, "data_type": dtype, "dims": dims})
        return config

    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        self.config = EngineConfig.from_parameters(params, base_dir=args["model_repository"])
        self.batched = model_config.get("max_batch_size", 0) > 0
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        # Triton's dynamic batcher hands execute() every request queued while the last call ran (each keeps its own
        # response sender): intake amortised over a burst. The backend still batches every iteration itself.
        self._intake = _intake(model_config)
        self._name = args["model_name"]
        self.metrics = TritonMetrics(pb_utils, self._name)
        self._sequences: dict[str, Sequence] = {}
        self._calls: dict[str, Call] = {}
        self._lock = threading.Lock()
        self._final_lock = threading.Lock()  # between a FINAL and an is_cancelled() on the same sender
        self._ids = itertools.count()
        self._last_publish = 0.0
        self._unpublished: EngineStats | None = None
        self._respond_seconds = 0.0
        self._rejected: Counter[str] = Counter()  # by reason, since the last publish (execute's thread adds)
        # Requests ended since the last publish, by finish reason (responder only): counted with the stats they
        # came with, one IPC per reason a publish rather than one per request
        self._finished: Counter[str] = Counter()
        self._stop_signal = StopSignal.from_environment()
        self._stopping: str | None = None  # once set: the message every open and new request ends with
        self._drained_logged = False
        engine = InflightEngine(self.config)
        gc_tuning.for_serving()  # what exists now lives as long as the stub
        threads = self.config.cpu_threads or openmp_pool.share(instance_count(model_config))
        self.loop = BatchLoop(engine, self._emit, on_idle=self._on_idle, threads=threads)
        self.limits = self.loop.prompt_limits()
        self._watcher = CancelWatcher(self._open_senders, self._cancel_call, self._check_stop,
                                      self.config.cancel_check_interval_ms / 1000.0,
                                      self.config.cancel_check_max_share)
        layout = "TensorRT-LLM batched" if self.batched else "unbatched"
        pb_utils.Logger.log_info(
            f"inflight: model {args['model_name']} ready ({layout} layout, "
            f"{'decoupled' if self.decoupled else 'unary'}, {self._intake}): {self.config} on "
            f"{self.config.resolved_device()}, "
            f"{self.loop.describe()}; prompts up to {self.limits.max_bytes} bytes and "
            f"{self.limits.max_tokens} tokens")

    def execute(self, requests):
        for request in requests:
            self._enqueue(request)
        return None

    def finalize(self):
        """Stop watching, then end every open stream and stop both threads, bounded so that Triton's exit
        timeout is never reached; no thread touches pb_utils once this returns."""
        # Triton calls this only once nothing holds the model (every response factory and stream released); these
        # two lines tell a shutdown that overruns its exit timeout apart: held (neither), or stuck past them.
        pb_utils.Logger.log_info(f"inflight: {self._name}: finalizing")
        self._watcher.stop()
        if not self.loop.stop():
            pb_utils.Logger.log_warn(f"inflight: {self._name}: the engine thread did not stop in time; its outputs are "
                                     "dropped")
        pb_utils.Logger.log_info(f"inflight: {self._name}: finalized")

    def _enqueue(self, request) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        try:
            rows = self._parse(request)
        except Exception as exc:  # anything unforeseen still ends this request alone, with FINAL
            reason = exc.reason if isinstance(exc, RequestError) else "invalid"
            message = str(exc) if isinstance(exc, RequestError) else f"invalid request: {type(exc).__name__}: {exc}"
            with self._lock:
                self._rejected[reason] += 1
            _send_error(sender, message)
            return
        call = Call(str(next(self._ids)), sender, rows[0].stream, not self.decoupled, self.batched,
                     _requested(request), pad_id=rows[0].pad_id)
        submits = []  # (req_id, prompt ids, params, priority, the row's first sequence: its prompt blocks' source)
        text = call.outputs is None or "text_output" in call.outputs  # else no detokenizing, per token or not
        for b, parsed in enumerate(rows):
            keep_input = not parsed.stream and not parsed.exclude_input_in_output
            # decode(prompt) + the deltas (decode(prompt + output) - decode(prompt)) == decode(prompt + output)
            prefix_text = self.loop.decode(parsed.prompt_ids) if keep_input and text else ""
            first = None
            for s in range(parsed.num_return_sequences):
                req_id = str(next(self._ids))
                first = first or req_id
                params = parsed.params if text else replace(parsed.params, detokenize=False)
                if s and params.seed is not None:  # sequence s: the same request alone with seed + s
                    params = replace(params, seed=params.seed + s)
                call.open.add(req_id)
                self._sequences[req_id] = Sequence(call, b, s, prefix_text, parsed.prompt_ids if keep_input else [],
                                                    arrival, parsed.returns, parsed.return_perf_metrics,
                                                    len(parsed.prompt_ids), stream_interval=parsed.stream_interval)
                submits.append((req_id, parsed.prompt_ids, params, parsed.priority, first if s else None))
        with self._lock:
            self._calls[call.key] = call
        for req_id, prompt_ids, params, priority, source in submits:
            self.loop.submit(req_id, prompt_ids, params, priority, arrival, source)

    def _parse(self, request) -> list[protocol.ParsedRequest]:
        """Every row of the request, parsed and validated (one bad row fails the whole request)."""
        if self._stopping is not None:
            raise ServerStopping(self._stopping)
        get = _inputs(request)
        sampling = _sampling_parameters(get, request)
        getters = trtllm_layout.split_rows(get) if self.batched else [get]
        rows = [protocol.parse_request(g, self.loop.encode, self.config.default_max_tokens, self.limits, sampling,
                                       self.loop.encode_word, self.batched, self.loop.encode_chat) for g in getters]
        for parsed in rows:
            if parsed.stream and not self.decoupled:
                raise RequestError("stream=true needs a decoupled model: this one answers each request once "
                                   "(use the decoupled model for streaming)")
            self.loop.validate(parsed.prompt_ids, parsed.params)
        self._check_queue(sum(r.num_return_sequences for r in rows))
        return rows

    def _open_senders(self) -> list[tuple[str, Callable[[], bool]]]:
        with self._lock:
            return [(key, partial(self._asks_cancelled, call)) for key, call in self._calls.items()]

    def _cancel_call(self, key: str) -> None:
        """Watcher thread: the client of this call has gone: cancel every sequence of it still running."""
        with self._lock:
            call = self._calls.get(key)
            open_ids = list(call.open) if call is not None else []
        for req_id in open_ids:
            self.loop.cancel(req_id)

    def _asks_cancelled(self, call: Call) -> bool:
        """Watcher thread. python_backend 2.51 frees a request's response factory once its FINAL is sent, and
        is_cancelled() on it afterwards crashes tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled):
        the responder closes a call under this lock before sending its FINAL, so no ask can overlap it."""
        with self._final_lock:
            return not call.closed and call.sender.is_cancelled()

    def _check_stop(self) -> None:
        """Watcher thread: once the supervisor asks (or is gone), end every stream and refuse new ones."""
        if self._stopping is None and self._stop_signal.is_set():
            self._stopping = "the server is shutting down: request ended early; retry on another instance"
            with self._lock:
                open_calls = len(self._calls)
            pb_utils.Logger.log_info(f"inflight: {self._name}: stop requested: ending every open stream "
                                     f"({open_calls} open)")
            self.loop.drain(self._stopping)
            if not open_calls:
                self._log_drained()

    def _log_drained(self) -> None:
        """Once per stop: every stream has had its FINAL, so no response factory of ours holds the model in
        Triton any more (one that still does not unload is held from outside, or stuck in finalize)."""
        with self._lock:
            first, self._drained_logged = not self._drained_logged, True
        if first:
            pb_utils.Logger.log_info(f"inflight: {self._name}: every stream ended")

    def _check_queue(self, adding: int) -> None:
        limit = self.config.max_queue_size
        if limit and self.loop.queue_depth() + adding > limit:
            raise QueueFull(f"queue full: {limit} requests are already waiting (max_queue_size); retry later")

    def _emit(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Responder thread: one response per streamed token; one per sequence for non-streamed requests; one
        per call for unary ones.

        When these outputs end the last open call, metrics are published before the responses go out, so a
        client that has its last final response sees every count in /metrics (tests rely on it)."""
        start = time.perf_counter()
        ready = []
        for out in outputs:
            seq = self._sequences.get(out.req_id)
            if seq is None:
                continue
            call, last = seq.call, False
            if out.finished:
                del self._sequences[out.req_id]
                call.open.discard(out.req_id)
                if not call.open:
                    last = True
                    with self._lock:
                        del self._calls[call.key]
                    with self._final_lock:
                        call.closed = True
            self._observe(seq, out)
            ready.append((seq, out, last))
        self._unpublished = stats
        if not self._calls:
            self._publish_metrics()
        for seq, out, last in ready:
            self._deliver(seq, out, last)
        if self._stopping is not None and not self._calls:
            self._log_drained()
        self._respond_seconds += time.perf_counter() - start
        if time.monotonic() - self._last_publish >= _METRICS_INTERVAL_S:
            self._publish_metrics()

    def _on_idle(self) -> None:
        """Responder thread, nothing to send: publish what changed (stats after a failure, rejections)."""
        if self._unpublished is not None or self._rejected or self._finished:
            self._publish_metrics()

    def _publish_metrics(self) -> None:
        with self._lock:
            rejected, self._rejected = self._rejected, Counter()
        if self._unpublished is not None:
            self.metrics.update(self._unpublished, self._respond_seconds)
        self.metrics.record_rejections(rejected)
        self.metrics.record_finished(self._finished)
        self._unpublished, self._respond_seconds, self._finished = None, 0.0, Counter()
        self._last_publish = time.monotonic()

    def _deliver(self, seq: Sequence, out: RequestOutput, last: bool) -> None:
        """`last`: this output ends the call's last open sequence, so its response carries FINAL."""
        call = seq.call
        if out.error is not None:
            if call.unary:
                call.error = call.error or out.error
                if last:
                    _send_error(call.sender, call.error)
            else:
                _send(call.sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error)),
                      _FINAL if last else 0)
            return
        if call.stream:
            sent = calls.held_back(seq, out) if seq.stream_interval > 1 else out
            if sent is None:
                return
            self._respond(call, [self._tensors(seq, sent, sent.text, sent.token_ids)], last)
            return
        calls.accumulate(seq, out)
        if not out.finished:
            return
        tensors = self._tensors(seq, out, seq.prefix_text + "".join(seq.texts), seq.prefix_ids + seq.ids,
                                accumulated=True)
        if not call.unary:
            self._respond(call, [tensors], last)
        else:
            call.parts.append((seq.batch_index, seq.sequence_index, tensors))
            if last:
                if call.error is not None:
                    _send_error(call.sender, call.error)
                else:
                    self._respond(call, [t for _, _, t in sorted(call.parts, key=lambda p: p[:2])], True)

    def _tensors(self, seq: Sequence, out: RequestOutput, text: str, ids: list[int], accumulated: bool = False):
        piece = calls.piece_of(seq, out, text, ids, accumulated)
        blocks = self.loop.blocks_for(out.num_input_tokens + out.num_output_tokens - 1) if out.finished else 0
        return responses.tensors(piece, seq.returns, seq.return_perf_metrics, seq.call.outputs,
                                 self._decode_token, blocks, out.num_shared_blocks)

    def _decode_token(self, token: int) -> str:
        return self.loop.decode([token])

    def _respond(self, call: Call, parts: list[dict], final: bool) -> None:
        tensors = responses.stack(parts, call.pad_id)
        if not call.batched:
            tensors = responses.unbatched(tensors)
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items()])
        _send(call.sender, response, _FINAL if final else 0)

    def _observe(self, seq: Sequence, out: RequestOutput) -> None:
        """Latency histograms, observed once or twice per sequence (each observation is an IPC round trip)."""
        if out.token_ids and not seq.first_token_seen:
            seq.first_token_seen = True
            self.metrics.observe_first_token(out.token_time - seq.arrival)
        if out.finish_reason is not None:  # out.finished, spelled so that the reason is a str below
            per_token, times = None, out.times  # the engine's own first/last token times and token count
            if (times is not None and times.first_token is not None and times.last_token is not None
                    and out.num_output_tokens > 1):
                per_token = (times.last_token - times.first_token) / (out.num_output_tokens - 1)
            self._finished[out.finish_reason] += 1
            self.metrics.observe_finished(time.monotonic() - seq.arrival, per_token)
            # benchmarks/robustness.py reads these lines
            if _TRACE_CANCELS and out.finish_reason == "cancelled" and times is not None:
                print(f"inflight-trace: cancelled: prompt {out.num_input_tokens} tokens, ended at {times.finished:.6f}",
                      file=sys.stderr, flush=True)


def _allow_ragged_batches(config, declared: set[str]) -> None:
    """Mark the inputs we declared `allow_ragged_batch`, so that Triton's dynamic batcher joins requests whose
    prompts differ in length (without it, only requests of equal shapes share an execute(); each request keeps
    its own tensors either way). python_backend 2.51's add_input takes four keys only; the stub sends this dict
    back to Triton as the completed config."""
    for entry in getattr(config, "_model_config", {}).get("input", []):
        if entry["name"] not in declared:
            entry["allow_ragged_batch"] = True


def _intake(model_config: dict) -> str:
    """How Triton hands requests to execute(), for the ready line: one at a time, or Triton's dynamic batcher
    (only with max_batch_size > 0: TensorRT-LLM's batched layout, whose configs carry it)."""
    batching = model_config.get("dynamic_batching")
    if batching is None:
        return "one request per execute"
    if model_config.get("max_batch_size", 0) <= 0:
        raise pb_utils.TritonModelException("inflight: dynamic_batching needs max_batch_size > 0 (TensorRT-LLM's "
                                            "batched layout); remove it, or set max_batch_size")
    delay = int(batching.get("max_queue_delay_microseconds", 0) or 0)
    return (f"dynamic batching: up to max_batch_size requests per execute, each held at most {delay} us"
            if delay else "dynamic batching: every request queued per execute, none held")


def _inputs(request) -> Callable[[str], np.ndarray | None]:
    """The request's inputs by name, as arrays (None: not sent). Indexed once: the parser asks for every name it
    knows or refuses, and each `request.inputs()` builds the whole list again."""
    tensors = {tensor.name(): tensor for tensor in request.inputs()}

    def get(name: str) -> np.ndarray | None:
        tensor = tensors.get(name)
        return None if tensor is None else tensor.as_numpy()
    return get


def _sampling_parameters(get, request) -> dict:
    """vLLM sampling parameters: the `sampling_parameters` input, else the request's parameters."""
    tensor = get("sampling_parameters")
    if tensor is not None and tensor.size != 1:
        raise RequestError(f"input 'sampling_parameters' must hold one JSON string, got shape {list(tensor.shape)}")
    raw = None if tensor is None else tensor.reshape(-1)[0]
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return vllm_protocol.sampling_parameters(text, request.parameters())


def _requested(request) -> frozenset[str] | None:
    names = request.requested_output_names()
    return frozenset(names) if names else None


def _send_error(sender, message: str) -> None:
    _send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), _FINAL)


def _send(sender, response, flags: int) -> None:
    try:
        sender.send(response, flags=flags)
    except Exception as exc:  # (not is_cancelled() here: after a FINAL the sender's factory may be gone)
        pb_utils.Logger.log_error(f"inflight: failed to send a response: {exc}")
