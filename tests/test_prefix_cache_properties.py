"""Prefix caching (block reuse) under random request streams, with a fake runner that keeps a model of the KV pool.

Requests share system prompts and resend earlier requests' prompts plus outputs (multi-turn chats), prefixes end
mid-block, pools are small enough to evict and preempt. The fake KV pool records which token each slot holds when a
step writes it; every step, every scheduled request must read back exactly its own tokens in the slots before the
ones it writes (so no evicted, freed or foreign block is ever read), the accounting must hold (free + cached + held
== total, reference counts equal the tables), every request must finish, and tokens must equal those of a run
without reuse.
"""
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from inflight_backend.block_manager import BlockManager, blocks_for
from inflight_backend.request import Request, RequestStatus, SamplingParams
from inflight_backend.scheduler import Scheduler, SchedulerConfig
from inflight_backend.waiting_order import next_waiting
from tests.test_scheduler_properties import fake_token, finish_step


@dataclass
class Arrival:
    step: int
    system: int  # which shared prefix
    system_len: int
    turn_of: int | None  # resend this earlier request's prompt + output, then a new suffix
    suffix_len: int
    max_tokens: int
    cancel_at: int | None


arrivals = st.lists(st.builds(Arrival, st.integers(0, 30), st.integers(0, 2), st.integers(0, 40),
                              st.one_of(st.none(), st.integers(0, 12)), st.integers(1, 20), st.integers(1, 12),
                              st.one_of(st.none(), st.integers(0, 60))), min_size=1, max_size=14)


def run(arrivals, policy, capacity, chunked, block_size, num_blocks, reuse, max_chunk):
    bm = BlockManager(num_blocks, block_size, enable_reuse=reuse)
    sched = Scheduler(SchedulerConfig(4, 64, chunked, policy, capacity, max_chunk_tokens=max_chunk), bm)
    kv: dict[int, int] = {}  # flat slot -> the token whose K/V it holds
    pending = sorted(enumerate(arrivals), key=lambda ia: ia[1].step)
    requests: dict[int, Request] = {}
    step = 0
    while pending or sched.num_unfinished:
        while pending and pending[0][1].step <= step:
            i, a = pending.pop(0)
            prompt = [(a.system * 7 + j) % 50 for j in range(a.system_len)]
            earlier = requests.get(a.turn_of) if a.turn_of is not None else None
            if earlier is not None and earlier.status.is_finished:
                prompt = earlier.prompt_ids + earlier.output_ids
            prompt = (prompt + [(i * 13 + j) % 50 + 50 for j in range(a.suffix_len)])[:60]
            requests[i] = Request(str(i), prompt, SamplingParams(max_tokens=a.max_tokens))
            sched.add(requests[i])
        for i, r in requests.items():
            if arrivals[i].cancel_at == step and not r.status.is_finished:
                sched.finish(r, RequestStatus.FINISHED_CANCELLED)
        out = sched.schedule()
        for item in out.scheduled:
            r, table = item.request, item.block_table
            start = r.num_computed_tokens
            slot = [table[p // block_size] * block_size + p % block_size for p in range(start + item.num_tokens)]
            known = r.prompt_ids + r.output_ids
            assert [kv.get(slot[p]) for p in range(start)] == known[:start], "a request read K/V not its own"
            for p in range(start, start + item.num_tokens):
                kv[slot[p]] = known[p]
        finish_step(sched, bm, out)
        step += 1
        assert step < 5000, "a request never finished"
    assert bm.num_free_blocks == num_blocks
    return [r for r in requests.values() if r.status != RequestStatus.FINISHED_CANCELLED], sched


@given(arrivals=arrivals, policy=st.sampled_from(["static", "prefill_first", "fused"]),
       capacity=st.sampled_from(["guaranteed_no_evict", "max_utilization"]), chunked=st.booleans(),
       block_size=st.sampled_from([1, 2, 4, 16, 32, 64]), pool_slack=st.integers(0, 12), max_chunk=st.integers(0, 24))
@settings(max_examples=300, deadline=None)
def test_reuse_reads_only_what_was_written_and_changes_no_token(arrivals, policy, capacity, chunked, block_size,
                                                                 pool_slack, max_chunk):
    num_blocks = blocks_for(60 + 12, block_size) + pool_slack  # the longest request fits alone
    finished, _ = run(arrivals, policy, capacity, chunked, block_size, num_blocks, True, max_chunk)
    for r in finished:
        assert r.output_ids == alone(r.prompt_ids, r.params.max_tokens), "reuse changed a request's tokens"


def alone(prompt_ids, max_tokens):
    """The tokens a request produces by itself (the fake model reads only its own tokens)."""
    r = Request("x", list(prompt_ids), SamplingParams(max_tokens=max_tokens))
    while len(r.output_ids) < max_tokens:
        r.output_ids.append(fake_token(r))
    return r.output_ids


def test_a_repeated_prompt_is_served_from_the_cache_and_tails_are_evicted_first():
    bm = BlockManager(num_blocks=6, block_size=4, enable_reuse=True)
    sched = Scheduler(SchedulerConfig(4, 64), bm)
    prompt = list(range(10))  # two full blocks and a partial one
    first = Request("a", prompt, SamplingParams(max_tokens=2))
    sched.add(first)
    while sched.num_unfinished:
        out = sched.schedule()
        for r in sched.update(out, [7] * sum(item.sample for item in out.scheduled)):
            if len(r.output_ids) >= 2:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6  # the two full prompt blocks kept, yet free
    again = Request("b", prompt, SamplingParams(max_tokens=1))
    sched.add(again)
    out = sched.schedule()
    assert out.scheduled[0].num_tokens == 2 and again.num_computed_tokens == 8  # only the partial block's tokens
    assert sched.num_cached_tokens == 8 and bm.counters.num_reused_blocks == 2
    sched.update(out, [7])
    sched.finish(again, RequestStatus.FINISHED_LENGTH)
    assert bm.allocate("c", 4 * 5)  # five blocks: four empty, then the least recently released cached one
    assert bm.counters.num_evictions == 1
    assert bm.lookup(prompt, 2) == bm.lookup(prompt, 1)  # the tail block went first; the head is still found
    bm.check_integrity()


def test_cache_aware_admission_prefers_cached_prefixes_but_not_forever():
    """With cache_aware_wait_s, of two waiting requests the one whose prompt is cached goes first; once the other
    has waited the bound, arrival order again."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_reuse=True)
    cached_prompt = list(range(20))
    bm.allocate("warm", 20)
    bm.commit("warm", lambda a, b: cached_prompt[a:b], 20)
    bm.free("warm")
    cold = Request("cold", [99] * 20, SamplingParams(max_tokens=1))
    warm = Request("hot", cached_prompt, SamplingParams(max_tokens=1))
    cold.arrival_time, warm.arrival_time = 100.0, 100.5
    assert next_waiting([cold, warm], 101.0, 10.0, 5.0, bm) is warm  # younger, but its prefix is cached
    assert next_waiting([cold, warm], 105.5, 10.0, 5.0, bm) is cold  # cold has waited 5.5 s: arrival order
    assert next_waiting([cold, warm], 101.0, 10.0, 0.0, bm) is cold  # not cache-aware: arrival order
