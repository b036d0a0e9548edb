"""A request's additive logit bias and allowed tokens, from the inputs either client family sends.

TensorRT-LLM: `embedding_bias` (FP32 [vocab], added to the logits; all zeros or empty: none) and its ensemble's
`embedding_bias_words` + `embedding_bias_weights` (each word tokenized as its preprocessing model does, with the
tokenizer's special tokens, and every one of its ids gets the word's weight). vLLM: `logit_bias` ({token id:
bias}, ids as JSON strings or numbers) and `allowed_token_ids` in its sampling parameters. Biases given several
ways add up. Token ids are checked against the vocabulary with the rest of the request (request_limits.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .request import RequestError, SamplingParams

Bias = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class BiasArrays:
    """A request's allowed tokens and logit bias as arrays, made at its first sampled step and kept on the request
    (a dense embedding_bias is a vocabulary of pairs: not to be rebuilt every step)."""

    allowed: np.ndarray | None  # int64 token ids, or None: every token
    tokens: np.ndarray  # int64, distinct
    amounts: np.ndarray  # float32

    @classmethod
    def of(cls, p: SamplingParams) -> BiasArrays:
        n = len(p.logit_bias)
        return cls(np.asarray(p.allowed_token_ids, dtype=np.int64) if p.allowed_token_ids else None,
                   np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64, count=n),
                   np.fromiter((b for _, b in p.logit_bias), dtype=np.float32, count=n))


def from_inputs(get: Callable[[str], np.ndarray | None], encode: Callable[[str], list[int]]) -> dict[int, float]:
    """{token: bias} of TensorRT-LLM's three inputs (empty where they are absent or zero)."""
    bias: dict[int, float] = {}
    dense = get("embedding_bias")
    if dense is not None and dense.size:
        if dense.dtype.kind != "f":
            raise RequestError(f"input 'embedding_bias' must be FP32, got {dense.dtype}")
        values = dense.reshape(-1).astype(np.float64)
        if not np.isfinite(values).all():
            raise RequestError("input 'embedding_bias' must hold finite numbers")
        for token in np.flatnonzero(values).tolist():
            bias[token] = float(values[token])
    words, weights = get("embedding_bias_words"), get("embedding_bias_weights")
    n_words = 0 if words is None else words.size
    n_weights = 0 if weights is None else weights.size
    if n_words != n_weights:
        raise RequestError(f"embedding_bias_words ({n_words}) and embedding_bias_weights ({n_weights}) must have "
                           "the same length")
    if n_words:
        assert words is not None and weights is not None
        for raw, weight in zip(words.reshape(-1), weights.reshape(-1).astype(np.float64).tolist()):
            if not math.isfinite(weight):
                raise RequestError("input 'embedding_bias_weights' must hold finite numbers")
            try:
                word = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            except UnicodeDecodeError:
                raise RequestError("input 'embedding_bias_words' is not valid UTF-8") from None
            for token in encode(word):
                bias[token] = bias.get(token, 0.0) + weight
    return bias


def from_vllm(value) -> dict[int, float]:
    """vLLM's `logit_bias`: a JSON object of token id -> bias."""
    if not isinstance(value, dict):
        raise RequestError(f"vLLM sampling parameter 'logit_bias' must be an object of token id -> bias, got {value!r}")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        try:
            token, amount = int(key), float(raw)
        except (TypeError, ValueError):
            raise RequestError(f"vLLM sampling parameter 'logit_bias': {key!r}: {raw!r} is not token id: "
                               "number") from None
        if not math.isfinite(amount):
            raise RequestError(f"vLLM sampling parameter 'logit_bias': the bias of token {token} must be finite")
        bias[token] = bias.get(token, 0.0) + amount
    return bias


def allowed_from_vllm(value) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids`: a non-empty list of token ids."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"vLLM sampling parameter 'allowed_token_ids' must be a non-empty list of token ids, "
                           f"got {value!r}")
    try:
        return tuple(sorted({int(t) for t in value}))
    except (TypeError, ValueError):
        raise RequestError(f"vLLM sampling parameter 'allowed_token_ids' must hold token ids, got {value!r}") from None


def merged(*biases: dict[int, float]) -> Bias:
    """The sum of several {token: bias}, as sorted (token, bias) pairs; tokens whose biases cancel stay (a
    request that gave a bias is biased)."""
    total: dict[int, float] = {}
    for bias in biases:
        for token, amount in bias.items():
            total[token] = total.get(token, 0.0) + amount
    return tuple(sorted(total.items()))
