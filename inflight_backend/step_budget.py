"""The token budget that keeps an engine step under a time target (`step_time_target_ms`), learnt as steps run.

Sarathi-Serve sizes chunked prefill's token budget from the inter-token latency a deployment must keep. Which
budget keeps it depends on the machine: the same 128-token budget made ~150 ms steps of the large bench model on
one 2-core server and ~250 ms on another (docs/PERFORMANCE.md, "Capacity"). Here the engine learns it: a step's
wall time is fitted as `fixed + per_token * tokens` by least squares over the steps run, older steps weighing
`forget` times less at each new one (the fit follows the machine's phases), and each step's budget is the most
tokens the fit says run within the target.

Decodes always run: the budget is at least the running sequences plus `min_prompt_tokens`, so a target below what
the decodes alone cost slows prompts down but never stops them. Until the fit has seen steps of different sizes,
and whenever it finds no positive cost per token, the budget is `ceiling` (the configured `max_num_tokens`).
"""
from __future__ import annotations

_MIN_SPREAD = 1.0  # tokens^2: below this variance of step sizes the slope is not refitted


class StepBudget:
    """observe() after each step that ran; budget() before scheduling the next. Engine thread only."""

    def __init__(self, target_s: float, ceiling: int, min_prompt_tokens: int, forget: float = 0.95) -> None:
        if target_s <= 0 or ceiling < 1 or min_prompt_tokens < 1 or not 0 < forget < 1:
            raise ValueError("StepBudget needs target_s > 0, ceiling >= 1, min_prompt_tokens >= 1, 0 < forget < 1")
        self.target_s, self.ceiling, self.min_prompt_tokens, self.forget = target_s, ceiling, min_prompt_tokens, forget
        self.fixed_s = 0.0  # the fit's cost of a step of no tokens
        self.per_token_s: float | None = None  # the fit's cost of each token; None until it has one
        # Decayed sums: weight, tokens, tokens^2, seconds, tokens * seconds
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens (prompt and decode) took `seconds` of wall time."""
        f = self.forget
        self._w = self._w * f + 1.0
        self._x = self._x * f + tokens
        self._xx = self._xx * f + tokens * tokens
        self._y = self._y * f + seconds
        self._xy = self._xy * f + tokens * seconds
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread > _MIN_SPREAD:
            slope = (self._xy / self._w - mean_x * mean_y) / spread
            if slope > 0:  # (a noisy window can fit a slope <= 0: keep the last one)
                self.per_token_s = slope
        if self.per_token_s is not None:
            self.fixed_s = max(mean_y - self.per_token_s * mean_x, 0.0)

    def budget(self, num_running: int) -> int:
        """Tokens the next step may take with `num_running` sequences running."""
        if self.per_token_s is None:
            return self.ceiling
        floor = min(num_running + self.min_prompt_tokens, self.ceiling)
        fit = (self.target_s - self.fixed_s) / self.per_token_s
        return max(floor, min(int(fit + 1e-6), self.ceiling))  # (1e-6: 29.999... tokens are 30)
