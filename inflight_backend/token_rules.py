"""What a request's rules do to its row of logits before sampling, and what it asks to know about them after:
penalties, the min-tokens and bad-word masks, stop token sequences, log-probabilities and raw logits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .logit_bias import BiasArrays
from .models import cpu_ops
from .request import Request, SamplingParams
from .sampler import PenaltyState, apply_penalties, mask_logits, numpy_view_ok


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token's log-probabilities (of the model's raw logits: before penalties, masks and the
    temperature) and, when asked, its raw logits."""

    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens and their log-probabilities
    logits: np.ndarray | None = None  # numpy float32 [vocab]


def apply_logit_rules(logits, sampled: list[Request], eos_ids: tuple[int, ...]) -> None:
    """One pass over the sampled rows, in vLLM's order: a request's allowed tokens and logit bias first;
    penalties where a request asks for them; below its min_tokens a request cannot end: its end ids get -inf
    logits (transformers' MinNewTokensLengthLogitsProcessor, vLLM's min_tokens, TensorRT-LLM's min_length); a
    bad word's last token gets -inf where it would complete the word (transformers' NoBadWordsLogitsProcessor,
    over prompt and output; vLLM's bad words over the output alone). (The masks commute with the rest: -inf
    stays -inf.)"""
    rows: list[int] = []
    ids: list[int] = []
    biased: list[int] = []
    penalized: list[int] = []
    states: list[PenaltyState] = []
    for row, request in enumerate(sampled):
        p = request.params
        if not p.logit_rules:
            continue
        if p.biased:
            biased.append(row)
        if p.penalized:
            if request.penalties is None:
                request.penalties = PenaltyState(logits.shape[-1], request.prompt_ids, p)
            request.penalties.update(request.output_ids)
            penalized.append(row)
            states.append(request.penalties)
        if len(request.output_ids) < p.min_tokens:
            ends = (p.end_id,) if p.end_id is not None else eos_ids
            ends = () if p.end_id == -1 else ends
            rows += [row] * len(ends)
            ids += ends
        if p.bad_token_seqs:
            banned = banned_tokens(request, p.bad_token_seqs)
            rows += [row] * len(banned)
            ids += banned
        if p.bad_output_seqs:
            banned = banned_in_output(request.output_ids, p.bad_output_seqs)
            rows += [row] * len(banned)
            ids += banned
    if biased:
        apply_bias(logits, biased, [sampled[row] for row in biased])
    if penalized:  # before the masks, as transformers' processors run
        apply_penalties(logits, penalized, states, [sampled[row].params for row in penalized])
    if rows:
        mask_logits(logits, rows, ids)


def apply_bias(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    """In place: every token outside a row's allowed_token_ids (when it has them) to -inf, then its logit bias
    added (fp32 sums, as torch's). On the CPU through numpy's view of the same memory."""
    biases = []
    for request in requests:
        if request.bias is None:
            request.bias = BiasArrays.of(request.params)
        biases.append(request.bias)
    if numpy_view_ok(logits):
        view = logits.numpy()
        for row, b in zip(rows, biases):
            if b.allowed is not None:
                kept = view[row, b.allowed]
                view[row] = -np.inf
                view[row, b.allowed] = kept
            view[row, b.tokens] += b.amounts
        return
    with torch.inference_mode():
        for row, b in zip(rows, biases):
            if b.allowed is not None:
                allowed = torch.from_numpy(b.allowed).to(logits.device)
                values = logits[row, allowed]
                logits[row] = float("-inf")
                logits[row, allowed] = values
            if len(b.tokens):
                at = torch.from_numpy(b.tokens).to(logits.device)
                logits[row, at] += torch.from_numpy(b.amounts).to(logits.device, logits.dtype)


def ends_with(tokens: list[int], seq: tuple[int, ...]) -> bool:
    return len(tokens) >= len(seq) and tuple(tokens[-len(seq):]) == seq


def banned_tokens(request: Request, seqs: tuple[tuple[int, ...], ...]) -> list[int]:
    """The last token of every bad word whose other tokens end the request's tokens so far."""
    out = []
    for seq in seqs:
        head = seq[:-1]
        if not head or _tail_equals(request, head):
            out.append(seq[-1])
    return out


def banned_in_output(outputs: list[int], seqs: tuple[tuple[int, ...], ...]) -> list[int]:
    """vLLM's rule: the last token of every bad word whose other tokens end the output (the prompt not counted)."""
    return [seq[-1] for seq in seqs if len(seq) == 1 or ends_with(outputs, seq[:-1])]


def _tail_equals(request: Request, head: tuple[int, ...]) -> bool:
    n, outs = len(head), request.output_ids
    if len(outs) >= n:
        return tuple(outs[-n:]) == head
    return request.num_tokens >= n and tuple(request.prompt_ids[len(request.prompt_ids) - (n - len(outs)):]
                                             + outs) == head


def token_infos(raw: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenInfo]:
    """What each row's request asked to know about its token (`raw`: the rows' logits, fp32, before penalties,
    masks and temperature): log-probabilities (log_softmax, as transformers' scores) of the token and of the
    most likely ones, the raw logits. On the CPU the log-probabilities of every row in one native call
    (ops_logprobs_rows_f32); rows it refuses (NaN, +inf) and other devices through torch, all rows at once."""
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    top = [min(params[row].logprobs or 0, raw.shape[-1]) for row in wanted]
    found: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = {}
    lib = cpu_ops.load_library()
    if lib is not None and wanted and cpu_ops.usable(raw):
        native = cpu_ops.logprobs_rows(lib, raw, wanted, [tokens[row] for row in wanted], top)
        found = {row: info for row, info in zip(wanted, native) if info is not None}
    rest = [(row, k) for row, k in zip(wanted, top) if row not in found]
    if rest:
        found.update(_torch_logprobs(raw, rest, tokens))
    with_logits = [row for row, p in enumerate(params) if p.return_generation_logits]
    logits = dict(zip(with_logits, raw[with_logits].cpu().numpy())) if with_logits else {}
    return [TokenInfo(*found[row], logits.get(row)) if row in found else TokenInfo(logits=logits.get(row))
            for row in range(len(params))]


def _torch_logprobs(raw: torch.Tensor, rows: list[tuple[int, int]], tokens: list[int]
                    ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """{row: (the token's log-probability, its k most likely (token, log-probability))} for (row, k) in `rows`,
    through torch's log_softmax and topk over all of them at once (one device sync, not one a row)."""
    index = torch.tensor([row for row, _ in rows], device=raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[row]] for row, _ in rows], device=raw.device))
    most = max(k for _, k in rows)
    values, ids = torch.topk(logprobs, most) if most else (logprobs[:, :0], logprobs[:, :0].long())
    chosen_list, values_list, ids_list = chosen.squeeze(1).tolist(), values.tolist(), ids.tolist()
    return {row: (chosen_list[j], tuple(zip(ids_list[j][:k], values_list[j][:k]))) for j, (row, k) in enumerate(rows)}
