"""The model-runner interface shared by the PyTorch, TensorRT and null runners."""
from __future__ import annotations

import torch

from ..scheduler_output import SchedulerOutput


class ModelRunner:
    """Owns the KV pool and the model; the only place that builds tensors from a schedule."""

    vocab_size: int
    screens_greedy = False  # whether execute(greedy_only=True) may screen (refine_greedy then settles the logits)

    def describe(self) -> str:
        """One line for the log: which engine, and how it attends."""
        return type(self).__name__

    def execute(self, output: SchedulerOutput, greedy_only: bool = False) -> torch.Tensor:
        """Run one step over the packed tokens of `output`; return (num_sampled, vocab) fp32 logits in the order
        of the scheduled requests whose `sample` flag is set. `greedy_only` (a runner that `screens_greedy`):
        the step needs each row's argmax alone, and the logits may be a screen's, exact only once
        `refine_greedy` has run on them (after any masks)."""
        raise NotImplementedError

    def refine_greedy(self, logits: torch.Tensor) -> None:
        """In place: the screened logits of the last execute(greedy_only=True), masked, made exact wherever an
        argmax can land (models/greedy_screen.py); nothing if that execute did not screen."""
