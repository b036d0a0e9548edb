"""The responder (`responder.py`) and the open calls (`open_calls.py`) without Triton: a stand-in for
python_backend's utilities records what each sender was sent and what the metrics were told."""
from types import SimpleNamespace

import numpy as np
import pytest

from inflight_backend.calls import Call, Sequence
from inflight_backend.metrics import TritonMetrics
from inflight_backend.open_calls import OpenCalls
from inflight_backend.outputs import RequestOutput, RequestTimes
from inflight_backend.responder import Responder
from inflight_backend.stats import EngineStats

FINAL = 1


class Metric:
    def __init__(self, family, labels):
        self.family, self.labels, self.total, self.observed = family, labels, 0.0, []

    def increment(self, delta):
        self.total += delta

    def set(self, value):
        self.total = value

    def observe(self, value):
        self.observed.append(value)


class Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: list = []

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        metric = Metric(self.name, labels)
        Family.made.append(metric)
        return metric


class Response:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.error = error


class Sender:
    def __init__(self, cancelled=False, fail=False):
        self.sent, self.cancelled, self.fail, self.asked = [], cancelled, fail, 0

    def send(self, response, flags=0):
        if self.fail:
            raise RuntimeError("stream gone")
        self.sent.append((response, flags))

    def is_cancelled(self):
        self.asked += 1
        return self.cancelled

    def finals(self):
        return [flags for _, flags in self.sent if flags & FINAL]


def fake_pb_utils(logged):
    return SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL, MetricFamily=Family, InferenceResponse=Response,
        Tensor=lambda name, array: SimpleNamespace(name=name, array=array), TritonError=lambda message: message,
        Logger=SimpleNamespace(log_info=logged.append, log_error=logged.append, log_warn=logged.append))


def make(**call_kw):
    logged: list[str] = []
    Family.made = []
    open_calls = OpenCalls()
    pb_utils = fake_pb_utils(logged)
    responder = Responder(pb_utils, "m", TritonMetrics(pb_utils, "m"), open_calls,
                          lambda ids: "".join(f"<{i}>" for i in ids), lambda tokens: -(-tokens // 16))
    return responder, open_calls, logged


def open_call(open_calls, key, sender, num_sequences=1, stream=True, whole=False, stream_interval=1,
              prefix_text="", prefix_ids=()):
    call = Call(key, sender, stream, whole, False, None)
    sequences = {f"{key}.{s}": Sequence(call, 0, s, prefix_text, list(prefix_ids), 0.0, frozenset(), False, 3,
                                        stream_interval=stream_interval) for s in range(num_sequences)}
    open_calls.open(call, sequences)
    return call, list(sequences)


def token(req_id, tok, finish=None, count=1, error=None):
    times = RequestTimes(0.0, 0.1, 0.2, 0.2 + count) if finish else None
    return RequestOutput(req_id, [] if error else [tok], "" if error else f"<{tok}>", finish, 3, count,
                         error=error, token_time=0.2, times=times)


def text_of(response):
    return b"".join(response.tensors["text_output"].tolist()).decode()


def test_a_stream_gets_each_token_and_one_final():
    responder, open_calls, _ = make()
    sender = Sender()
    _, (rid,) = open_call(open_calls, "a", sender)
    for step, tok in enumerate([5, 6, 7]):
        responder.emit([token(rid, tok, "length" if step == 2 else None, count=step + 1)], EngineStats())
    assert [response.tensors["output_ids"].tolist() for response, _ in sender.sent] == [[5], [6], [7]]
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL]
    assert "".join(text_of(r) for r, _ in sender.sent) == "<5><6><7>"
    assert len(open_calls) == 0 and open_calls.sequence(rid) is None


def test_several_sequences_of_one_call_end_with_one_final():
    """num_return_sequences 2: FINAL rides on whichever sequence ends last; a late output of a closed sequence
    is dropped."""
    responder, open_calls, _ = make()
    sender = Sender()
    _, (r0, r1) = open_call(open_calls, "c", sender, num_sequences=2)
    responder.emit([token(r0, 1), token(r1, 2)], EngineStats())
    responder.emit([token(r0, 3, "stop", count=2)], EngineStats())
    assert len(open_calls) == 1 and sender.finals() == []
    responder.emit([token(r1, 4, "length", count=2), token(r0, 9)], EngineStats())
    assert [flags for _, flags in sender.sent] == [0, 0, 0, FINAL]
    assert sender.finals() == [FINAL] and len(open_calls) == 0


def test_stream_interval_holds_tokens_until_n_or_the_end():
    responder, open_calls, _ = make()
    sender = Sender()
    _, (rid,) = open_call(open_calls, "s", sender, stream_interval=3)
    for step, tok in enumerate(range(10, 17)):
        responder.emit([token(rid, tok, "length" if step == 6 else None, count=step + 1)], EngineStats())
    ids = [response.tensors["output_ids"].tolist() for response, _ in sender.sent]
    assert ids == [[10, 11, 12], [13, 14, 15], [16]]
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL]


def test_a_non_streamed_sequence_answers_once_with_its_prefix():
    responder, open_calls, _ = make()
    sender = Sender()
    _, (rid,) = open_call(open_calls, "n", sender, stream=False, prefix_text="<1><2>", prefix_ids=(1, 2))
    responder.emit([token(rid, 3)], EngineStats())
    assert sender.sent == []
    responder.emit([token(rid, 4, "length", count=2)], EngineStats())
    (response, flags), = sender.sent
    assert flags == FINAL and response.tensors["output_ids"].tolist() == [1, 2, 3, 4]
    assert text_of(response) == "<1><2><3><4>"


@pytest.mark.parametrize("whole", [True, False])
def test_non_streamed_sequences_answer_in_one_response_when_whole_else_each_alone(whole):
    """Two sequences, not streamed, ending in reverse order. A whole call (unary, or the unbatched layout's): one
    response stacking them by sequence index, not by arrival. TensorRT-LLM's decoupled batched layout: a response
    per sequence as each ends. FINAL on the last either way."""
    responder, open_calls, _ = make()
    sender = Sender()
    _, (r0, r1) = open_call(open_calls, "u", sender, num_sequences=2, stream=False, whole=whole)
    responder.emit([token(r1, 8, "length")], EngineStats())
    responder.emit([token(r0, 7, "stop")], EngineStats())
    assert all(isinstance(r.tensors["output_ids"], np.ndarray) for r, _ in sender.sent)
    sent = [(r.tensors["output_ids"].tolist(), flags) for r, flags in sender.sent]
    assert sent == ([([[7], [8]], FINAL)] if whole else [([8], 0), ([7], FINAL)])


def test_an_error_ends_its_call_alone():
    responder, open_calls, _ = make()
    bad, good = Sender(), Sender()
    _, (rb,) = open_call(open_calls, "bad", bad)
    _, (rg,) = open_call(open_calls, "good", good)
    responder.emit([token(rb, 0, "error", error="engine step failed: boom"), token(rg, 5)], EngineStats())
    (response, flags), = bad.sent
    assert flags == FINAL and response.error == "engine step failed: boom"
    assert [flags for _, flags in good.sent] == [0] and len(open_calls) == 1


def test_a_whole_call_with_a_failed_sequence_gets_one_error():
    responder, open_calls, _ = make()
    sender = Sender()
    _, (r0, r1) = open_call(open_calls, "u", sender, num_sequences=2, stream=False, whole=True)
    responder.emit([token(r0, 0, "error", error="cancelled: gone")], EngineStats())
    assert sender.sent == []
    responder.emit([token(r1, 8, "length")], EngineStats())
    (response, flags), = sender.sent
    assert flags == FINAL and response.error == "cancelled: gone"


def test_a_failing_send_is_logged_and_the_others_go_on():
    responder, open_calls, logged = make()
    gone, live = Sender(fail=True), Sender()
    _, (rg,) = open_call(open_calls, "gone", gone)
    _, (rl,) = open_call(open_calls, "live", live)
    responder.emit([token(rg, 1, "length"), token(rl, 2, "length")], EngineStats())
    assert live.finals() == [FINAL] and len(open_calls) == 0
    assert any("failed to send a response: stream gone" in line for line in logged)


def test_closed_calls_are_never_asked_whether_cancelled():
    """The watcher's senders: a call closed before its FINAL answers False without touching its sender (the
    sender's factory is freed once FINAL goes)."""
    responder, open_calls, _ = make()
    sender = Sender(cancelled=True)
    call, (rid,) = open_call(open_calls, "w", sender)
    (key, asks), = open_calls.senders()
    assert key == "w" and asks() and open_calls.open_ids("w") == [rid]
    responder.emit([token(rid, 1, "length")], EngineStats())
    assert call.closed and not asks() and sender.asked == 1
    assert open_calls.senders() == [] and open_calls.open_ids("w") == []


def test_rejections_and_finish_reasons_reach_the_metrics():
    responder, open_calls, _ = make()
    refused = Sender()
    responder.reject(refused, "queue_full", "queue full: retry later")
    (response, flags), = refused.sent
    assert flags == FINAL and response.error == "queue full: retry later"
    _, (rid,) = open_call(open_calls, "f", Sender())
    responder.emit([token(rid, 1), ], EngineStats())
    responder.emit([token(rid, 2, "stop", count=2)], EngineStats(num_steps=2))  # the last call: published at once
    by_label = {(m.family, tuple(sorted(m.labels.items()))): m for m in Family.made}
    rejected = by_label[("inflight_requests_rejected_total", (("model", "m"), ("reason", "queue_full")))]
    finished = by_label[("inflight_requests_finished_total", (("model", "m"), ("reason", "stop")))]
    assert rejected.total == 1 and finished.total == 1
    ttft = by_label[("inflight_time_to_first_token_seconds", (("model", "m"),))]
    assert ttft.observed == [0.2]  # token_time - arrival, once per sequence


def test_a_stop_is_logged_once_when_the_last_stream_ends():
    responder, open_calls, logged = make()
    _, (rid,) = open_call(open_calls, "x", Sender())
    responder.note_stopping()
    assert not any("every stream ended" in line for line in logged)
    responder.emit([token(rid, 0, "error", error="the server is shutting down")], EngineStats())
    responder.note_stopping()
    assert sum("every stream ended" in line for line in logged) == 1
