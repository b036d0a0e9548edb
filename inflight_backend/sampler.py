"""Turns each sampled row of logits into one token: greedy, or temperature / top-k / top-p with a seed."""
from __future__ import annotations

import torch

from .models import cpu_ops
from .request import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._ops = cpu_ops.load_library()  # greedy rows of CPU logits: the native argmax (torch's is 10x slower)

    def sample(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: (N, vocab) fp32, one row per request in `req_ids` order."""
        if self._ops is not None and cpu_ops.usable(logits):
            tokens = cpu_ops.argmax_rows(self._ops, logits)
        else:
            tokens = logits.argmax(dim=-1).tolist()
        for row, (req_id, p) in enumerate(zip(req_ids, params)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], req_id, p)
        return tokens

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def _sample_row(self, logits: torch.Tensor, req_id: str, p: SamplingParams) -> int:
        gen = self._generators.get(req_id)
        if gen is None:
            gen = self._generators[req_id] = torch.Generator(device=logits.device)
            gen.manual_seed(p.seed if p.seed is not None else torch.seed())
        probs = filter_probs(logits / p.temperature, p.top_k, p.top_p)
        return int(torch.multinomial(probs, 1, generator=gen))


def filter_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax over the top-k logits, then the smallest prefix whose mass reaches top_p (always >= 1 token)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    if top_k > 0:
        sorted_logits[top_k:] = float("-inf")
    probs = torch.softmax(sorted_logits, dim=-1)
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        probs = probs.masked_fill(before >= top_p, 0.0)
        probs = probs / probs.sum()
    return torch.zeros_like(probs).scatter_(0, order, probs)
