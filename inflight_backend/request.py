"""A generation request and its sampling parameters, as the scheduler and engine see them."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .logit_bias import BiasArrays
    from .sampler import PenaltyState


class RequestError(ValueError):
    """A request that can never be served; the message goes back to its client. `reason` labels the
    rejection in `inflight_requests_rejected_total`."""

    reason = "invalid"


class PromptTooLarge(RequestError):
    reason = "too_large"


class QueueFull(RequestError):
    reason = "queue_full"


class ServerStopping(RequestError):
    reason = "stopping"


REJECTION_REASONS = ("invalid", "too_large", "queue_full", "stopping")


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """Checked before a prompt is decoded or tokenized, so an oversized one costs nothing."""

    max_bytes: int  # text_input, UTF-8 bytes
    max_tokens: int  # input_ids, and text_input once tokenized


GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token and when to stop. A temperature below GREEDY_TEMPERATURE (0 included) is greedy:
    the limit of sampling as the temperature falls, and the division it would take cannot overflow."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None  # None: the tokenizer's EOS
    stop_words: tuple[str, ...] = ()
    min_tokens: int = 0  # end_id and stop words are ignored until this many tokens exist
    repetition_penalty: float = 1.0  # transformers' / TensorRT-LLM's: over prompt and output tokens
    presence_penalty: float = 0.0  # vLLM's / OpenAI's: over output tokens
    frequency_penalty: float = 0.0
    stop_token_seqs: tuple[tuple[int, ...], ...] = ()  # generated token sequences that end the request
    bad_token_seqs: tuple[tuple[int, ...], ...] = ()  # never completed (transformers' NoBadWordsLogitsProcessor)
    bad_output_seqs: tuple[tuple[int, ...], ...] = ()  # the same within the output alone (vLLM's bad_words)
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and the k most likely ones
    return_generation_logits: bool = False  # each generated token's raw logits (vocab floats, fp32)
    return_context_logits: bool = False  # the prompt's logits (one row per prompt token), on the first output
    include_stop_str_in_output: bool = True  # False (vLLM's default): the text ends before the stop string
    detokenize: bool = True  # False: outputs carry ids and no text (the client asked for no text; no stop strings)
    # Added to the logits before the penalties, one (token, bias) a token (vLLM's logit_bias, TensorRT-LLM's
    # embedding_bias); and, when not empty, the only tokens that may be generated (vLLM's allowed_token_ids)
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0  # sampled rows: tokens less likely than min_p x the best one's probability are dropped (vLLM's)
    # Whether any rule of token_rules.apply_logit_rules applies (fixed at construction: that loop runs every step
    # over every sampled row, and most requests have none)
    logit_rules: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_rules", bool(
            self.penalized or self.min_tokens > 0 or self.bad_token_seqs or self.bad_output_seqs or self.biased))

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_raw_logits(self) -> bool:
        """Whether the engine keeps anything of this request's logits before penalties and masks change them."""
        return self.logprobs is not None or self.return_generation_logits

    @property
    def needs_all_logits(self) -> bool:
        """Whether a step with this request must compute every logit exactly (else an argmax's are enough: a
        greedy screen may approximate the rest, models/greedy_screen.py)."""
        return (not self.greedy or self.penalized or self.needs_raw_logits or self.return_context_logits
                or self.biased)

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_CANCELLED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. `num_computed_tokens` counts tokens whose K/V are in the cache; the scheduler hands out
    the rest (prompt chunks or one decode token) without distinguishing phases."""

    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    priority: int = 0  # higher is admitted sooner
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    prefix_source: Request | None = None  # a sequence of the same prompt whose computed full blocks it may share
    num_shared_blocks: int = 0  # computed blocks it took when admitted (prefix cache or prefix_source), the most
    num_context_logits: int = 0  # prompt positions whose logits it has returned (return_context_logits)
    penalties: PenaltyState | None = None  # a penalized request's, made at its first sampled step
    bias: BiasArrays | None = None  # a biased request's (allowed tokens, logit bias), made the same way

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request can ever hold in the KV cache (the last sampled token is never written)."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building their concatenation (a decode step asks for
        one token: its cost must not grow with the context)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]
