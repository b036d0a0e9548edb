"""Response tensors: what one response says about one or more sequences, as numpy arrays by output name.

Built in TensorRT-LLM's batched shapes (a row per sequence, a beam axis of 1 on per-token outputs: `output_ids`
[rows, 1, n], scalars [rows, 1], `text_output` [rows]) and reshaped for this backend's unbatched layout by
`unbatched`. A unary response holds every sequence of its request: `stack` pads and joins their rows.
Pure numpy: no Triton here, so it is tested directly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from .outputs import RequestOutput

ALWAYS = ("output_ids", "text_output", "sequence_length", "batch_index", "sequence_index")
TOKEN_AXIS = {"output_ids": 2, "output_log_probs": 2, "generation_logits": 2}  # padded when rows are stacked


@dataclass(slots=True)
class Piece:
    """One sequence's part of a response: new tokens when streaming, all of them otherwise."""

    text: str
    token_ids: list[int]  # output_ids: the prompt's ids first when a non-streamed response echoes it
    generated: list[int]  # the generated tokens among them, which the log-probabilities are for
    batch_index: int
    sequence_index: int
    logprobs: list[float] | None = None
    top: list[tuple[tuple[int, float], ...]] | None = None
    logits: list[np.ndarray] | None = None
    cum_logprob: float = 0.0
    final: RequestOutput | None = None  # the sequence's final output, when this piece ends it
    num_input_tokens: int = 0
    context_logits: np.ndarray | None = None  # [prompt tokens, vocab], on the piece that has it


def tensors(piece: Piece, returns: frozenset[str], perf: bool, wanted: frozenset[str] | None,
            decode_token: Callable[[int], str], kv_blocks: int = 0, shared_blocks: int = 0) -> dict[str, np.ndarray]:
    """One sequence's tensors, in batched shapes, for the outputs the client asked for (None: all)."""
    names = [n for n in (*ALWAYS, *sorted(returns)) if wanted is None or n in wanted]
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name == "output_ids":
            out[name] = np.array(piece.token_ids, dtype=np.int32).reshape(1, 1, -1)
        elif name == "text_output":
            out[name] = np.array([piece.text.encode("utf-8")], dtype=np.object_)
        elif name == "sequence_length":
            out[name] = np.array([[len(piece.token_ids)]], dtype=np.int32)
        elif name == "batch_index":
            out[name] = np.array([[piece.batch_index]], dtype=np.int32)
        elif name == "sequence_index":
            out[name] = np.array([[piece.sequence_index]], dtype=np.int32)
        elif name == "output_log_probs":
            out[name] = np.array(piece.logprobs or [], dtype=np.float32).reshape(1, 1, -1)
        elif name in ("cum_log_probs", "cumulative_logprob"):
            out[name] = np.array([[piece.cum_logprob]], dtype=np.float32)
        elif name == "logprobs":
            out[name] = np.array([_vllm_logprobs(piece, decode_token).encode("utf-8")], dtype=np.object_)
        elif name == "generation_logits" and piece.logits is not None:
            width = piece.logits[0].shape[-1] if piece.logits else 0
            out[name] = np.stack(piece.logits).reshape(1, 1, -1, width) if piece.logits else \
                np.zeros((1, 1, 0, 0), dtype=np.float32)
        elif name == "context_logits" and piece.context_logits is not None:
            out[name] = piece.context_logits[None]
        elif name == "stop_reason":  # as TensorRT-LLM's LLM API: str() of the reason, "None" for none (yet)
            reason = piece.final.stop_reason if piece.final is not None else None
            out[name] = np.array([[str(reason).encode()]], dtype=np.object_)
        elif piece.final is None and name in EVERY_RESPONSE:  # vLLM's values on a response that is not the last
            out[name] = EVERY_RESPONSE[name](piece)
    final = piece.final
    if final is not None:
        # num_output_tokens: the sequence's total, or (asked for with return_num_output_tokens) vLLM's count of
        # the tokens in this response
        count = len(piece.generated) if "num_output_tokens" in returns else final.num_output_tokens
        done = {"finish_reason": lambda: np.array([[(final.finish_reason or "").encode()]], dtype=np.object_),
                "num_input_tokens": lambda: np.array([[final.num_input_tokens]], dtype=np.uint32),
                "num_output_tokens": lambda: np.array([[count]], dtype=np.uint32),
                "num_cached_tokens": lambda: np.array([[final.num_cached_tokens]], dtype=np.uint32)}
        if perf:
            done.update(_perf(final, kv_blocks, shared_blocks))
        out.update({name: make() for name, make in done.items() if wanted is None or name in wanted})
    return out


# With return_finish_reason / return_num_input_tokens / return_num_output_tokens: on every response, as vLLM's
# backend sends them (the final response always has them, counting the whole sequence).
EVERY_RESPONSE = {"finish_reason": lambda piece: np.array([[b"None"]], dtype=np.object_),
                  "num_input_tokens": lambda piece: np.array([[piece.num_input_tokens]], dtype=np.uint32),
                  "num_output_tokens": lambda piece: np.array([[len(piece.generated)]], dtype=np.uint32)}


def stack(parts: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """Several sequences' tensors as one response's rows; per-token outputs padded (output_ids with pad_id)."""
    if len(parts) == 1:
        return parts[0]
    names = [n for n in parts[0] if all(n in p for p in parts)]
    out = {}
    for name in names:
        arrays = [p[name] for p in parts]
        if name == "context_logits":
            length = max(a.shape[1] for a in arrays)
            arrays = [np.pad(a, [(0, 0), (0, length - a.shape[1]), (0, 0)]) for a in arrays]
        elif name in TOKEN_AXIS:
            width = max(a.shape[2] for a in arrays)
            fill = pad_id if name == "output_ids" else 0
            arrays = [np.pad(a, [(0, 0), (0, 0), (0, width - a.shape[2])] + [(0, 0)] * (a.ndim - 3),
                             constant_values=fill) for a in arrays]
            if name == "generation_logits":
                vocab = max(a.shape[3] for a in arrays)
                arrays = [np.pad(a, [(0, 0)] * 3 + [(0, vocab - a.shape[3])]) for a in arrays]
        out[name] = np.concatenate(arrays, axis=0)
    return out


def unbatched(batched: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This backend's unbatched layout: no beam axis; one sequence has no row axis (`output_ids` [n],
    scalars [1]); several keep it (`output_ids` [rows, n], scalars [rows])."""
    out = {}
    for name, array in batched.items():
        rows = array.shape[0]
        if name in TOKEN_AXIS:
            array = array.reshape(array.shape[0], *array.shape[2:])
            out[name] = array[0] if rows == 1 else array
        elif name == "context_logits":
            out[name] = array[0] if rows == 1 else array
        elif array.ndim == 2 and array.shape[1] == 1:
            out[name] = array.reshape(rows)
        else:
            out[name] = array
    return out


def _vllm_logprobs(piece: Piece, decode_token: Callable[[int], str]) -> str:
    """vLLM backend's `logprobs`: per token, {token_id: {logprob, rank, decoded_token}} for the sampled token
    and the top-k; "null" when the request did not ask for log-probabilities."""
    if piece.logprobs is None:
        return "null"
    entries = []
    for token, logprob, top in zip(piece.generated, piece.logprobs, piece.top or [()] * len(piece.generated)):
        ranked = {t: (v, rank) for rank, (t, v) in enumerate(top, start=1)}
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": decode_token(t)} for t, (v, r) in ranked.items()}
        if str(token) not in entry:
            entry[str(token)] = {"logprob": logprob, "rank": None, "decoded_token": decode_token(token)}
        entries.append(entry)
    return json.dumps(entries)


def _nanoseconds(t: float | None) -> Callable[[], np.ndarray]:
    """A timestamp's tensor, in nanoseconds (-1: never happened)."""
    return lambda: np.array([[-1 if t is None else int(t * 1e9)]], dtype=np.int64)


def _perf(final: RequestOutput, kv_blocks: int, shared: int) -> dict[str, Callable[[], np.ndarray]]:
    times = final.times
    stamps = {"arrival_time_ns": times.arrival, "first_scheduled_time_ns": times.first_scheduled,
              "first_token_time_ns": times.first_token, "last_token_time_ns": times.last_token} if times else {}
    made: dict[str, Callable[[], np.ndarray]] = {name: _nanoseconds(t) for name, t in stamps.items()}
    made.update({"kv_cache_alloc_new_blocks": lambda: np.array([[kv_blocks - shared]], dtype=np.int32),
                 "kv_cache_reused_blocks": lambda: np.array([[shared]], dtype=np.int32),
                 "kv_cache_alloc_total_blocks": lambda: np.array([[kv_blocks]], dtype=np.int32),
                 "acceptance_rate": lambda: np.array([[0.0]], dtype=np.float32),
                 "total_accepted_draft_tokens": lambda: np.array([[0]], dtype=np.int32),
                 "total_draft_tokens": lambda: np.array([[0]], dtype=np.int32)})
    return made
