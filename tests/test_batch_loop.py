"""The engine thread and responder thread, driven in-process (no Triton)."""
import threading

from inflight_backend.batch_loop import BatchLoop
from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams


class Collector:
    def __init__(self, expected: int) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.steps_seen = 0
        self.all_final = threading.Event()
        self.expected = expected
        self.first_token = threading.Event()

    def emit(self, outputs, stats):
        self.steps_seen = stats.num_steps
        for out in outputs:
            self.tokens.setdefault(out.req_id, []).extend(out.token_ids)
            if out.token_ids:
                self.first_token.set()
            if out.finished:
                self.final[out.req_id] = out.finish_reason
                if out.error:
                    self.errors[out.req_id] = out.error
        if len(self.final) == self.expected:
            self.all_final.set()


def test_outputs_arrive_on_the_responder_and_blocks_are_returned(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64))
    sink = Collector(expected=3)
    loop = BatchLoop(engine, sink.emit)
    for i in range(3):
        loop.submit(str(i), [256, 65 + i], SamplingParams(max_tokens=5 + i, min_tokens=5 + i))
    assert sink.all_final.wait(60)
    loop.stop()
    assert {k: len(v) for k, v in sink.tokens.items()} == {"0": 5, "1": 6, "2": 7}
    assert set(sink.final.values()) == {"length"}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stop_ends_every_open_request_as_cancelled(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    sink = Collector(expected=4)
    loop = BatchLoop(engine, sink.emit)
    for i in range(4):
        loop.submit(str(i), [256, 70 + i], SamplingParams(max_tokens=2000, min_tokens=2000))
    assert sink.first_token.wait(60)
    loop.stop()
    assert sink.final == {str(i): "cancelled" for i in range(4)}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not any(t.name.startswith("inflight-") and t.is_alive() for t in threading.enumerate())


def test_a_duplicate_id_is_rejected_and_cancel_ends_the_original(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    sink = Collector(expected=1)
    loop = BatchLoop(engine, sink.emit)
    loop.submit("a", [256, 80], SamplingParams(max_tokens=2000, min_tokens=2000))
    loop.submit("a", [256, 81], SamplingParams(max_tokens=3))
    assert sink.all_final.wait(60)  # the duplicate's error
    assert sink.final == {"a": "error"} and "already running" in sink.errors["a"]
    sink.all_final.clear()
    sink.final.clear()
    loop.cancel("a")
    assert sink.all_final.wait(60)
    loop.stop()
    assert sink.final == {"a": "cancelled"}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stats_reflect_a_cancellation_between_steps(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64))
    engine.add_request("a", [256, 65, 66], SamplingParams(max_tokens=50, min_tokens=50))
    engine.step()
    assert engine.stats.kv_blocks_used > 0 and engine.stats.num_running == 1
    engine.abort("a")
    assert engine.stats.kv_blocks_used == 0 and engine.stats.num_running == 0


def test_drain_ends_every_open_request_with_its_message_and_refuses_new_ones(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    sink = Collector(expected=4)
    loop = BatchLoop(engine, sink.emit)
    for i in range(3):
        loop.submit(str(i), [256, 70 + i], SamplingParams(max_tokens=2000, min_tokens=2000))
    assert sink.first_token.wait(60)
    loop.drain("stopping now")
    loop.submit("late", [256, 90], SamplingParams(max_tokens=3))
    assert sink.all_final.wait(60)
    assert loop.stop()
    assert sink.final == {k: "error" for k in ("0", "1", "2", "late")}
    assert set(sink.errors.values()) == {"stopping now"}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stop_is_bounded_and_nothing_is_emitted_after_it(tiny_model):
    """A step that never returns (a hung model) cannot hold finalize() past Triton's exit timeout."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64))
    release, entered = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def hangs(sched, **kw):
        entered.set()
        release.wait(60)
        return execute(sched, **kw)

    engine.runner.execute = hangs
    sink = Collector(expected=1)
    loop = BatchLoop(engine, sink.emit)
    loop.submit("a", [256, 65], SamplingParams(max_tokens=5))
    assert entered.wait(60)
    assert loop.stop(timeout=0.2) is False  # the engine thread is still in its step
    emitted = len(sink.tokens)
    release.set()
    for thread in loop._threads:
        thread.join(60)
    assert len(sink.tokens) == emitted == 0  # the step's outputs and the cancellation were dropped, not sent
