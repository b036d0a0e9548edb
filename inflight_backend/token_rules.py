"""What a request's rules do to its row of logits before sampling, and what it asks to know about them after:
penalties, the min-tokens and bad-word masks, stop token sequences, log-probabilities and raw logits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .models import cpu_ops
from .request import Request, SamplingParams
from .sampler import PenaltyState, apply_penalties, mask_logits


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token's log-probabilities (of the model's raw logits: before penalties, masks and the
    temperature) and, when asked, its raw logits."""

    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens and their log-probabilities
    logits: np.ndarray | None = None  # numpy float32 [vocab]


def apply_logit_rules(logits, sampled: list[Request], eos_ids: tuple[int, ...]) -> None:
    """One pass over the sampled rows: penalties where a request asks for them; below its min_tokens a
    request cannot end: its end ids get -inf logits (transformers' MinNewTokensLengthLogitsProcessor, vLLM's
    min_tokens, TensorRT-LLM's min_length); a bad word's last token gets -inf where it would complete the
    word (transformers' NoBadWordsLogitsProcessor, over prompt and output)."""
    rows: list[int] = []
    ids: list[int] = []
    for row, request in enumerate(sampled):
        p = request.params
        if p.penalized:
            if request.penalties is None:
                request.penalties = PenaltyState(logits.shape[-1], request.prompt_ids, p)
            request.penalties.update(request.output_ids)
            apply_penalties(logits[row], request.penalties, p)
        if len(request.output_ids) < p.min_tokens:
            ends = (p.end_id,) if p.end_id is not None else eos_ids
            ends = () if p.end_id == -1 else ends
            rows += [row] * len(ends)
            ids += ends
        if p.bad_token_seqs:
            banned = banned_tokens(request, p.bad_token_seqs)
            rows += [row] * len(banned)
            ids += banned
    if rows:
        mask_logits(logits, rows, ids)


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


def _tail_equals(request: Request, head: tuple[int, ...]) -> bool:
    n, outs = len(head), request.output_ids
    if len(outs) >= n:
        return tuple(outs[-n:]) == head
    return request.num_tokens >= n and tuple(request.prompt_ids[len(request.prompt_ids) - (n - len(outs)):]
                                             + outs) == head


def token_infos(raw: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenInfo]:
    """token_info of each row of raw (fp32, a row per token); on the CPU the log-probabilities of every row in one
    native call (ops_logprobs_rows_f32: the same log_softmax and top tokens), rows it refuses through torch."""
    lib = cpu_ops.load_library()
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    native = {}
    if lib is not None and wanted and cpu_ops.usable(raw):
        found = cpu_ops.logprobs_rows(lib, raw, wanted, [tokens[row] for row in wanted],
                                      [min(params[row].logprobs or 0, raw.shape[-1]) for row in wanted])
        native = {row: info for row, info in zip(wanted, found) if info is not None}
    infos = []
    for row, (token, p) in enumerate(zip(tokens, params)):
        if row in native:
            logprob, top = native[row]
            infos.append(TokenInfo(logprob, top, raw[row].numpy() if p.return_generation_logits else None))
        else:
            infos.append(token_info(raw[row], token, p))
    return infos


def token_info(raw, token: int, p: SamplingParams) -> TokenInfo:
    """Log-probabilities of one row of raw logits (fp32 log_softmax, as transformers' scores)."""
    logits = raw.cpu().numpy() if p.return_generation_logits else None
    if p.logprobs is None:
        return TokenInfo(logits=logits)
    logprobs = torch.log_softmax(raw, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if p.logprobs:
        values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.numel()))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenInfo(float(logprobs[token]), top, logits)
