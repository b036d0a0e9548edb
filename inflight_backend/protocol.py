"""The Triton-facing protocol: tensor names, types and shapes in and out, and request parsing.

Names follow TensorRT-LLM's ensemble (`text_input`, `max_tokens`, `stream`, ...) so existing clients,
genai-perf and Triton's OpenAI frontend work; TensorRT-LLM's older names are accepted as aliases.
Parsing takes a `get(name) -> numpy array | None` so it runs (and is tested) without Triton.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import math

import numpy as np

from .request import PromptTooLarge, RequestError, SamplingParams

# name: (triton dtype, dims); every input but the prompt is optional.
INPUTS = {
    "text_input": ("TYPE_STRING", [-1]),
    "input_ids": ("TYPE_INT32", [-1]),
    "max_tokens": ("TYPE_INT32", [1]),
    "stream": ("TYPE_BOOL", [1]),
    "temperature": ("TYPE_FP32", [1]),
    "top_k": ("TYPE_INT32", [1]),
    "top_p": ("TYPE_FP32", [1]),
    "seed": ("TYPE_UINT64", [1]),
    "end_id": ("TYPE_INT32", [1]),
    "stop_words": ("TYPE_STRING", [-1]),
    "exclude_input_in_output": ("TYPE_BOOL", [1]),
    "min_tokens": ("TYPE_INT32", [1]),
    "priority": ("TYPE_INT32", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]),
    "frequency_penalty": ("TYPE_FP32", [1]),
    "sampling_parameters": ("TYPE_STRING", [1]),  # vLLM backend: JSON in vLLM SamplingParams names
    "return_finish_reason": ("TYPE_BOOL", [1]),  # vLLM backend: these three are on every final response
    "return_num_input_tokens": ("TYPE_BOOL", [1]),
    "return_num_output_tokens": ("TYPE_BOOL", [1]),
    "return_cumulative_logprob": ("TYPE_BOOL", [1]),  # vLLM backend: not implemented (true is an error)
    "return_logprobs": ("TYPE_BOOL", [1]),
}
NOT_YET = ("return_cumulative_logprob", "return_logprobs")
ALIASES = {  # TensorRT-LLM's other names -> ours
    "streaming": ("stream", ("TYPE_BOOL", [1])),
    "request_output_len": ("max_tokens", ("TYPE_INT32", [1])),
    "runtime_top_k": ("top_k", ("TYPE_INT32", [1])),
    "runtime_top_p": ("top_p", ("TYPE_FP32", [1])),
    "random_seed": ("seed", ("TYPE_UINT64", [1])),
    "min_length": ("min_tokens", ("TYPE_INT32", [1])),
}
OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "output_ids": ("TYPE_INT32", [-1]),
    "finish_reason": ("TYPE_STRING", [1]),
    "num_input_tokens": ("TYPE_INT32", [1]),
    "num_output_tokens": ("TYPE_INT32", [1]),
}
PERF_OUTPUTS = {  # with return_perf_metrics: CLOCK_MONOTONIC nanoseconds of the request's life, on the final response
    "arrival_time_ns": ("TYPE_INT64", [1]),
    "first_scheduled_time_ns": ("TYPE_INT64", [1]),
    "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]),
}


def all_inputs() -> dict[str, tuple[str, list[int]]]:
    return {**INPUTS, **{alias: spec for alias, (_, spec) in ALIASES.items()}}


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """Checked before a prompt is decoded or tokenized, so an oversized one costs nothing."""

    max_bytes: int  # text_input, UTF-8 bytes
    max_tokens: int  # input_ids, and text_input once tokenized


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    priority: int = 0
    return_perf_metrics: bool = False


def parse_request(get: Callable[[str], np.ndarray | None], encode: Callable[[str], list[int]],
                  default_max_tokens: int, limits: PromptLimits, sampling: dict | None = None) -> ParsedRequest:
    """Read a request's inputs; raise RequestError with a message for the client on anything invalid.
    `sampling`: values from vLLM sampling parameters (`vllm_protocol`), by our input names; an input given
    both ways must agree."""
    sampling = sampling or {}

    def value(name, default, kind):
        tensor = tensor_value(name, default, kind)
        if name not in sampling:
            return tensor
        if tensor is not default and tensor != sampling[name]:
            raise RequestError(f"input {name!r} ({tensor}) and the sampling parameters ({sampling[name]}) differ")
        return _number(sampling[name], name, kind)

    def tensor_value(name, default, kind):
        array, given = get(name), name
        if array is None:
            for alias, (target, _) in ALIASES.items():
                if target == name and (array := get(alias)) is not None:
                    given = alias
                    break
        if array is None:
            return default
        if array.size != 1:
            raise RequestError(f"input {given!r} must hold exactly one value, got shape {list(array.shape)}")
        return _number(array.reshape(-1)[0], given, kind)

    prompt_ids, prompt_text = _prompt(get, encode, limits)
    temperature = value("temperature", 0.0, float)
    top_k = value("top_k", 0, int)
    top_p = value("top_p", 1.0, float)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    repetition_penalty = value("repetition_penalty", 1.0, float)
    if repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    params = SamplingParams(
        max_tokens=value("max_tokens", default_max_tokens, int),
        temperature=temperature, top_k=top_k, top_p=top_p,
        seed=value("seed", None, int),
        end_id=value("end_id", None, int),
        stop_words=_strings(get("stop_words")) + tuple(sampling.get("stop_words", ())),
        min_tokens=value("min_tokens", 0, int),
        repetition_penalty=repetition_penalty,
        presence_penalty=value("presence_penalty", 0.0, float),
        frequency_penalty=value("frequency_penalty", 0.0, float),
    )
    for name in NOT_YET:
        if value(name, False, bool):
            raise RequestError(f"input {name!r}: log-probabilities are not implemented yet")
    stream, exclude = value("stream", False, bool), value("exclude_input_in_output", None, bool)
    if stream and exclude is False:  # vLLM backend's rule: a stream carries only what is new
        raise RequestError("exclude_input_in_output=false is not allowed when streaming")
    return ParsedRequest(prompt_ids, prompt_text, params, stream, bool(exclude), value("priority", 0, int),
                         value("return_perf_metrics", False, bool))


def _prompt(get, encode, limits: PromptLimits) -> tuple[list[int], str | None]:
    text, ids = get("text_input"), get("input_ids")
    if text is not None and ids is not None:
        raise RequestError("give either text_input or input_ids, not both")
    if ids is not None:
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input_ids must be integers, got {ids.dtype}")
        _check_tokens(ids.size, limits)
        return ids.reshape(-1).tolist(), None
    if text is None:
        raise RequestError("missing prompt: give text_input (STRING) or input_ids (INT32)")
    if text.size != 1:
        raise RequestError(f"text_input must hold exactly one string, got shape {list(text.shape)}")
    raw = text.reshape(-1)[0]
    size = len(raw) if isinstance(raw, bytes) else len(str(raw).encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise PromptTooLarge(f"text_input is {size} bytes; the limit is {limits.max_bytes} (max_prompt_bytes)")
    prompt = _decode(raw, "text_input")
    if not prompt:
        raise RequestError("empty prompt: text_input is an empty string")
    prompt_ids = encode(prompt)
    _check_tokens(len(prompt_ids), limits)
    return prompt_ids, prompt


def _check_tokens(n: int, limits: PromptLimits) -> None:
    if n > limits.max_tokens:
        raise PromptTooLarge(f"the prompt is {n} tokens; the limit is {limits.max_tokens} (max_prompt_tokens)")


def _number(raw, name: str, kind):
    if isinstance(raw, (bytes, str)):
        raise RequestError(f"input {name!r}: expected a number, got the string {raw!r}")
    if kind is float and not math.isfinite(raw):
        raise RequestError(f"input {name!r} must be a finite number, got {raw}")
    return kind(raw)


def _strings(array) -> tuple[str, ...]:
    if array is None:
        return ()
    return tuple(w for w in (_decode(x, "stop_words") for x in array.reshape(-1)) if w)


def _decode(raw, name: str) -> str:
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8") from None
    return str(raw)
