"""Scheduler behaviour with a fake runner (no model): admission, budgets, sharing of steps, block accounting."""
import random

import pytest

from inflight_backend.block_manager import BlockManager
from inflight_backend.request import Request, RequestStatus, SamplingParams
from inflight_backend.scheduler import Scheduler, SchedulerConfig


def make(max_batch_size=4, max_num_tokens=64, num_blocks=64, block_size=4, chunked=False, max_chunk_tokens=0):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_batch_size, max_num_tokens, chunked, max_chunk_tokens=max_chunk_tokens),
                     bm), bm


def request(i, prompt_len, max_tokens):
    return Request(str(i), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, rng=None):
    """Schedule, fake-sample token 7 for every sampling request, finish those at max_tokens."""
    out = sched.schedule()
    sampled = [7] * sum(item.sample for item in out.scheduled)
    for req in sched.update(out, sampled):
        if len(req.output_ids) >= req.params.max_tokens:
            sched.finish(req, RequestStatus.FINISHED_LENGTH)
    return out


def test_decode_and_prefill_share_a_step():
    sched, _ = make()
    sched.add(request(0, 5, 10))
    first = run_step(sched)
    assert first.num_prefill_tokens == 5 and first.num_decode_tokens == 0
    sched.add(request(1, 3, 10))
    second = run_step(sched)
    assert second.num_decode_tokens == 1 and second.num_prefill_tokens == 3
    assert all(item.sample for item in second.scheduled)


def test_admission_respects_sequence_limit_and_token_budget():
    sched, _ = make(max_batch_size=2, max_num_tokens=8)
    for i in range(4):
        sched.add(request(i, 5, 3))
    out = run_step(sched)
    assert [item.request.req_id for item in out.scheduled] == ["0"]  # "1" would overflow the budget
    out = run_step(sched)
    assert [item.request.req_id for item in out.scheduled] == ["0", "1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_admission_reserves_blocks_for_the_whole_request():
    sched, bm = make(num_blocks=4, block_size=4)
    sched.add(request(0, 4, 9))  # 12 tokens -> 3 blocks reserved, 1 taken now
    sched.add(request(1, 4, 5))  # 8 tokens -> 2 blocks: must wait
    out = run_step(sched)
    assert [item.request.req_id for item in out.scheduled] == ["0"]
    assert bm.num_used_blocks == 1
    while sched.running:
        run_step(sched)
        bm.check_integrity()
    run_step(sched)
    assert sched.running[0].req_id == "1"


def test_chunked_prefill_splits_a_long_prompt_and_samples_on_the_last_chunk():
    sched, _ = make(max_num_tokens=8, chunked=True)
    sched.add(request(0, 20, 2))
    chunks = []
    while not sched.running or sched.running[0].num_computed_tokens < 20:
        out = run_step(sched)
        chunks.append((out.scheduled[0].num_tokens, out.scheduled[0].sample))
    assert chunks == [(8, False), (8, False), (4, True)]


def test_max_chunk_tokens_lets_a_new_prompt_share_steps_with_a_long_one():
    uncapped, _ = make(max_num_tokens=16, num_blocks=128, chunked=True)
    capped, _ = make(max_num_tokens=16, num_blocks=128, chunked=True, max_chunk_tokens=10)
    for sched in (uncapped, capped):
        sched.add(request(0, 60, 2))
        run_step(sched)
        sched.add(request(1, 5, 2))
    # Uncapped, the long prompt's chunk takes the whole budget and the newcomer waits for its last chunk.
    out = run_step(uncapped)
    assert [(item.request.req_id, item.num_tokens) for item in out.scheduled] == [("0", 16)]
    out = run_step(capped)
    assert [(item.request.req_id, item.num_tokens) for item in out.scheduled] == [("0", 10), ("1", 5)]
    assert out.scheduled[1].sample  # the short prompt's whole prompt went in: it samples in this step


def test_random_workloads_never_leak_or_overrun():
    rng = random.Random(0)
    for trial in range(30):
        chunked = trial % 2 == 0
        sched, bm = make(max_batch_size=rng.randint(1, 6), max_num_tokens=rng.randint(8, 40),
                         num_blocks=rng.randint(10, 40), block_size=rng.choice([1, 2, 4, 8]), chunked=chunked)
        budget = sched.config.max_num_tokens
        pending = []
        for i in range(rng.randint(1, 15)):
            prompt = rng.randint(1, budget if not chunked else 3 * budget)
            max_tokens = rng.randint(1, 12)
            if -(-(prompt + max_tokens - 1) // bm.block_size) <= bm.num_blocks:
                pending.append(request(i, prompt, max_tokens))
        steps = 0
        while pending or sched.num_unfinished:
            if pending and rng.random() < 0.5:
                sched.add(pending.pop(0))
            if sched.running and rng.random() < 0.05:  # a cancellation
                sched.finish(rng.choice(sched.running), RequestStatus.FINISHED_CANCELLED)
            out = run_step(sched)
            assert out.num_tokens <= budget and len(out.scheduled) <= sched.config.max_batch_size
            bm.check_integrity()
            steps += 1
            assert steps < 2000, "a request never finished"
        assert bm.num_free_blocks == bm.num_blocks


def test_scheduler_config_takes_every_scheduling_field_of_the_model_config_in_seconds():
    from inflight_backend.config import EngineConfig

    engine = EngineConfig(checkpoint="unused", max_batch_size=7, max_num_tokens=96, enable_chunked_prefill=True,
                          batching_policy="static", capacity_policy="max_utilization", max_queue_delay_ms=250.0,
                          priority_aging_s=3.0, max_chunk_tokens=24, cache_aware_admission_ms=500.0)
    assert SchedulerConfig.from_engine_config(engine) == SchedulerConfig(
        max_batch_size=7, max_num_tokens=96, enable_chunked_prefill=True, policy="static",
        capacity_policy="max_utilization", max_queue_delay_s=0.25, priority_aging_s=3.0, max_chunk_tokens=24,
        cache_aware_wait_s=0.5)
    targeted = EngineConfig(checkpoint="unused", enable_chunked_prefill=True, step_time_target_ms=150.0)
    assert SchedulerConfig.from_engine_config(targeted).step_time_target_s == 0.15


def test_a_step_time_target_sizes_each_steps_budget_from_the_steps_run():
    """Steps cost 10 ms plus 1 ms a token and the target is 40 ms: once the fit has steps of a few sizes, each
    step takes at most 30 tokens, or the running sequences plus one block (4 tokens) when more run."""
    bm = BlockManager(4096, 4)  # room for every request's whole length: none waits for blocks
    sched = Scheduler(SchedulerConfig(40, 256, True, step_time_target_s=0.040), bm)
    learnt = 0
    budgets = []
    for i in range(60):
        sched.add(request(i, 6, 200))
        running = len(sched.running)
        out = run_step(sched)
        if sched.step_budget.per_token_s is None:
            assert sched.token_budget == 256  # nothing learnt yet: max_num_tokens
        else:
            learnt += 1
            assert sched.token_budget == max(30, running + 4)
            assert out.num_tokens <= sched.token_budget
            assert out.num_prefill_tokens >= 4 or running == 40  # decodes first, and prompts still advance
            budgets.append(sched.token_budget)
        sched.step_took(out, 0.010 + 0.001 * out.num_tokens)
    assert learnt >= 55 and len(sched.running) == 40
    assert 30 in budgets and max(budgets) == 44  # the floor: 40 decodes and one block
    assert sched.step_budget.per_token_s == pytest.approx(0.001)
    assert sched.step_budget.fixed_s == pytest.approx(0.010)
    bm.check_integrity()
