"""Property-based tests of the scheduler and block manager for every policy, with a fake runner.

Random arrivals, prompt and output lengths, cancellations and pool sizes; after every step: no block leaked or
owned twice, the token budget and sequence limit hold; every request finishes; `static` never lets a request
join a running batch; `prefill_first` never mixes prompt and decode tokens in one step; a preempted request
ends with exactly the tokens it would have produced unpreempted.
"""
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from inflight_backend.block_manager import BlockManager, blocks_for
from inflight_backend.request import Request, RequestStatus, SamplingParams
from inflight_backend.scheduler import Scheduler, SchedulerConfig


def fake_token(request: Request) -> int:
    """A deterministic 'model': the next token depends on the whole sequence so far (like greedy decoding)."""
    return (sum(request.prompt_ids) * 31 + sum(request.output_ids) * 7 + len(request.output_ids)) % 1000


@dataclass
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    priority: int
    cancel_at: int | None


arrivals = st.lists(st.builds(Arrival, st.integers(0, 10), st.integers(1, 60), st.integers(1, 25),
                              st.integers(0, 2), st.one_of(st.none(), st.integers(0, 40))), min_size=1, max_size=14)


@given(arrivals=arrivals, policy=st.sampled_from(["static", "prefill_first", "fused"]),
       capacity=st.sampled_from(["guaranteed_no_evict", "max_utilization"]), chunked=st.booleans(),
       block_size=st.sampled_from([1, 2, 4, 8, 16]), max_batch_size=st.integers(1, 6),
       max_num_tokens=st.integers(8, 80), pool_slack=st.integers(0, 10), max_chunk=st.integers(0, 24))
@settings(max_examples=500, deadline=None)
def test_scheduler_invariants(arrivals, policy, capacity, chunked, block_size, max_batch_size, max_num_tokens,
                              pool_slack, max_chunk):
    max_num_tokens = max(max_num_tokens, max_batch_size)
    longest = max(a.prompt_len + a.max_tokens for a in arrivals)
    num_blocks = blocks_for(longest, block_size) + pool_slack  # every request fits alone
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_batch_size, max_num_tokens, chunked, policy, capacity,
                                      max_queue_delay_s=0.0, max_chunk_tokens=max_chunk), bm)
    pending = sorted(enumerate(arrivals), key=lambda ia: ia[1].step)
    requests, cancelled = {}, set()
    step = 0
    while pending or sched.num_unfinished:
        while pending and pending[0][1].step <= step:
            i, a = pending.pop(0)
            prompt = [(i * 13 + j) % 97 for j in range(min(a.prompt_len, max_num_tokens if not chunked else 999))]
            requests[i] = Request(str(i), prompt, SamplingParams(max_tokens=a.max_tokens), priority=a.priority)
            sched.add(requests[i])
        for i, r in requests.items():
            if arrivals[i].cancel_at == step and not r.status.is_finished:
                sched.finish(r, RequestStatus.FINISHED_CANCELLED)
                cancelled.add(i)
        running_before = {r.req_id for r in sched.running}
        out = sched.schedule()
        check_step(sched, bm, out, running_before, policy, max_num_tokens, max_batch_size)
        if chunked and max_chunk:
            assert all(item.num_tokens <= max_chunk for item in out.scheduled), "a chunk exceeded max_chunk_tokens"
        finish_step(sched, bm, out)
        step += 1
        assert step < 5000, "a request never finished"
    assert bm.num_free_blocks == num_blocks
    for i, r in requests.items():
        if i not in cancelled:
            assert r.output_ids == unpreempted_tokens(r), "preemption changed a request's tokens"


def finish_step(sched, bm, out) -> None:
    """Sample every scheduled request whose step yields a token, end those at max_tokens, check the blocks."""
    sampled = [fake_token(item.request) for item in out.scheduled if item.sample]
    for r in sched.update(out, sampled):
        if len(r.output_ids) >= r.params.max_tokens:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
    bm.check_integrity()


def check_step(sched, bm, out, running_before, policy, max_num_tokens, max_batch_size):
    assert out.num_tokens <= max_num_tokens
    assert len(out.scheduled) <= max_batch_size and len(sched.running) <= max_batch_size
    assert len({id(item.request) for item in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        r = item.request
        assert item.num_tokens > 0 and r.num_computed_tokens + item.num_tokens <= r.num_tokens
        assert len(bm.block_table(r.req_id)) * bm.block_size >= r.num_computed_tokens + item.num_tokens
    if policy == "static" and running_before:
        assert {item.request.req_id for item in out.scheduled} <= running_before, "a request joined a static batch"
    if policy == "prefill_first":
        assert not (out.num_prefill_tokens and out.num_decode_tokens), "prefill_first mixed kinds in a step"


def unpreempted_tokens(request: Request) -> list[int]:
    replay = Request(request.req_id, request.prompt_ids, request.params)
    while len(replay.output_ids) < len(request.output_ids):
        replay.output_ids.append(fake_token(replay))
    return replay.output_ids


def test_max_utilization_preempts_the_newest_and_it_resumes_where_it_stopped():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(4, 64, False, "fused", "max_utilization"), bm)
    old, new = Request("old", [1] * 4, SamplingParams(max_tokens=9)), Request("new", [2] * 4, SamplingParams(9))
    sched.add(old)
    sched.add(new)
    preempted_tokens = None
    for _ in range(60):
        out = sched.schedule()
        if out.preempted:
            assert out.preempted == [new]
            preempted_tokens = list(new.output_ids)
            assert new.num_computed_tokens == 0 and bm.block_table("new") == []
        for r in sched.update(out, [fake_token(i.request) for i in out.scheduled if i.sample]):
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        if not sched.num_unfinished:
            break
    assert preempted_tokens is not None and sched.num_preemptions >= 1
    assert new.output_ids[:len(preempted_tokens)] == preempted_tokens
    assert new.output_ids == unpreempted_tokens(new) and old.output_ids == unpreempted_tokens(old)


def test_priority_is_honoured_and_waiting_requests_age():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(1, 64, False, "fused", "guaranteed_no_evict", priority_aging_s=1.0), bm)
    low, high = Request("low", [1, 2], SamplingParams(2)), Request("high", [3, 4], SamplingParams(2), priority=1)
    sched.add(low)
    sched.add(high)
    assert [i.request.req_id for i in sched.schedule().scheduled] == ["high"]
    sched.finish(high, RequestStatus.FINISHED_LENGTH)
    old, vip = Request("old", [5], SamplingParams(2)), Request("vip", [6], SamplingParams(2), priority=1)
    old.arrival_time -= 5.0  # waited 5 s: aged past one priority level
    sched.waiting = [vip, old]
    sched.running.clear()
    bm.free("low")
    assert [i.request.req_id for i in sched.schedule().scheduled] == ["old"]
