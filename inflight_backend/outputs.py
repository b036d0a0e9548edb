"""What the engine hands out for a request each step (`RequestOutput`), and the times of its life.

Plain data, importable without torch: the batch loop, the outbox and the Triton entry's responder read these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from .token_rules import TokenInfo


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: only what is new since the last output."""

    req_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    token_time: float = 0.0  # time.monotonic() when this output's tokens were sampled
    times: RequestTimes | None = None  # on the final output
    token_info: TokenInfo | None = None  # what the request asked to know about this output's token
    stop_reason: str | None = None  # the stop string or token id that ended it (None: EOS, or not stopped)
    num_shared_blocks: int = 0  # on the final output: prompt blocks it took as computed (prefix cache, a sibling)
    num_cached_tokens: int = 0  # on the final output: the tokens in them
    context_logits: np.ndarray | None = None  # float32 [prompt tokens, vocab], on the first token's output, if asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """time.monotonic() stamps of one request's life (None where it never got that far)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float | None = None  # when the engine ended it (a cancellation's end, for one)
