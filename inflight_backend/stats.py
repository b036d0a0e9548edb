"""Per-iteration statistics of the batch manager: counters since start plus the last step's shape and timing."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    """Written by the engine thread once per step; read (as a copy) by metrics, benchmarks and tests."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt (and recomputed) tokens computed
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preempted_waiting: int = 0  # waiting requests that were preempted and will recompute
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # nobody holds them; their content is kept for reuse until evicted
    num_cached_tokens: int = 0  # prompt tokens taken as computed blocks (prefix cache, sibling sequences)
    num_reused_blocks: int = 0
    num_evicted_blocks: int = 0
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    last_step_num_seqs: int = 0
    last_step_token_budget: int = 0  # max_num_tokens, or what step_time_target_ms made of it
    # Seconds spent in each phase, summed over steps (the respond phase is timed by the responder thread).
    schedule_seconds: float = 0.0
    model_seconds: float = 0.0
    sample_seconds: float = 0.0
    kv_tokens_used_sum: int = 0  # tokens held in the cache, summed over steps (for utilisation)

    def record(self, sched, scheduler, times: tuple[float, float, float, float]) -> None:
        """times: perf_counter at step start, after schedule, after the model, after sampling/postprocess."""
        start, scheduled, modelled, sampled = times
        self.schedule_seconds += scheduled - start
        self.model_seconds += modelled - scheduled
        self.sample_seconds += sampled - modelled
        decodes = sched.num_decode_tokens
        self.last_step_prefill_tokens = sched.num_tokens - decodes
        self.last_step_decode_tokens = decodes
        self.last_step_num_seqs = len(sched.scheduled)
        self.last_step_token_budget = scheduler.token_budget
        self.record_queues(scheduler)
        if not sched.is_empty:
            self.num_steps += 1
            self.num_prompt_tokens += self.last_step_prefill_tokens
            self.num_generated_tokens += sum(item.sample for item in sched.scheduled)
            self.kv_tokens_used_sum += sum(r.num_computed_tokens for r in scheduler.running)

    def record_queues(self, scheduler) -> None:
        """Queue lengths and KV usage now (also after a cancellation between steps)."""
        self.num_running, self.num_waiting = len(scheduler.running), len(scheduler.waiting)
        self.num_preempted_waiting = sum(1 for r in scheduler.waiting if r.num_preemptions)
        self.num_preemptions = scheduler.num_preemptions
        blocks = scheduler.blocks
        self.kv_blocks_used, self.kv_blocks_cached = blocks.num_used_blocks, blocks.num_cached_blocks
        self.num_cached_tokens = scheduler.num_cached_tokens
        self.num_reused_blocks = blocks.counters.num_reused_blocks
        self.num_evicted_blocks = blocks.counters.num_evictions
