"""The responder thread's side of the Triton entry: engine outputs become responses, and metrics are published.

One response per streamed token (or per merged run of them: the batch loop's outbox and `stream_interval`).
Not streamed: one response holding every sequence (`Call.whole`: unary calls, and the unbatched layout's), or in
TensorRT-LLM's decoupled batched layout one per sequence, as TensorRT-LLM sends them. Each call's last response
carries FINAL, exactly once. `pb_utils` (triton_python_backend_utils) is passed in because it exists only inside Triton.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

from . import calls, responses
from .calls import Call, Sequence
from .outputs import RequestOutput
from .metrics import TritonMetrics
from .open_calls import OpenCalls
from .stats import EngineStats

_TRACE_CANCELS = os.environ.get("INFLIGHT_TRACE_CANCELS") == "1"  # one stderr line per cancelled request
_METRICS_INTERVAL_S = 0.2  # each metric update is an IPC round trip: publish stats at most this often


class Responder:
    """`emit` and `on_idle` run on the batch loop's responder thread; `reject` on Triton's, `note_stopping` on
    the cancel watcher's. `decode(ids)` is the tokenizer's; `blocks_for(tokens)` the KV blocks that many take."""

    def __init__(self, pb_utils, name: str, metrics: TritonMetrics, open_calls: OpenCalls,
                 decode: Callable[[list[int]], str], blocks_for: Callable[[int], int]) -> None:
        self._pb = pb_utils
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._name = name
        self._calls = open_calls
        self._decode = decode
        self._blocks_for = blocks_for
        self.metrics = metrics
        self._lock = threading.Lock()  # guards _rejected and _drained_logged
        self._rejected: Counter[str] = Counter()  # by reason, since the last publish (Triton's thread adds)
        # Requests ended since the last publish, by finish reason: counted with the stats they came with, one
        # IPC per reason a publish rather than one per request
        self._finished: Counter[str] = Counter()
        self._last_publish = 0.0
        self._unpublished: EngineStats | None = None
        self._respond_seconds = 0.0
        self._stopping = False
        self._drained_logged = False

    def emit(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """One step's outputs (or several merged). When they end the last open call, metrics are published
        before the responses go out, so a client that has its last final response sees every count in /metrics
        (tests rely on it)."""
        start = time.perf_counter()
        ready = []
        sequence = self._calls.sequence
        for out in outputs:
            seq = sequence(out.req_id)
            if seq is None:
                continue
            last = out.finished and self._calls.finish(out.req_id, seq)
            self._observe(seq, out)
            ready.append((seq, out, last))
        self._unpublished = stats
        if not self._calls:
            self._publish_metrics()
        for seq, out, last in ready:
            self._deliver(seq, out, last)
        if self._stopping and not self._calls:
            self._log_drained()
        self._respond_seconds += time.perf_counter() - start
        if time.monotonic() - self._last_publish >= _METRICS_INTERVAL_S:
            self._publish_metrics()

    def on_idle(self) -> None:
        """Nothing to send: publish what changed (stats after a failure, rejections)."""
        if self._unpublished is not None or self._rejected or self._finished:
            self._publish_metrics()

    def reject(self, sender, reason: str, message: str) -> None:
        """Triton's thread: a request refused before it reached the engine gets `message` with FINAL, and counts
        under `reason` in the rejection metric."""
        with self._lock:
            self._rejected[reason] += 1
        self._send_error(sender, message, final=True)

    def note_stopping(self) -> None:
        """Watcher: the server is stopping (every stream is being ended); log once when none is left open."""
        self._stopping = True
        if not self._calls:
            self._log_drained()

    def _send_error(self, sender, message: str, final: bool) -> None:
        self._send(sender, self._pb.InferenceResponse(error=self._pb.TritonError(message)), self._final if final else 0)

    def _log_drained(self) -> None:
        """Once per stop: every stream has had its FINAL, so no response factory of ours holds the model in
        Triton any more (one that still does not unload is held from outside, or stuck in finalize)."""
        with self._lock:
            first, self._drained_logged = not self._drained_logged, True
        if first:
            self._pb.Logger.log_info(f"inflight: {self._name}: every stream ended")

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
            if call.whole:
                call.error = call.error or out.error
                if last:
                    self._send_error(call.sender, call.error, final=True)
            else:
                self._send_error(call.sender, out.error, final=last)
            return
        if call.stream:
            sent = calls.held_back(seq, out) if seq.stream_interval > 1 else out
            if sent is not None:
                self._respond(call, [self._tensors(seq, sent, sent.text, sent.token_ids)], last)
            return
        calls.accumulate(seq, out)
        if not out.finished:
            return
        tensors = self._tensors(seq, out, seq.prefix_text + "".join(seq.texts), seq.prefix_ids + seq.ids,
                                accumulated=True)
        if not call.whole:
            self._respond(call, [tensors], last)
            return
        call.parts.append((seq.batch_index, seq.sequence_index, tensors))
        if last:
            if call.error is not None:
                self._send_error(call.sender, call.error, final=True)
            else:
                self._respond(call, [t for _, _, t in sorted(call.parts, key=lambda p: p[:2])], True)

    def _tensors(self, seq: Sequence, out: RequestOutput, text: str, ids: list[int], accumulated: bool = False):
        piece = calls.piece_of(seq, out, text, ids, accumulated)
        blocks = self._blocks_for(out.num_input_tokens + out.num_output_tokens - 1) if out.finished else 0
        return responses.tensors(piece, seq.returns, seq.return_perf_metrics, seq.call.outputs,
                                 self._decode_token, blocks, out.num_shared_blocks)

    def _decode_token(self, token: int) -> str:
        return self._decode([token])

    def _respond(self, call: Call, parts: list[dict], final: bool) -> None:
        tensors = responses.stack(parts, call.pad_id)
        if not call.batched:
            tensors = responses.unbatched(tensors)
        pb = self._pb
        response = pb.InferenceResponse(output_tensors=[pb.Tensor(n, a) for n, a in tensors.items()])
        self._send(call.sender, response, self._final if final else 0)

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

    def _send(self, sender, response, flags: int) -> None:
        try:
            sender.send(response, flags=flags)
        except Exception as exc:  # (not is_cancelled() here: after a FINAL the sender's factory may be gone)
            self._pb.Logger.log_error(f"inflight: failed to send a response: {exc}")
