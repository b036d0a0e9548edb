"""Request parsing: a request's inputs (by the names `declared_io.py` declares) into a ParsedRequest, or a
RequestError naming what is wrong.

TensorRT-LLM's other names (`input_ids`, `request_output_len`, `runtime_top_k`, ...) and its LLM-API model's
`sampling_param_*` are aliases, so existing clients, genai-perf and Triton's OpenAI frontend work. The inputs we
implement act; the others (`UNSUPPORTED`) pass only at their default and are otherwise an error naming them.
`trtllm_layout.py` splits a batched request into rows of this layout.

Parsing takes a `get(name) -> numpy array | None` so it runs (and is tested) without Triton.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np

from . import logit_bias
from .declared_io import ALIASES, UNSUPPORTED
from .vllm_protocol import bad_word_sequences
from .request import PromptLimits, PromptTooLarge, RequestError, SamplingParams


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    priority: int = 0
    return_perf_metrics: bool = False
    num_return_sequences: int = 1
    returns: frozenset[str] = field(default_factory=frozenset)  # optional outputs asked for (see RETURNS)
    pad_id: int = 0
    stream_interval: int = 1  # fewest tokens per streamed response (the last one: whatever is left)


# return_* input -> the outputs it adds
RETURNS = {"return_log_probs": ("output_log_probs", "cum_log_probs"), "return_cumulative_logprob":
           ("cumulative_logprob",), "return_logprobs": ("logprobs",), "return_stop_reason": ("stop_reason",),
           "return_generation_logits": ("generation_logits",), "return_context_logits": ("context_logits",),
           "return_finish_reason": ("finish_reason",), "return_num_input_tokens": ("num_input_tokens",),
           "return_num_output_tokens": ("num_output_tokens",)}


def parse_request(get: Callable[[str], np.ndarray | None], encode: Callable[[str], list[int]],
                  default_max_tokens: int, limits: PromptLimits, sampling: dict | None = None,
                  encode_word: Callable[[str], list[int]] | None = None, batched: bool = False,
                  chat: Callable[[list[dict]], tuple[str, list[int]]] | None = None) -> ParsedRequest:
    """Read a request's inputs; raise RequestError with a message for the client on anything invalid.
    `sampling`: values from vLLM sampling parameters (`vllm_protocol`), by our input names; an input given
    both ways must agree. `encode_word` tokenizes a bad word without special tokens. `batched`: a row of
    TensorRT-LLM's batched layout, where exclude_input_in_output applies to non-streamed responses only (a stream
    never echoes the prompt; the unbatched layout follows vLLM's backend, which refuses the combination).
    `chat(messages) -> (text, ids)` renders and tokenizes a `messages` request with the chat template."""
    read = _Reader(get, sampling or {})
    _check_unsupported(get)
    prompt_ids, prompt_text = _prompt(get, encode, limits, chat)
    returns = frozenset(out for flag, outs in RETURNS.items() if read.value(flag, False, bool) for out in outs)
    params = _sampling_params(read, default_max_tokens, returns, encode_word, encode)
    stream, exclude = read.value("stream", False, bool), read.value("exclude_input_in_output", None, bool)
    if stream and exclude is False and not batched:  # vLLM backend's rule (and message): a stream carries only news
        raise RequestError("Error generating stream: When streaming, `exclude_input_in_output` = False is not "
                           "allowed.")
    n = read.value("num_return_sequences", 1, int)
    if not 1 <= n <= MAX_RETURN_SEQUENCES:
        raise RequestError(f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], got {n}")
    return ParsedRequest(prompt_ids, prompt_text, params, stream, bool(exclude), read.value("priority", 0, int),
                         read.value("return_perf_metrics", False, bool), n, returns, read.value("pad_id", 0, int),
                         _stream_interval(read, stream, params))


def _stream_interval(read: _Reader, stream: bool, params: SamplingParams) -> int:
    interval = read.value("stream_interval", 1, int)
    if interval == 1:
        return 1
    if not 1 <= interval <= MAX_STREAM_INTERVAL:
        raise RequestError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {interval}")
    if not stream:
        raise RequestError("stream_interval applies to streamed requests only (stream=true)")
    if params.needs_raw_logits:
        raise RequestError("stream_interval > 1 cannot be combined with per-token log-probabilities or logits "
                           "(each token's values go in its own response)")
    return interval


class _Reader:
    """One-value inputs by our name or an alias, and the vLLM sampling parameters' value (both must agree)."""

    def __init__(self, get, sampling: dict) -> None:
        self.get, self.sampling = get, sampling

    def value(self, name: str, default, kind):
        tensor = self.tensor_value(name, default, kind)
        if name not in self.sampling:
            return tensor
        if tensor is not default and tensor != self.sampling[name]:
            raise RequestError(f"input {name!r} ({tensor}) and the sampling parameters ({self.sampling[name]}) "
                               "differ")
        return _number(self.sampling[name], name, kind)

    def tensor_value(self, name: str, default, kind):
        array, given = _get(self.get, name)
        if array is None:
            return default
        if array.size != 1:
            raise RequestError(f"input {given!r} must hold exactly one value, got shape {list(array.shape)}")
        return _number(array.reshape(-1)[0], given, kind)


def _sampling_params(read: _Reader, default_max_tokens: int, returns: frozenset[str], encode_word,
                     encode) -> SamplingParams:
    get, sampling = read.get, read.sampling
    temperature = read.value("temperature", 0.0, float)
    top_k = read.value("top_k", 0, int)
    top_p = read.value("top_p", 1.0, float)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")
    if top_p == 0.0 and _get(get, "top_p")[0] is not None:
        top_p = 1.0  # TensorRT-LLM's clients send runtime_top_p 0 for "no top-p"
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    repetition_penalty = read.value("repetition_penalty", 1.0, float)
    if repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    min_p = read.value("min_p", 0.0, float)
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}")
    end_id = read.value("end_id", None, int)
    logprobs = sampling.get("logprobs")
    if logprobs is None and returns & {"output_log_probs", "cumulative_logprob"}:
        logprobs = 0
    return SamplingParams(
        max_tokens=read.value("max_tokens", default_max_tokens, int),
        temperature=temperature, top_k=top_k, top_p=top_p,
        seed=read.value("seed", None, int),
        end_id=-1 if sampling.get("ignore_eos") else end_id,
        stop_words=_strings(get, "stop_words") + tuple(sampling.get("stop_words", ())),
        min_tokens=read.value("min_tokens", 0, int),
        repetition_penalty=repetition_penalty,
        presence_penalty=read.value("presence_penalty", 0.0, float),
        frequency_penalty=read.value("frequency_penalty", 0.0, float),
        stop_token_seqs=_word_list(get, "stop_words_list") + tuple((t,) for t in sampling.get("stop_token_ids", ())),
        bad_token_seqs=_word_list(get, "bad_words_list") + _bad_words(get, encode_word),
        bad_output_seqs=_vllm_bad_words(sampling.get("vllm_bad_words", ()), encode_word),
        logprobs=logprobs,
        return_generation_logits="generation_logits" in returns,
        return_context_logits="context_logits" in returns,
        include_stop_str_in_output=bool(sampling.get("include_stop_str_in_output", True)),
        logit_bias=logit_bias.merged(logit_bias.from_inputs(get, encode), sampling.get("logit_bias", {})),
        allowed_token_ids=sampling.get("allowed_token_ids", ()),
        min_p=min_p,
    )


MAX_RETURN_SEQUENCES = 64
MAX_STREAM_INTERVAL = 4096


def _get(get, name: str) -> tuple[np.ndarray | None, str]:
    """An input by our name or any alias of it, and the name the client used."""
    array = get(name)
    if array is not None:
        return array, name
    for alias, (target, _) in ALIASES.items():
        if target == name and (array := get(alias)) is not None:
            return array, alias
    return None, name


def _check_unsupported(get) -> None:
    for name, (_, _, default) in UNSUPPORTED.items():
        array = get(name)
        if array is None or array.size == 0:
            continue
        if default is not None:
            values = array.reshape(-1)
            if all(_decode(v, name) == default if isinstance(v, bytes) else v == default for v in values):
                continue
        shown = array.reshape(-1)[:4].tolist()
        raise RequestError(f"input {name!r} is not supported (only its default "
                           f"{'(absent or empty)' if default is None else repr(default)} is); got {shown}")


def _prompt(get, encode, limits: PromptLimits, chat=None) -> tuple[list[int], str | None]:
    text, ids, messages = get("text_input"), get("input_ids"), get("messages")
    if sum(x is not None for x in (text, ids, messages)) > 1:
        raise RequestError("give one of text_input, input_ids and messages")
    if messages is not None:
        return _chat_prompt(messages, chat, limits)
    if ids is not None:
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input_ids must be integers, got {ids.dtype}")
        ids = ids.reshape(-1)
        lengths = get("input_lengths")
        if lengths is not None:
            if lengths.size != 1 or not 1 <= int(lengths.reshape(-1)[0]) <= ids.size:
                raise RequestError(f"input_lengths ({lengths.reshape(-1).tolist()}) must be one value in "
                                   f"[1, {ids.size}] (the length of input_ids)")
            ids = ids[:int(lengths.reshape(-1)[0])]
        _check_tokens(ids.size, limits)
        return ids.tolist(), None
    if text is None:
        raise RequestError("missing prompt: give text_input (STRING) or input_ids (INT32)")
    if get("input_lengths") is not None:
        raise RequestError("input_lengths goes with input_ids, not text_input")
    prompt = _limited_string(text, "text_input", limits)
    if not prompt:
        raise RequestError("empty prompt: text_input is an empty string")
    prompt_ids = encode(prompt)
    _check_tokens(len(prompt_ids), limits)
    return prompt_ids, prompt


def _chat_prompt(messages, chat, limits: PromptLimits) -> tuple[list[int], str]:
    from .chat import parse_messages

    if chat is None:
        raise RequestError("input 'messages': this model's checkpoint has no chat template (tokenizer_config.json)")
    text, ids = chat(parse_messages(_limited_string(messages, "messages", limits)))
    _check_tokens(len(ids), limits)
    return ids, text


def _limited_string(array, name: str, limits: PromptLimits) -> str:
    """The one string of a prompt input, its size checked before it is decoded."""
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one string, got shape {list(array.shape)}")
    raw = array.reshape(-1)[0]
    size = len(raw) if isinstance(raw, bytes) else len(str(raw).encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise PromptTooLarge(f"{name} is {size} bytes; the limit is {limits.max_bytes} (max_prompt_bytes)")
    return _decode(raw, name)


def _check_tokens(n: int, limits: PromptLimits) -> None:
    if n > limits.max_tokens:
        raise PromptTooLarge(f"the prompt is {n} tokens; the limit is {limits.max_tokens} (max_prompt_tokens)")


def _number(raw, name: str, kind):
    if isinstance(raw, (bytes, str)):
        raise RequestError(f"input {name!r}: expected a number, got the string {raw!r}")
    if kind is float and not math.isfinite(raw):
        raise RequestError(f"input {name!r} must be a finite number, got {raw}")
    return kind(raw)


def _strings(get, name: str) -> tuple[str, ...]:
    array, given = _get(get, name)
    if array is None:
        return ()
    return tuple(w for w in (_decode(x, given) for x in array.reshape(-1)) if w)


def _bad_words(get, encode_word) -> tuple[tuple[int, ...], ...]:
    words = _strings(get, "bad_words")
    if words and encode_word is None:
        raise RequestError("input 'bad_words' needs a tokenizer")
    return tuple(seq for seq in (tuple(encode_word(w)) for w in words) if seq)


def _vllm_bad_words(words, encode_word) -> tuple[tuple[int, ...], ...]:
    if words and encode_word is None:
        raise RequestError("vLLM sampling parameter 'bad_words' needs a tokenizer")
    return bad_word_sequences(words, encode_word)


def _word_list(get, name: str) -> tuple[tuple[int, ...], ...]:
    """TensorRT-LLM's word list [2, L]: row 0 the words' token ids one after another, row 1 each word's end
    offset into row 0, padded with -1 (row 0 is padded with anything)."""
    array = get(name)
    if array is None or array.size == 0:
        return ()
    if array.dtype.kind not in "iu" or array.ndim < 2 or array.shape[-2] != 2 or array.size != 2 * array.shape[-1]:
        raise RequestError(f"input {name!r} must be INT32 [2, n] (token ids, end offsets), got "
                           f"{array.dtype} {list(array.shape)}")
    ids, offsets = array.reshape(2, -1).tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise RequestError(f"input {name!r}: offset {end} does not follow {start} within {len(ids)} ids")
        words.append(tuple(ids[start:end]))
        start = end
    return tuple(words)


def _decode(raw, name: str) -> str:
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8") from None
    return str(raw)
