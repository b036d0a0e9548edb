"""What every request must satisfy to be served, fixed when the engine loads (`RequestLimits.check`)."""
from __future__ import annotations

from dataclasses import dataclass

from .block_manager import blocks_for
from .request import RequestError, SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The engine's fixed limits. `check` reads nothing else, so it is safe from any thread."""

    vocab_size: int
    max_model_len: int  # prompt + output tokens
    block_size: int
    num_blocks: int  # the KV pool's
    max_num_tokens: int  # tokens a step computes
    chunked_prefill: bool  # a prompt may span several steps
    context_logits: bool  # the engine can return a prompt's logits

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (naming what is wrong) if this request can never be served."""
        n, vocab = len(prompt_ids), self.vocab_size
        if n == 0:
            raise RequestError("empty prompt: give a non-empty text_input or input_ids")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.max_tokens <= 0:
            raise RequestError(f"max_tokens must be > 0, got {params.max_tokens}")
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens], got {params.min_tokens}")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                               f"context of {self.max_model_len} tokens")
        needed = blocks_for(n + params.max_tokens - 1, self.block_size)
        if needed > self.num_blocks:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {needed} KV blocks; "
                               f"the pool has {self.num_blocks}")
        if n > self.max_num_tokens and not self.chunked_prefill:
            raise RequestError(f"prompt ({n} tokens) exceeds max_num_tokens ({self.max_num_tokens}) "
                               "and chunked prefill is off")
        if params.end_id is not None and not -1 <= params.end_id < vocab:
            raise RequestError(f"end_id {params.end_id} is outside the vocabulary (-1: no end token)")
        if params.return_context_logits and not self.context_logits:
            raise RequestError("return_context_logits: the TensorRT engine returns logits of sampled tokens only "
                               "(use engine pytorch)")
        outside = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if outside:
            raise RequestError(f"logit bias (embedding_bias, logit_bias): token id {outside[0]} is outside the "
                               f"vocabulary [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.allowed_token_ids):
            raise RequestError(f"allowed_token_ids: a token id is outside the vocabulary [0, {vocab})")
        for name, seqs in (("stop_words_list", params.stop_token_seqs), ("bad_words_list", params.bad_token_seqs),
                           ("bad_words", params.bad_output_seqs)):
            if any(not 0 <= t < vocab for seq in seqs for t in seq):
                raise RequestError(f"{name}: a token id is outside the vocabulary [0, {vocab})")
