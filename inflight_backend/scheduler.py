"""Iteration-level scheduling: which requests get how many tokens in the next engine step.

There is no prefill or decode phase: each request knows how many of its tokens have K/V in the cache
(`num_computed_tokens`) and the scheduler hands out the rest under a token budget. A request whose scheduled
tokens reach its end samples one new token. The scheduler never touches tensors.

Batching policies (how an iteration is filled) and capacity policies (what happens when KV blocks run out)
are described in README.md; `SchedulerConfig` names them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .block_manager import BlockManager, blocks_for
from .config import EngineConfig, check_policies
from .request import Request, RequestStatus
from .scheduler_output import ScheduledRequest, SchedulerOutput, is_decode
from .step_budget import StepBudget
from .waiting_order import next_waiting


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int  # running sequences
    max_num_tokens: int  # tokens per step
    enable_chunked_prefill: bool = False
    policy: str = "fused"
    capacity_policy: str = "guaranteed_no_evict"
    max_queue_delay_s: float = 0.0  # static: how long a partial batch waits for more requests
    priority_aging_s: float = 10.0  # a waiting request gains one priority level per this many seconds
    max_chunk_tokens: int = 0  # chunked prefill: one request's prompt tokens per step; 0: the whole budget
    cache_aware_wait_s: float = 0.0  # > 0: longest cached prefix first among equals, for at most this long
    step_time_target_s: float = 0.0  # > 0: each step's budget learnt to run in this long (step_budget.py)

    def __post_init__(self) -> None:
        check_policies(self.policy, self.capacity_policy)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> SchedulerConfig:
        """The scheduling fields of a model's configuration (its milliseconds as seconds)."""
        return cls(max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens,
                   enable_chunked_prefill=config.enable_chunked_prefill, policy=config.batching_policy,
                   capacity_policy=config.capacity_policy, max_queue_delay_s=config.max_queue_delay_ms / 1000.0,
                   priority_aging_s=config.priority_aging_s, max_chunk_tokens=config.max_chunk_tokens,
                   cache_aware_wait_s=config.cache_aware_admission_ms / 1000.0,
                   step_time_target_s=config.step_time_target_ms / 1000.0)

    @property
    def chunk_limit(self) -> int:
        """Most prompt tokens one request may take in a step (the budget bounds it too)."""
        return self.max_chunk_tokens if self.enable_chunked_prefill and self.max_chunk_tokens else self.max_num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # tokens taken as computed blocks (prefix cache, or a sibling's) at admission
        self.step_budget = StepBudget(config.step_time_target_s, config.max_num_tokens, block_manager.block_size) \
            if config.step_time_target_s > 0 else None
        self.token_budget = config.max_num_tokens  # the last schedule()'s

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take `request` out of the queues and free its blocks. Call only between steps."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.req_id)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        if self.step_budget is not None:
            self.token_budget = self.step_budget.budget(len(self.running))
        out = SchedulerOutput(budget=self.token_budget)
        policy = self.config.policy
        if policy == "fused":  # ORCA / TensorRT-LLM: decodes, then prompt chunks, then new prompts
            self._schedule_running(out, decodes=True, then_others=True)
            self._admit(out)
        elif policy == "prefill_first":  # vLLM's original: a step is all prompt or all decode
            self._schedule_running(out, decodes=False)
            self._admit(out)
            if out.is_empty:
                self._schedule_running(out, decodes=True)
        elif self.running:  # static: the batch runs to completion before anyone joins
            self._schedule_running(out, decodes=True, then_others=True)
        elif self._static_batch_ready(time.monotonic() if now is None else now):
            self._admit(out)
        return out

    def step_took(self, output: SchedulerOutput, seconds: float) -> None:
        """The engine ran `output` in `seconds` (wall time, schedule to postprocess): what the step time target
        learns from."""
        if self.step_budget is not None and output.scheduled:
            self.step_budget.observe(output.num_tokens, seconds)

    def update(self, output: SchedulerOutput, sampled_ids: list[int]) -> list[Request]:
        """Advance computed tokens and append sampled ones (in `output` order). Returns requests with a new token."""
        sampled = iter(sampled_ids)
        advanced = []
        commit = self.blocks.commit if self.blocks.enable_reuse else None  # (only reuse files blocks)
        size = self.blocks.block_size
        for item in output.scheduled:
            request = item.request
            before = request.num_computed_tokens
            request.num_computed_tokens = computed = before + item.num_tokens
            if commit is not None and computed // size != before // size:  # a block was filled: file it
                commit(request.req_id, request.token_ids, computed)
            if item.sample:
                request.output_ids.append(next(sampled))
                advanced.append(request)
        return advanced

    def _schedule_running(self, out: SchedulerOutput, decodes: bool, then_others: bool = False) -> None:
        """The running requests of one kind (decodes, or prompts and recomputations), in order; with
        `then_others`, the other kind after them. Each request is one kind for the whole step."""
        decoding, others = [], []
        for request in self.running:  # is_decode(), inlined: this loop runs for every sequence every step
            if request.output_ids and \
                    len(request.prompt_ids) + len(request.output_ids) - request.num_computed_tokens == 1:
                decoding.append(request)
            else:
                others.append(request)
        if decodes:
            self._schedule_decodes(out, decoding)
        else:
            self._schedule_prompts(out, others)
        if then_others:
            if decodes:
                self._schedule_prompts(out, others)
            else:
                self._schedule_decodes(out, decoding)

    def _schedule_decodes(self, out: SchedulerOutput, requests: list[Request]) -> None:
        """One token each; a table grows only when its last block is full (the common case costs one lookup)."""
        running, allocate, scheduled = RequestStatus.RUNNING, self.blocks.allocate, out.scheduled
        for request in requests:
            if out.budget == 0:
                return
            if request.status != running:
                continue  # preempted earlier in this step
            end = request.num_computed_tokens + 1
            table = allocate(request.req_id, end)
            if table is None and (table := self._allocate(out, request, end)) is None:
                continue  # preempted itself to make room
            scheduled.append(ScheduledRequest(request, 1, True, table, True))
            out.budget -= 1

    def _schedule_prompts(self, out: SchedulerOutput, requests: list[Request]) -> None:
        running = RequestStatus.RUNNING
        for request in requests:
            if out.budget == 0:
                return
            if request.status != running:
                continue  # preempted earlier in this step
            limit = min(out.budget, self.config.chunk_limit)
            self._schedule(out, request, min(request.num_uncomputed_tokens, limit), False)

    def _admit(self, out: SchedulerOutput) -> None:
        reserved = None  # guaranteed_no_evict: blocks the running requests may still take (summed once a step)
        while self.waiting and out.budget > 0 and len(self.running) < self.config.max_batch_size:
            request = next_waiting(self.waiting, time.monotonic(), self.config.priority_aging_s,
                                   self.config.cache_aware_wait_s, self.blocks)
            if request is None:
                return
            reused = self._reusable(request)
            num_tokens = request.num_uncomputed_tokens - len(reused) * self.blocks.block_size
            limit = min(out.budget, self.config.chunk_limit)
            if num_tokens > limit:
                # A preempted request recomputes in chunks whatever the setting: it may have outgrown the budget.
                if not (self.config.enable_chunked_prefill or request.num_preemptions):
                    return
                num_tokens = limit
            if reserved is None and self.config.capacity_policy != "max_utilization":
                reserved = sum(self.blocks.num_missing_blocks(r.req_id, r.max_total_tokens) for r in self.running)
            if not self._fits(request, reused, reserved):
                return  # head-of-line: the next request waits its turn rather than overtaking
            if reused:
                self.blocks.take(request.req_id, reused)
                request.num_computed_tokens = len(reused) * self.blocks.block_size
                request.num_shared_blocks = max(request.num_shared_blocks, len(reused))
                self.num_cached_tokens += request.num_computed_tokens
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(out, request, num_tokens, is_decode(request))
            if reserved is not None:
                reserved += self.blocks.num_missing_blocks(request.req_id, request.max_total_tokens)

    def _reusable(self, request: Request) -> list[int]:
        """Computed full blocks `request` can take instead of computing them: its prefix's, found in the cache, or
        (sequences of one prompt) its source's prompt blocks; always leaving it at least one token to compute
        (the one whose logits give its next token). None for a request that wants its prompt's logits."""
        if request.num_computed_tokens or request.params.return_context_logits:
            return []
        size = self.blocks.block_size
        limit = (request.num_tokens - 1) // size
        blocks: list[int] = []
        source = request.prefix_source
        if source is not None and source.status == RequestStatus.RUNNING:
            computed = min(source.num_computed_tokens, request.num_prompt_tokens - 1)
            blocks = self.blocks.block_table(source.req_id)[:computed // size]
        if self.blocks.enable_reuse and limit > len(blocks):
            found = self.blocks.lookup(request.token_ids(0, request.num_tokens), limit)
            blocks = found if len(found) > len(blocks) else blocks
        return blocks[:limit]

    def _fits(self, request: Request, reused: list[int], reserved: int | None) -> bool:
        """Whether `request` can be admitted; `reserved` (guaranteed_no_evict): the blocks the running requests
        may still take."""
        # Reused blocks cost nothing new, but those only the cache keeps stop being free once taken.
        free = self.blocks.num_free_blocks - (len(reused) - self.blocks.num_held_elsewhere(reused))
        if self.config.capacity_policy == "max_utilization":
            # Current need: every token known so far, not just this step's chunk (admitting on the chunk alone
            # lets a long prompt be admitted, preempted for its next chunk, readmitted... without end).
            return self.blocks.num_missing_blocks(request.req_id, request.num_tokens) - len(reused) <= free
        needed = blocks_for(request.max_total_tokens, self.blocks.block_size) - len(reused)
        return needed + (reserved or 0) <= free

    def _schedule(self, out: SchedulerOutput, request: Request, num_tokens: int, decode: bool) -> None:
        end = request.num_computed_tokens + num_tokens
        table = self._allocate(out, request, end)
        if table is None:
            return
        out.scheduled.append(ScheduledRequest(request, num_tokens, decode or end == request.num_tokens, table, decode))
        out.budget -= num_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    def _allocate(self, out: SchedulerOutput, request: Request, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens`; under max_utilization, preempt the newest running requests until they fit.
        Returns the request's block table; None if `request` itself had to be preempted."""
        while (table := self.blocks.allocate(request.req_id, num_tokens)) is None:
            if self.config.capacity_policy != "max_utilization":
                raise RuntimeError("KV reservation violated: a running request could not get its blocks")
            victim = self.running[-1]
            self._preempt(out, victim)
            if victim is request:
                return None
        return table

    def _preempt(self, out: SchedulerOutput, victim: Request) -> None:
        """Free the victim's blocks and requeue it to recompute its KV later; its tokens so far are kept."""
        for i, item in enumerate(out.scheduled):
            if item.request is victim:
                del out.scheduled[i]
                out.budget += item.num_tokens
                break
        self.running.remove(victim)
        self.blocks.free(victim.req_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.append(victim)
        self.num_preemptions += 1
        out.preempted.append(victim)

    def _static_batch_ready(self, now: float) -> bool:
        if not self.waiting:
            return False
        oldest = min(r.arrival_time for r in self.waiting)
        return len(self.waiting) >= self.config.max_batch_size or now - oldest >= self.config.max_queue_delay_s

