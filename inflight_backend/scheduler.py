"""Iteration-level scheduling: which requests get how many tokens in the next engine step.

There is no prefill or decode phase: each request knows how many of its tokens have K/V in the cache
(`num_computed_tokens`) and the scheduler hands out the rest under a token budget. A request whose scheduled
tokens reach its end samples one new token. The scheduler never touches tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, blocks_for
from .request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int  # running sequences
    max_num_tokens: int  # tokens per step
    enable_chunked_prefill: bool = False


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    sample: bool  # whether this step's last token for the request yields a new token
    block_table: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Fused in-flight batching (ORCA, TensorRT-LLM): one decode token for every running request, then prompt
    tokens of newly admitted requests (chunked when enabled), in one step under `max_num_tokens`.

    Admission reserves KV blocks for the prompt plus `max_tokens`, so a running request never runs out of
    blocks (TensorRT-LLM's `guaranteed_no_evict`). Blocks are still taken only as tokens are written.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_tokens
        # Decode tokens first, then unfinished prompt chunks of running requests.
        for request in sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1):
            if budget == 0:
                break
            budget -= self._schedule(out, request, min(request.num_uncomputed_tokens, budget))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            num_tokens = request.num_uncomputed_tokens
            if num_tokens > budget and not self.config.enable_chunked_prefill:
                break
            if not self._can_reserve(request):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= self._schedule(out, request, min(num_tokens, budget))
        return out

    def update(self, output: SchedulerOutput, sampled_ids: list[int]) -> list[Request]:
        """Advance computed tokens and append sampled ones (in `output` order). Returns requests with a new token."""
        sampled = iter(sampled_ids)
        advanced = []
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_tokens
            if item.sample:
                item.request.output_ids.append(next(sampled))
                advanced.append(item.request)
        return advanced

    def _schedule(self, out: SchedulerOutput, request: Request, num_tokens: int) -> int:
        end = request.num_computed_tokens + num_tokens
        if not self.blocks.allocate(request.req_id, end):
            raise RuntimeError("KV reservation violated: a running request could not get its blocks")
        sample = end == request.num_tokens
        out.scheduled.append(ScheduledRequest(request, num_tokens, sample, self.blocks.block_table(request.req_id)))
        if request.num_computed_tokens < request.num_prompt_tokens:
            out.num_prefill_tokens += num_tokens
        else:
            out.num_decode_tokens += num_tokens
        return num_tokens

    def _can_reserve(self, request: Request) -> bool:
        reserved = sum(self.blocks.num_missing_blocks(r.req_id, r.max_total_tokens) for r in self.running)
        needed = blocks_for(request.max_total_tokens, self.blocks.block_size)
        return needed + reserved <= self.blocks.num_free_blocks
