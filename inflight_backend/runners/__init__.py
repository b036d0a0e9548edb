"""Model runners: turn a SchedulerOutput into the logits of the tokens to sample."""
from .base import ModelRunner

__all__ = ["ModelRunner"]
