"""In-process engine vs transformers, token for token, alone and with staggered arrivals sharing steps."""
import pytest
import torch

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import RequestError
from inflight_backend.request import SamplingParams
from tests.conftest import Oracle


@pytest.fixture(scope="module", params=["tiny_model", "gqa_model"])
def setup(request, oracle_cases):
    path = request.getfixturevalue(request.param)
    oracle = Oracle(path)
    expected = [oracle.generate(ids, n) for ids, n in oracle_cases]
    return path, expected


def run(engine, cases, arrive_at_step):
    results = {str(i): [] for i in range(len(cases))}
    order = sorted(range(len(cases)), key=lambda i: arrive_at_step[i])
    step = 0
    while order or engine.has_unfinished():
        while order and arrive_at_step[order[0]] <= step:
            i = order.pop(0)
            engine.add_request(str(i), cases[i][0], SamplingParams(max_tokens=cases[i][1]))
        for out in engine.step():
            results[out.req_id] += out.token_ids
        engine.blocks.check_integrity()
        step += 1
    return [results[str(i)] for i in range(len(cases))], step


@pytest.mark.parametrize("block_size, attention", [(16, "native"), (3, "native"), (64, "native"), (16, "torch"),
                                                 (1, "torch")])
def test_greedy_tokens_match_transformers_with_staggered_arrivals(setup, oracle_cases, block_size, attention):
    path, expected = setup
    engine = InflightEngine(EngineConfig(checkpoint=path, block_size=block_size, num_kv_blocks=2048 // block_size * 8,
                                         max_batch_size=8, max_num_tokens=512, attention_backend=attention))
    assert engine.runner.attention.name == attention
    got, steps = run(engine, oracle_cases, arrive_at_step=[3 * i for i in range(len(oracle_cases))])
    assert got == expected
    assert steps < sum(len(e) for e in expected)  # steps were shared
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_reused_activation_buffers_change_no_token(setup, oracle_cases, monkeypatch):
    """Every GEMM output from the shared pool (models/activation_pool.py), not only a prefill step's largest."""
    from inflight_backend.models import activation_pool
    monkeypatch.setattr(activation_pool, "REUSE_BYTES", 0)
    path, expected = setup
    engine = InflightEngine(EngineConfig(checkpoint=path, num_kv_blocks=256, max_batch_size=8, max_num_tokens=512,
                                         greedy_screen="off"))  # (the LM head is the stack's one pooled GEMM)
    layer = engine.runner.model.model.layers[0].mlp.down_proj
    if not hasattr(layer, "_pool"):
        pytest.skip("the native skinny GEMM is not built for this processor: no PackedLinear, no pool")
    storages, take = [], layer._pool.take
    layer._pool.take = lambda rows, cols: storages.append((out := take(rows, cols)).untyped_storage().data_ptr()) \
        or out
    got, _ = run(engine, oracle_cases, arrive_at_step=[2 * i for i in range(len(oracle_cases))])
    assert got == expected
    assert len(storages) > 10 * len(set(storages))  # each buffer served many layers (new ones: larger steps)


def test_chunked_prefill_under_a_chunk_cap_matches_transformers(setup, oracle_cases):
    path, expected = setup
    engine = InflightEngine(EngineConfig(checkpoint=path, num_kv_blocks=256, max_batch_size=8, max_num_tokens=40,
                                         enable_chunked_prefill=True, max_chunk_tokens=13))
    chunks, execute = [], engine.runner.execute
    engine.runner.execute = lambda out, **kw: chunks.extend(i.num_tokens for i in out.scheduled if not i.is_decode) \
        or execute(out, **kw)
    got, _ = run(engine, oracle_cases, arrive_at_step=[2 * i for i in range(len(oracle_cases))])
    assert got == expected
    assert max(chunks) == 13 and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_step_time_target_sizes_chunks_and_matches_transformers(setup, oracle_cases):
    """A target below any step's time: once the fit has a few steps, each step takes the running sequences'
    decodes and one block of prompt, so long prompts go in many chunks (how many depends on the timings)."""
    path, expected = setup
    engine = InflightEngine(EngineConfig(checkpoint=path, num_kv_blocks=256, block_size=16, max_batch_size=8,
                                         max_num_tokens=512, enable_chunked_prefill=True, step_time_target_ms=0.001))
    budgets, execute = [], engine.runner.execute
    engine.runner.execute = lambda out, **kw: budgets.append((engine.scheduler.token_budget, out.num_tokens)) or \
        execute(out, **kw)
    got, _ = run(engine, oracle_cases, arrive_at_step=[2 * i for i in range(len(oracle_cases))])
    assert got == expected
    learnt = [(budget, tokens) for budget, tokens in budgets if budget < 512]
    assert len(learnt) > len(budgets) // 2 and all(tokens <= budget <= 8 + 16 for budget, tokens in learnt)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_one_at_a_time_matches_transformers(setup, oracle_cases):
    path, expected = setup
    engine = InflightEngine(EngineConfig(checkpoint=path, num_kv_blocks=64))
    for i, case in enumerate(oracle_cases):
        got, _ = run(engine, [case], arrive_at_step=[0])
        assert got[0] == expected[i], f"case {i}"


def test_requests_that_can_never_fit_are_rejected(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=4, block_size=4, max_batch_size=2,
                                         max_num_tokens=8))
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("a", [1] * 8, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="max_num_tokens"):
        engine.validate([1] * 9, SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="context"):
        engine.validate([1] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.validate([1, 258], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="max_tokens"):
        engine.validate([1], SamplingParams(max_tokens=0))


def test_min_tokens_masks_the_end_id_as_transformers_does(tiny_model, oracle_cases):
    """Requests that would end at EOS early: with min_tokens they go on past it, token for token as
    transformers' generate(min_new_tokens=...), and may end at EOS once the minimum is reached."""
    oracle = Oracle(tiny_model)
    stopping = [(ids, n) for ids, n in oracle_cases if (out := oracle.generate(ids, n)) and out[-1] == 257]
    assert stopping, "no oracle case ends at EOS"
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, max_batch_size=8))
    cases, params = [], []
    for ids, n in stopping:
        stop_at = len(oracle.generate(ids, n))
        cases.append((ids, stop_at + 40))
        params.append(SamplingParams(max_tokens=stop_at + 40, min_tokens=stop_at + 5))
    for i, ((ids, _), p) in enumerate(zip(cases, params)):
        engine.add_request(str(i), ids, p)
    got = {str(i): [] for i in range(len(cases))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id] += out.token_ids
    for i, ((ids, n), p) in enumerate(zip(cases, params)):
        want = oracle.generate(ids, n, min_new_tokens=p.min_tokens)
        assert got[str(i)] == want and len(want) >= p.min_tokens
        assert 257 not in want[:p.min_tokens]


def run_alone(engine, ids, params):
    engine.add_request("x", ids, params)
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.token_ids
    return got


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_transformers(tiny_model, oracle_cases, penalty):
    oracle = Oracle(tiny_model)
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    for ids, n in oracle_cases[:8]:
        want = oracle.generate(ids, n, repetition_penalty=penalty)
        assert run_alone(engine, ids, SamplingParams(max_tokens=n, repetition_penalty=penalty)) == want


@torch.inference_mode()
def presence_frequency_reference(model, ids, n, presence, frequency):
    """Greedy with vLLM's presence/frequency penalties, written out: each step's logits minus presence for every
    token generated so far and frequency per time it was generated."""
    out = []
    for _ in range(n):
        logits = model(torch.tensor([ids + out])).logits[0, -1].double()
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        out.append(int(logits.argmax()))
        if out[-1] == model.config.eos_token_id:
            break
    return out


@pytest.mark.parametrize("presence, frequency", [(0.8, 0.0), (0.0, 0.5), (0.6, 0.3), (-0.5, 0.0)])
def test_presence_and_frequency_penalties_match_a_reference(tiny_model, oracle_cases, presence, frequency):
    oracle = Oracle(tiny_model)
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    for ids, n in oracle_cases[:6]:
        n = min(n, 24)
        want = presence_frequency_reference(oracle.model, ids, n, presence, frequency)
        params = SamplingParams(max_tokens=n, presence_penalty=presence, frequency_penalty=frequency)
        assert run_alone(engine, ids, params) == want
