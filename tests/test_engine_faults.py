"""One request's failure ends that request alone: the others keep their exact (transformers) tokens and every
KV block comes back. Faults are injected in-process: a model that produces NaN logits for one request, a
model step that raises, an output that cannot be processed."""
import math

import pytest

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams
from tests.conftest import Oracle

CASES = 6


@pytest.fixture(scope="module")
def expected(tiny_model, oracle_cases):
    oracle = Oracle(tiny_model)
    return [oracle.generate(ids, n) for ids, n in oracle_cases[:CASES]]


def engine_for(tiny_model):
    return InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, max_batch_size=8))


def run_all(engine, cases, extra=None):
    """Submit every case (and `extra`: req_id -> (prompt ids, params)) at once; run to the end."""
    for i, (ids, n) in enumerate(cases):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=n))
    for req_id, (ids, params) in (extra or {}).items():
        engine.add_request(req_id, ids, params)
    tokens, finals = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.token_ids)
            if out.finished:
                assert out.req_id not in finals, "a second final output"
                finals[out.req_id] = out
        engine.blocks.check_integrity()
    return tokens, finals


def poison_row(engine, victim: str, value: float, after_tokens: int = 2):
    """Make the model's logits for `victim` non-finite once it has `after_tokens` tokens."""
    execute = engine.runner.execute

    def poisoned(sched, **kw):  # (greedy_only dropped: the poison goes into the fp32 head's logits)
        logits = execute(sched).clone()  # an inference tensor cannot be written outside inference mode
        sampled = [item.request for item in sched.scheduled if item.sample]
        for row, request in enumerate(sampled):
            if request.req_id == victim and len(request.output_ids) >= after_tokens:
                logits[row, 5] = value
        return logits

    engine.runner.execute = poisoned


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_end_that_request_alone(tiny_model, oracle_cases, expected, value, temperature):
    engine = engine_for(tiny_model)
    poison_row(engine, "victim", value)
    params = SamplingParams(max_tokens=30, min_tokens=30, temperature=temperature, seed=1)
    tokens, finals = run_all(engine, oracle_cases[:CASES], {"victim": ([256, 70, 71], params)})
    assert [tokens.get(str(i), []) for i in range(CASES)] == expected
    assert finals["victim"].finish_reason == "error" and "non-finite logits" in finals["victim"].error
    assert len(tokens["victim"]) == 2 and finals["victim"].num_output_tokens == 2  # the failed row sent nothing
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and engine.stats.num_running == 0


def test_a_failed_model_step_ends_its_requests_and_the_waiting_ones_go_on(tiny_model, oracle_cases, expected):
    engine = engine_for(tiny_model)
    execute, calls = engine.runner.execute, []

    def fails_once(sched, **kw):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("injected")
        return execute(sched, **kw)

    engine.runner.execute = fails_once
    for i in range(2):
        engine.add_request(f"early{i}", [256, 80 + i], SamplingParams(max_tokens=20, min_tokens=20))
    for _ in range(2):
        engine.step()
    outputs = engine.step()
    assert {o.req_id for o in outputs} == {"early0", "early1"}
    assert all(o.finish_reason == "error" and "engine step failed: RuntimeError: injected" in o.error for o in outputs)
    assert engine.stats.kv_blocks_used == 0 and engine.stats.num_running == 0  # gauges fresh after the failure
    tokens, finals = run_all(engine, oracle_cases[:CASES])
    assert [tokens.get(str(i), []) for i in range(CASES)] == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_output_that_cannot_be_processed_ends_that_request_alone(tiny_model, oracle_cases, expected):
    engine = engine_for(tiny_model)
    engine.add_request("victim", [256, 90], SamplingParams(max_tokens=10, min_tokens=10))

    def broken(token):
        raise UnicodeError("injected")

    engine._texts["victim"].detok.add = broken
    tokens, finals = run_all(engine, oracle_cases[:CASES])
    assert [tokens.get(str(i), []) for i in range(CASES)] == expected
    assert finals["victim"].finish_reason == "error" and "UnicodeError: injected" in finals["victim"].error
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
