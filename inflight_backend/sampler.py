"""Turns each sampled row of logits into one token: greedy, or temperature / top-k / top-p with a seed. fp32 CPU
logits go through the native argmax and draw (plugins/cpu_ops); others through the torch functions below, which
define what the native draw computes.

A row that cannot be sampled (non-finite logits, no probability mass left) never fails the batch: `sample`
reports it, and the engine ends that request alone with the message.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .models import cpu_ops
from .request import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._ops = cpu_ops.load_library()  # greedy rows of CPU logits: the native argmax (torch's is 10x slower)

    def sample(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]
               ) -> tuple[list[int], dict[int, str]]:
        """logits: (N, vocab) fp32, one row per request in `req_ids` order.

        Returns one token per row and {row: why} for the rows that could not be sampled (their token is -1)."""
        if self._ops is not None and cpu_ops.usable(logits):
            tokens = cpu_ops.argmax_rows(self._ops, logits)
        else:
            tokens = logits.argmax(dim=-1).tolist()
        failed: dict[int, str] = {}
        for row in non_finite_rows(logits, tokens):  # argmax picks a NaN or inf wherever one decides
            failed[row], tokens[row] = "the model produced non-finite logits for this request", -1
        sampled = [row for row, p in enumerate(params) if not p.greedy and row not in failed]
        if sampled and self._ops is not None and cpu_ops.usable(logits):
            self._sample_native(logits, sampled, req_ids, params, tokens, failed)
            return tokens, failed
        for row in sampled:
            try:
                tokens[row] = self._sample_row(logits[row], req_ids[row], params[row])
            except (RuntimeError, ValueError) as exc:  # one row's failure ends that request only
                failed[row], tokens[row] = f"sampling failed: {exc}", -1
        return tokens, failed

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def _generator(self, req_id: str, p: SamplingParams, device: torch.device) -> torch.Generator:
        gen = self._generators.get(req_id)
        if gen is None:
            gen = self._generators[req_id] = torch.Generator(device=device)
            gen.manual_seed(p.seed if p.seed is not None else torch.seed())
        return gen

    def _sample_row(self, logits: torch.Tensor, req_id: str, p: SamplingParams) -> int:
        return draw(filter_probs(scale(logits, p.temperature), p.top_k, p.top_p),
                    self._generator(req_id, p, logits.device))

    def _sample_native(self, logits: torch.Tensor, rows: list[int], req_ids: list[str],
                       params: list[SamplingParams], tokens: list[int], failed: dict[int, str]) -> None:
        """The sampled rows of fp32 CPU logits in one native call (ops_sample_rows_f32: the same filters and draw
        as filter_probs and draw, weights in fp32, each row on one thread whatever the batch), each row's uniform
        the one `draw` takes from its request's generator."""
        assert self._ops is not None
        ps = [params[row] for row in rows]
        uniform = [float(torch.rand((), generator=self._generator(req_ids[row], p, logits.device),
                                    dtype=torch.float64)) for row, p in zip(rows, ps)]
        drawn = cpu_ops.sample_rows(self._ops, logits, rows, [p.temperature for p in ps], [p.top_k for p in ps],
                                    [p.top_p for p in ps], uniform)
        for row, token in zip(rows, drawn):
            if token < 0:
                failed[row], tokens[row] = f"sampling failed: {NO_MASS}", -1
            else:
                tokens[row] = token


def non_finite_rows(logits: torch.Tensor, tokens: list[int]) -> list[int]:
    """The rows whose chosen logit logits[row, tokens[row]] is NaN or infinite (O(rows)). On the CPU through
    numpy, as mask_logits: 13 us at 256 rows against torch's 32 (its indexing is a parallel region)."""
    if _numpy_view_ok(logits):
        return np.flatnonzero(~np.isfinite(logits.numpy()[np.arange(len(tokens)), tokens])).tolist()
    rows = torch.arange(len(tokens), device=logits.device)
    chosen = logits[rows, torch.tensor(tokens, dtype=torch.int64, device=logits.device)]
    return torch.nonzero(~torch.isfinite(chosen)).flatten().tolist()


def _numpy_view_ok(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32  # numpy follows any strides


def mask_logits(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """logits[rows[i], token_ids[i]] = -inf, in place (the runner's logits are inference tensors). On the CPU
    through numpy's view of the same memory: a step's min-tokens masks at 256 rows, 18 us against torch's 64."""
    if _numpy_view_ok(logits):
        logits.numpy()[rows, token_ids] = -np.inf
        return
    with torch.inference_mode():
        logits[torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device)] = float("-inf")


class PenaltyState:
    """A penalized request's tokens so far, folded in a token at a time (a step's cost must not grow with the
    context): which token ids its prompt and output hold (repetition penalty) and how often each occurs in its
    output (presence, frequency), as vocabulary-sized arrays."""

    __slots__ = ("seen", "counts", "folded")

    def __init__(self, vocab: int, prompt_ids: list[int], p: SamplingParams) -> None:
        self.seen = np.zeros(vocab, dtype=bool) if p.repetition_penalty != 1.0 else None
        if self.seen is not None:
            self.seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        self.counts = np.zeros(vocab, dtype=np.int32) if p.presence_penalty or p.frequency_penalty else None
        self.folded = 0  # output tokens counted so far

    def update(self, output_ids: list[int]) -> None:
        if len(output_ids) > self.folded:
            new = np.asarray(output_ids[self.folded:], dtype=np.int64)
            if self.seen is not None:
                self.seen[new] = True
            if self.counts is not None:
                np.add.at(self.counts, new, 1)
            self.folded = len(output_ids)


def apply_penalties(logits: torch.Tensor, state: PenaltyState, p: SamplingParams) -> None:
    """In place on one row, `state` up to date. Repetition (transformers' RepetitionPenaltyLogitsProcessor,
    TensorRT-LLM's): every token of the prompt and output, negative logits times the penalty, positive ones divided
    by it. Presence and frequency (vLLM's, OpenAI's): each token generated so far, minus presence once and
    frequency per time."""
    with torch.inference_mode():
        if state.seen is not None:
            seen = torch.from_numpy(np.flatnonzero(state.seen)).to(logits.device)
            values = logits[seen]
            logits[seen] = torch.where(values < 0, values * p.repetition_penalty, values / p.repetition_penalty)
        if state.counts is not None and state.folded:
            ids = np.flatnonzero(state.counts)
            counts = torch.from_numpy(state.counts[ids]).to(logits.device, logits.dtype)
            logits[torch.from_numpy(ids).to(logits.device)] -= p.presence_penalty + p.frequency_penalty * counts


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - max) / temperature in float64: the best token stays at 0, so however small the temperature
    (down to the 1e-5 below which a request is greedy), the rest only underflow towards -inf, never NaN."""
    shifted = logits.double() - logits.max().double()
    return shifted / temperature


def filter_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax over the top-k logits, then the smallest prefix whose mass reaches top_p (always >= 1 token).

    Sorts only what the filters need (a 32,000-value sort takes ~2.4 ms on a CPU core): nothing without them, the
    top k with top_k, and with top_p alone the best NUCLEUS_FIRST tokens, 4x more until their mass reaches top_p
    (then every token past them is cut: their strictly better mass is at least that), all of them at worst."""
    n = logits.shape[-1]
    top_k = top_k if 0 < top_k < n else 0
    if not top_k and top_p >= 1.0:
        return torch.softmax(logits, dim=-1)
    if top_k:
        sorted_logits, order = torch.topk(logits, top_k)
        probs = torch.softmax(sorted_logits, dim=-1)
    else:
        lse = torch.logsumexp(logits, dim=-1)
        k = NUCLEUS_FIRST
        while True:
            sorted_logits, order = torch.topk(logits, k) if k < n else torch.sort(logits, descending=True)
            probs = torch.exp(sorted_logits - lse)  # the softmax over every token, for the best k
            if k >= n or float(probs.sum()) >= top_p:
                break
            k *= 4
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        probs = probs.masked_fill(before >= top_p, 0.0)
    probs = probs / probs.sum()
    return torch.zeros(n, dtype=probs.dtype, device=probs.device).scatter_(0, order, probs)


NUCLEUS_FIRST = 64  # tokens filter_probs sorts first for a top_p alone
NO_MASS = "no probability mass to sample from (non-finite or negative weights)"


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One index with probability probs[i] / sum(probs) (non-negative, finite, some positive), by one uniform
    draw from `gen` against the running sum: ~0.05 ms on 32,000 values where torch.multinomial takes ~0.9. A zero
    weight is never drawn (the first running sum above the draw is a positive weight's)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0) or bool((probs < 0).any()):
        raise ValueError(NO_MASS)
    u = torch.rand((), generator=gen, dtype=cdf.dtype, device=cdf.device) * total
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= probs.shape[-1]:  # u rounded up to the total: the last token with weight
        index = int(torch.nonzero(probs).max())
    return index
