"""Triton entry point: the `inflight` Python-based backend (decoupled).

Thin by design: `execute()` parses each request (a call: B rows in TensorRT-LLM's batched layout, each with
num_return_sequences sequences), registers it (`open_calls.py`) and hands every sequence to the batch loop; the
loop's responder thread turns engine outputs into responses (`responder.py`). Decoupled
models stream; a non-decoupled one (unary calls) answers each call once, when all its sequences are done (as
does a decoupled one in the unbatched layout when the call does not stream), and its execute() still returns at
once, so concurrent unary calls share iterations. No scheduling here.
"""
from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np

import triton_python_backend_utils as pb_utils

from inflight_backend import declared_io, gc_tuning, openmp_pool, protocol, trtllm_layout, vllm_protocol
from inflight_backend.batch_loop import BatchLoop
from inflight_backend.block_manager import blocks_for
from inflight_backend.calls import Call, Sequence
from inflight_backend.cancel_watcher import CancelWatcher
from inflight_backend.config import EngineConfig, instance_count
from inflight_backend.engine import InflightEngine
from inflight_backend.metrics import TritonMetrics
from inflight_backend.open_calls import OpenCalls
from inflight_backend.request import QueueFull, RequestError, ServerStopping
from inflight_backend.responder import Responder
from inflight_backend.stop_signal import StopSignal


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
        metrics = TritonMetrics(pb_utils, self._name)
        self._open = OpenCalls()
        self._ids = itertools.count()
        self._stop_signal = StopSignal.from_environment()
        self._stopping: str | None = None  # once set: the message every open and new request ends with
        engine = InflightEngine(self.config)
        gc_tuning.for_serving()  # what exists now lives as long as the stub
        self.responder = Responder(pb_utils, self._name, metrics, self._open, engine.tokenizer.decode,
                                   partial(blocks_for, block_size=self.config.block_size))
        threads = self.config.cpu_threads or openmp_pool.share(instance_count(model_config))
        self.loop = BatchLoop(engine, self.responder.emit, on_idle=self.responder.on_idle, threads=threads)
        self.limits = self.loop.prompt_limits()
        self._watcher = CancelWatcher(self._open.senders, self._cancel_call, self._check_stop,
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
            self.responder.reject(sender, reason, message)
            return
        stream = rows[0].stream
        whole = not self.decoupled or (not stream and not self.batched)  # one response for the whole call
        call = Call(str(next(self._ids)), sender, stream, whole, self.batched, _requested(request),
                    pad_id=rows[0].pad_id)
        sequences: dict[str, Sequence] = {}
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
                sequences[req_id] = Sequence(call, b, s, prefix_text, parsed.prompt_ids if keep_input else [],
                                             arrival, parsed.returns, parsed.return_perf_metrics,
                                             len(parsed.prompt_ids), stream_interval=parsed.stream_interval)
                submits.append((req_id, parsed.prompt_ids, params, parsed.priority, first if s else None))
        self._open.open(call, sequences)
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

    def _check_queue(self, adding: int) -> None:
        limit = self.config.max_queue_size
        if limit and self.loop.queue_depth() + adding > limit:
            raise QueueFull(f"queue full: {limit} requests are already waiting (max_queue_size); retry later")

    def _cancel_call(self, key: str) -> None:
        """Watcher thread: the client of this call has gone: cancel every sequence of it still running."""
        for req_id in self._open.open_ids(key):
            self.loop.cancel(req_id)

    def _check_stop(self) -> None:
        """Watcher thread: once the supervisor asks (or is gone), end every stream and refuse new ones."""
        if self._stopping is None and self._stop_signal.is_set():
            self._stopping = "the server is shutting down: request ended early; retry on another instance"
            pb_utils.Logger.log_info(f"inflight: {self._name}: stop requested: ending every open stream "
                                     f"({len(self._open)} open)")
            self.loop.drain(self._stopping)
            self.responder.note_stopping()


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
