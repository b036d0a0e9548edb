"""The null engine (`engine: null`): a runner that computes nothing, for measuring the serving path alone.

Every step returns the same logits for every sampled row (one token strongly preferred: the first id that is not
an end id), so the scheduler, sampler, detokenizer, response building and Triton's transport are all that cost
anything. Never a default: a model gets it only by naming it. benchmarks/serving_ceiling.py uses it.
"""
from __future__ import annotations

import numpy as np
import torch

from ..scheduler_output import SchedulerOutput
from .base import ModelRunner


class NullRunner(ModelRunner):
    def __init__(self, vocab_size: int, end_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.token = next(t for t in range(vocab_size) if t not in end_ids)
        self._row = np.zeros((1, vocab_size), dtype=np.float32)
        self._row[0, self.token] = 10.0

    def describe(self) -> str:
        return f"null (computes nothing: a benchmark of the serving path only; every token is id {self.token})"

    def execute(self, output: SchedulerOutput, greedy_only: bool = False) -> torch.Tensor:
        num_sampled = sum(1 for item in output.scheduled if item.sample)
        # A copy: the engine may change its rows in place. numpy's, on this thread: torch's would be a parallel
        # region, whose barrier waits out a scheduler slice whenever the serving path's threads hold the other core.
        return torch.from_numpy(np.repeat(self._row, num_sampled, axis=0))
