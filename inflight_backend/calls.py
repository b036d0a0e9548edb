"""A Triton request (a call: B rows x num_return_sequences sequences) and what each of its sequences has
accumulated; the piece of a response that each engine output makes (`responses.py` turns pieces into tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .coalesce import merge
from .outputs import RequestOutput
from .responses import Piece


@dataclass(slots=True, eq=False)
class Call:
    """One Triton request: its sender and its sequences (B rows x num_return_sequences) still running."""

    key: str
    sender: Any  # pb_utils.InferenceResponseSender (exists only inside Triton)
    stream: bool
    # Exactly one response, holding every sequence: unary calls (a non-decoupled model), and non-streamed calls
    # in the unbatched layout (Triton's /generate takes exactly one response; vLLM's backend sends n texts in one)
    whole: bool
    batched: bool  # TensorRT-LLM's layout: responses keep the batch and beam axes
    outputs: frozenset[str] | None  # the outputs the client asked for; None: all of them
    open: set[str] = field(default_factory=set)  # its sequences' ids not finished yet
    parts: list = field(default_factory=list)  # whole: each finished sequence's tensors
    error: str | None = None  # whole: the first sequence error (the one response carries it)
    pad_id: int = 0
    closed: bool = False  # its FINAL is about to go or went: never ask is_cancelled() again (open_calls.py)


@dataclass(slots=True, eq=False)
class Sequence:
    """One engine request of a call: where its outputs go and, when not streaming, what has accumulated."""

    call: Call
    batch_index: int
    sequence_index: int
    prefix_text: str  # prompt text prepended to a non-streamed output (exclude_input_in_output=false)
    prefix_ids: list[int]
    arrival: float  # time.monotonic() when execute() received it
    returns: frozenset[str]
    return_perf_metrics: bool
    num_input_tokens: int
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: list | None = None
    logits: list | None = None
    context_logits: np.ndarray | None = None
    cum_logprob: float = 0.0
    first_token_seen: bool = False
    stream_interval: int = 1
    pending: RequestOutput | None = None  # stream_interval > 1: outputs merged, not sent yet


def held_back(seq: Sequence, out: RequestOutput) -> RequestOutput | None:
    """A stream with stream_interval N: `out` merged with what it holds; None while that is under N tokens and
    the sequence goes on (it is held), else the output to send now."""
    if seq.pending is not None:
        out, seq.pending = merge(seq.pending, out), None
    if out.finished or len(out.token_ids) >= seq.stream_interval:
        return out
    seq.pending = out
    return None


def accumulate(seq: Sequence, out: RequestOutput) -> None:
    """A non-streamed sequence keeps everything until its final output."""
    seq.texts.append(out.text)
    seq.ids += out.token_ids
    accumulate_info(seq, out)


def accumulate_info(seq: Sequence, out: RequestOutput) -> None:
    """Keep what a response may need of the tokens so far: log-probabilities, logits, the prompt's logits."""
    if out.context_logits is not None:
        seq.context_logits = out.context_logits
    info = out.token_info
    if info is None:
        return
    if info.logprob is not None:
        if seq.logprobs is None or seq.top is None:
            seq.logprobs, seq.top = [], []
        seq.logprobs.append(info.logprob)
        seq.top.append(info.top)
        seq.cum_logprob += info.logprob
    if info.logits is not None and not seq.call.stream:  # a stream sends each token's logits once
        if seq.logits is None:
            seq.logits = []
        seq.logits.append(info.logits)


def piece_of(seq: Sequence, out: RequestOutput, text: str, ids: list[int], accumulated: bool) -> Piece:
    """This sequence's part of a response (new tokens when streaming, all when not). TensorRT-LLM's batched
    layout streams as TensorRT-LLM does: every response carries the prompt's logits and the log-probabilities of
    all tokens so far; the unbatched one sends each once."""
    piece = Piece(text, ids, seq.ids if accumulated else ids, seq.batch_index, seq.sequence_index,
                  final=out if out.finished else None, num_input_tokens=seq.num_input_tokens)
    if not seq.returns:
        return piece
    so_far = accumulated or seq.call.batched
    if not accumulated:
        accumulate_info(seq, out)
        if so_far:
            seq.ids += out.token_ids
    piece.context_logits = seq.context_logits if so_far else out.context_logits
    if so_far:
        piece.logprobs, piece.top = seq.logprobs, seq.top
        if not accumulated:  # the log-probabilities are of every token so far, not only this response's
            piece.generated = seq.ids
    elif out.token_info is not None and out.token_info.logprob is not None:
        piece.logprobs, piece.top = [out.token_info.logprob], [out.token_info.top]
    if accumulated:
        piece.logits = seq.logits
    elif out.token_info is not None and out.token_info.logits is not None:
        piece.logits = [out.token_info.logits]
    piece.cum_logprob = seq.cum_logprob
    return piece
