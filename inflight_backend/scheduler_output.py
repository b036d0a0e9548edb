"""What the scheduler hands the model runner for one step (`SchedulerOutput`): each scheduled request with its
token count, block table and whether it samples. Plain data: the runners read it without the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    sample: bool  # whether this step's last token for the request yields a new token
    block_table: list[int]
    is_decode: bool


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    budget: int = 0  # tokens the step may still take while the scheduler fills it (a preemption gives some back)

    # Derived, never stored: a preemption that drops a scheduled item cannot leave them stale.
    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for item in self.scheduled if item.is_decode)  # one token each

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (and recomputed) tokens."""
        return sum(item.num_tokens for item in self.scheduled if not item.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def is_decode(request: Request) -> bool:
    """One generated token left to compute: a decode step (anything else computes prompt or recomputes)."""
    return bool(request.output_ids) and request.num_uncomputed_tokens == 1
