"""The model-runner interface shared by the PyTorch, TensorRT and null runners."""
from __future__ import annotations

import torch

from ..scheduler import SchedulerOutput


class ModelRunner:
    """Owns the KV pool and the model; the only place that builds tensors from a schedule."""

    vocab_size: int

    def describe(self) -> str:
        """One line for the log: which engine, and how it attends."""
        return type(self).__name__

    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Run one step over the packed tokens of `output`; return (num_sampled, vocab) fp32 logits in the order
        of the scheduled requests whose `sample` flag is set."""
        raise NotImplementedError
