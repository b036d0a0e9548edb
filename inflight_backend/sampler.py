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
        self._ops = cpu_ops.load_library()  # fp32 CPU logits: the native argmax and draw (torch's are 5-10x slower)

    def sample(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]
               ) -> tuple[list[int], dict[int, str]]:
        """logits: (N, vocab) fp32, one row per request in `req_ids` order.

        Returns one token per row and {row: why} for the rows that could not be sampled (their token is -1)."""
        ops = self._ops if self._ops is not None and cpu_ops.usable(logits) else None
        if ops is not None:
            tokens = cpu_ops.argmax_rows(ops, logits)
        else:
            tokens = logits.argmax(dim=-1).tolist()
        failed: dict[int, str] = {}
        for row in non_finite_rows(logits, tokens):  # argmax picks a NaN or inf wherever one decides
            failed[row], tokens[row] = "the model produced non-finite logits for this request", -1
        rows = [row for row, p in enumerate(params) if not p.greedy and row not in failed]
        if not rows:
            return tokens, failed
        uniform = [float(torch.rand((), generator=self._generator(req_ids[row], params[row]), dtype=torch.float64))
                   for row in rows]  # each request's own stream of draws, one a sampled token
        drawn = (_draw_native(ops, logits, rows, params, uniform) if ops is not None
                 else _draw_torch(logits, rows, params, uniform))
        for row, token in zip(rows, drawn):  # one row's failure ends that request only
            if token < 0:
                failed[row], tokens[row] = f"sampling failed: {NO_MASS}", -1
            else:
                tokens[row] = token
        return tokens, failed

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def _generator(self, req_id: str, p: SamplingParams) -> torch.Generator:
        """The request's generator (on the CPU whatever the logits' device: a seed draws the same uniforms
        everywhere, and a draw costs no kernel launch)."""
        gen = self._generators.get(req_id)
        if gen is None:
            gen = self._generators[req_id] = torch.Generator()
            gen.manual_seed(p.seed if p.seed is not None else torch.seed())
        return gen


def _draw_native(ops, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                 uniform: list[float]) -> list[int]:
    ps = [params[row] for row in rows]
    return cpu_ops.sample_rows(ops, logits, rows, [p.temperature for p in ps], [p.top_k for p in ps],
                               [p.top_p for p in ps], uniform, [p.min_p for p in ps])


def _draw_torch(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], uniform: list[float]
                ) -> list[int]:
    """What the native draw computes, through torch."""
    ps = [params[row] for row in rows]
    device = logits.device
    temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float64, device=device)
    probs = filter_probs(scale(logits[torch.tensor(rows, device=device)], temperature), [p.top_k for p in ps],
                         [p.top_p for p in ps], [p.min_p for p in ps])
    return draw(probs, torch.tensor(uniform, dtype=torch.float64, device=device))


def non_finite_rows(logits: torch.Tensor, tokens: list[int]) -> list[int]:
    """The rows whose chosen logit logits[row, tokens[row]] is NaN or infinite (O(rows)). On the CPU through
    numpy, as mask_logits: 13 us at 256 rows against torch's 32 (its indexing is a parallel region)."""
    if numpy_view_ok(logits):
        return np.flatnonzero(~np.isfinite(logits.numpy()[np.arange(len(tokens)), tokens])).tolist()
    rows = torch.arange(len(tokens), device=logits.device)
    chosen = logits[rows, torch.tensor(tokens, dtype=torch.int64, device=logits.device)]
    return torch.nonzero(~torch.isfinite(chosen)).flatten().tolist()


def numpy_view_ok(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32  # numpy follows any strides


def mask_logits(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """logits[rows[i], token_ids[i]] = -inf, in place (the runner's logits are inference tensors). On the CPU
    through numpy's view of the same memory: a step's min-tokens masks at 256 rows, 18 us against torch's 64."""
    if numpy_view_ok(logits):
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


def apply_penalties(logits: torch.Tensor, rows: list[int], states: list[PenaltyState],
                    params: list[SamplingParams]) -> None:
    """In place on `rows` of logits, each with its request's state (up to date) and parameters, every row at
    once (on a GPU: one copy to the device a kind of penalty, not one a row). Repetition (transformers'
    RepetitionPenaltyLogitsProcessor, TensorRT-LLM's): every token of the prompt and output, negative logits
    times the penalty, positive ones divided by it. Presence and frequency (vLLM's, OpenAI's): each token
    generated so far, minus presence once and frequency per time."""
    if numpy_view_ok(logits):  # the CPU's rows in place through numpy's view, row by row
        view = logits.numpy()
        for row, s, p in zip(rows, states, params):
            x = view[row]
            if s.seen is not None:
                ids, factor = np.flatnonzero(s.seen), np.float32(p.repetition_penalty)
                values = x[ids]
                x[ids] = np.where(values < 0, values * factor, values / factor)
            if s.counts is not None and s.folded:  # fp32 products and sums, as torch's
                ids = np.flatnonzero(s.counts)
                x[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * s.counts[ids].astype(
                    np.float32)
        return
    rep = [(row, np.flatnonzero(s.seen), p.repetition_penalty)
           for row, s, p in zip(rows, states, params) if s.seen is not None]
    freq = [(row, ids, s.counts[ids], p) for row, s, p in zip(rows, states, params)
            if s.counts is not None and s.folded for ids in [np.flatnonzero(s.counts)]]
    with torch.inference_mode():
        if rep:
            at = _cells(rep, logits.device)
            penalty = _per_cell([(ids, factor) for _, ids, factor in rep], logits)
            values = logits[at]
            logits[at] = torch.where(values < 0, values * penalty, values / penalty)
        if freq:
            at = _cells([(row, ids, None) for row, ids, _, _ in freq], logits.device)
            counts = torch.from_numpy(np.concatenate([c for _, _, c, _ in freq])).to(logits.device, logits.dtype)
            presence = _per_cell([(ids, p.presence_penalty) for _, ids, _, p in freq], logits)
            frequency = _per_cell([(ids, p.frequency_penalty) for _, ids, _, p in freq], logits)
            logits[at] -= presence + frequency * counts


def _cells(items, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, column indices) of every (row, ids, _) item's cells, on `device`."""
    rows = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, ids, _ in items])
    cols = np.concatenate([ids for _, ids, _ in items]).astype(np.int64)
    both = torch.from_numpy(np.stack([rows, cols])).to(device)
    return both[0], both[1]


def _per_cell(items, logits: torch.Tensor) -> torch.Tensor:
    """Each (ids, value) item's value once per id, in logits' dtype and device (a request's penalty, cell by
    cell: the same fp32 products as with the penalty as a scalar)."""
    values = np.concatenate([np.full(len(ids), value, dtype=np.float64) for ids, value in items])
    return torch.from_numpy(values).to(logits.device, logits.dtype)


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Rows (logits - their max) / their temperature in float64: the best token stays at 0, so however small the
    temperature (down to the 1e-5 below which a request is greedy), the rest only underflow towards -inf, never
    NaN."""
    shifted = logits.double() - logits.max(dim=-1, keepdim=True).values.double()
    return shifted / temperature.unsqueeze(-1)


def filter_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                 min_p: list[float] | None = None) -> torch.Tensor:
    """Row by row (rows of `logits` as `scale` leaves them, the best at 0; one top_k, top_p and min_p each):
    tokens less likely than min_p x the best one's probability dropped (vLLM's min_p: e^logit < min_p, before
    top-k and top-p, as vLLM orders them), softmax over the top-k logits, then the smallest prefix, best first,
    whose mass reaches top_p (always >= 1 token). Every row at once, so that on a GPU a step is a few kernels
    whatever its batch: one stable sort of the rows when a filter is on (ties: the lower index first), the ranks
    past k masked, the nucleus cut by the mass of strictly better tokens."""
    rows, n = logits.shape
    if min_p is not None and any(m > 0.0 for m in min_p):
        floor = torch.tensor([math.log(m) if m > 0.0 else -math.inf for m in min_p], dtype=logits.dtype,
                             device=logits.device)
        logits = logits.masked_fill(logits < floor.unsqueeze(-1), float("-inf"))
    ks = [k if 0 < k < n else n for k in top_k]
    if all(k == n for k in ks) and all(p >= 1.0 for p in top_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(n, device=logits.device)
    limit = torch.tensor(ks, device=logits.device).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(rank >= limit, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    nucleus = torch.tensor([p if p < 1.0 else math.inf for p in top_p], dtype=probs.dtype, device=probs.device)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
    probs = probs.masked_fill(before >= nucleus.unsqueeze(-1), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> list[int]:
    """One index a row with probability probs[i] / sum(probs) (non-negative, finite, some positive): the first
    whose running sum passes uniform * the row's total; -1 for a row with no such mass. A zero weight is never
    drawn (the first running sum above the draw is a positive weight's)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1]
    valid = torch.isfinite(total) & (total > 0) & ~(probs < 0).any(dim=-1)
    index = torch.searchsorted(cdf, (uniform * total).unsqueeze(-1), right=True).squeeze(-1)
    n = probs.shape[-1]
    last = n - 1 - torch.argmax(torch.flip(probs > 0, dims=[-1]).to(torch.uint8), dim=-1)  # the last positive
    index = torch.where(index < n, index, last)  # u * total rounded up to the total: the last positive weight
    return torch.where(valid, index, -1).tolist()


NO_MASS = "no probability mass to sample from (non-finite or negative weights)"
