"""Prefix caching against transformers: requests that share system prompts, and multi-turn chats that resend
their history, give transformers' greedy tokens with reuse on, for every batching policy, block sizes 1/16/32,
chunked prefill, forced preemption and prefixes that end mid-block; the cache really serves their prefixes; the
real server does the same and shows it in /metrics."""
import random

import pytest

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams
from tests.conftest import Oracle
from tests.triton_helpers import grpc_generate, metric

EOS = 257


@pytest.fixture(scope="module")
def oracle(tiny_model):
    return Oracle(tiny_model)


def workload(seed=0, systems=2, system_len=70, users=8):
    """(prompt ids, max new tokens): users of a few system prompts, some of them asking twice with their first
    answer in the history (the second turn arrives after the first ended)."""
    rng = random.Random(seed)
    system = [[256] + [rng.randrange(32, 127) for _ in range(system_len + 7 * s)] for s in range(systems)]
    turns = []
    for u in range(users):
        question = [rng.randrange(32, 127) for _ in range(rng.randrange(1, 30))]
        turns.append((system[u % systems] + question, rng.randrange(4, 12)))
    return turns


def run(engine, requests, oracle=None, second_turns=()):
    """Requests join two steps apart; `second_turns` (indices) come back with prompt + answer + a follow-up once
    their first turn has ended. Returns {key: tokens}."""
    got, pending, step, added = {}, list(enumerate(requests)), 0, {}
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, (ids, n) = pending.pop(0)
            engine.add_request(str(i), ids, SamplingParams(max_tokens=n))
            added[str(i)] = (ids, n)
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.token_ids)
            if out.finished and out.req_id.isdigit() and int(out.req_id) in second_turns:
                ids, n = added[out.req_id]
                follow_up = ids + got[out.req_id] + [10, 63, 10]
                key = out.req_id + "b"
                added[key] = (follow_up, 6)
                engine.add_request(key, follow_up, SamplingParams(max_tokens=6))
        step += 1
    return got, added


@pytest.mark.parametrize("block_size, policy, capacity, chunked, blocks", [
    (16, "fused", "guaranteed_no_evict", False, 256),
    (1, "fused", "max_utilization", True, 600),
    (32, "prefill_first", "guaranteed_no_evict", True, 64),
    (16, "static", "guaranteed_no_evict", False, 256),
    (16, "fused", "max_utilization", False, 24),  # small pool: preemption and eviction
])
def test_reuse_gives_transformers_tokens(tiny_model, oracle, block_size, policy, capacity, chunked, blocks):
    config = EngineConfig(checkpoint=tiny_model, block_size=block_size, num_kv_blocks=blocks, max_batch_size=6,
                          batching_policy=policy, capacity_policy=capacity, enable_chunked_prefill=chunked,
                          max_chunk_tokens=48 if chunked else 0, max_num_tokens=512)
    engine = InflightEngine(config)
    requests = workload()
    got, added = run(engine, requests, second_turns={0, 3, 5})
    for key, (ids, n) in added.items():
        assert got[key] == oracle.generate(ids, n), f"request {key}"
    stats = engine.stats
    assert stats.num_cached_tokens >= 3 * 70 // block_size * block_size  # second users and second turns hit
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_integrity()
    if blocks == 24:
        assert stats.num_evicted_blocks > 0


def test_reuse_off_computes_every_prompt(tiny_model, oracle):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, enable_kv_cache_reuse=False))
    got, added = run(engine, workload(users=4))
    assert all(got[k] == oracle.generate(ids, n) for k, (ids, n) in added.items())
    assert engine.stats.num_cached_tokens == 0 and engine.blocks.num_cached_blocks == 0


@pytest.mark.server
def test_reuse_through_the_server_and_its_metrics(server, oracle):
    """Two requests with the same long prompt, one after the other: the second is served from the cache
    (inflight_prefix_cache_tokens_total grows by its full blocks), both equal transformers'."""
    url = f"127.0.0.1:{server.grpc_port}"
    ids = workload(seed=5, systems=1, system_len=100, users=1)[0][0]
    want = oracle.generate(ids, 8)
    before = metric(server.metrics_port, "inflight_prefix_cache_tokens_total", "llm")
    cached = []
    for _ in range(2):
        out = grpc_generate(url, "llm", {"input_ids": ids, "max_tokens": 8, "stream": True},
                            outputs=["output_ids", "num_cached_tokens"])
        assert out.error is None and out.ids == want
        cached.append(out.num_cached_tokens)
    after = metric(server.metrics_port, "inflight_prefix_cache_tokens_total", "llm")
    assert cached == [0, (len(ids) - 1) // 16 * 16] and after - before == cached[1]
