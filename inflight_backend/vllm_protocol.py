"""vLLM's Triton backend protocol: sampling parameters as one JSON object in vLLM `SamplingParams` names, sent as
the `sampling_parameters` input (STRING [1]) or as the request's parameters (what Triton also makes of HTTP
`/generate` fields that name no input). Values may be strings ("0.1"), as vLLM's own client sends them.

Every field we implement acts; every other one, given anything but vLLM's default, is an error naming it.
"""
from __future__ import annotations

import json
from typing import Any

from . import logit_bias
from .request import RequestError

# vLLM name -> (our input, type)
SUPPORTED = {"max_tokens": ("max_tokens", int), "n": ("num_return_sequences", int), "min_tokens": ("min_tokens", int),
             "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
             "seed": ("seed", int), "repetition_penalty": ("repetition_penalty", float),
             "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
             "min_p": ("min_p", float)}
# Accepted only at vLLM's default value (None also stands for an empty list).
DEFAULTS = {"best_of": None, "prompt_logprobs": None,
            "detokenize": True, "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "lora_name": None, "truncate_prompt_tokens": None, "structured_outputs": None,
            "guided_decoding": None, "logits_processors": None}
OTHERS = ("stop", "include_stop_str_in_output", "stop_token_ids", "ignore_eos", "logprobs",  # translated below
          "logit_bias", "allowed_token_ids", "bad_words",
          "Streaming")  # TensorRT-LLM's client sends this request parameter beside its `streaming` input


def sampling_parameters(tensor_json: str | None, request_parameters: str) -> dict[str, object]:
    """Our inputs' values from the vLLM sampling parameters of a request (the tensor wins; request parameters
    sent beside it, as vLLM's client does, must agree with it)."""
    given = _object(request_parameters, "the request's parameters")
    given = {k: v for k, v in given.items() if not k.startswith("triton_")}  # Triton's own, never the user's
    if tensor_json is None:
        return translate(given)
    chosen = _object(tensor_json, "sampling_parameters")
    differ = sorted(k for k, v in given.items() if k not in chosen or str(chosen[k]) != str(v))
    if differ:
        raise RequestError(f"request parameter(s) {differ} differ from the sampling_parameters input")
    return translate(chosen)


def translate(fields: dict[str, Any]) -> dict[str, object]:
    unknown = sorted(k for k in fields if k not in SUPPORTED and k not in DEFAULTS and k not in OTHERS)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}: neither an input of this model nor a vLLM sampling "
                           "parameter; nothing was generated")
    unsupported = sorted(k for k, default in DEFAULTS.items() if k in fields and not _is_default(fields[k], default))
    if unsupported:
        raise RequestError(f"vLLM sampling parameter(s) {unsupported} are not supported yet (only their defaults)")
    ours: dict[str, object] = {}
    for name, value in fields.items():
        if name in SUPPORTED:
            target, kind = SUPPORTED[name]
            ours[target] = _convert(value, kind, name)
    if "top_k" in ours and ours["top_k"] == -1:  # vLLM's "off"
        ours["top_k"] = 0
    stop = fields.get("stop")
    if stop not in (None, "", []):
        if not isinstance(stop, (str, list)):
            raise RequestError(f"stop must be a string or a list of strings, got {stop!r}")
        ours["stop_words"] = (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
        ours["include_stop_str_in_output"] = _convert(fields.get("include_stop_str_in_output", False), bool,
                                                      "include_stop_str_in_output")
    if fields.get("stop_token_ids") not in (None, "", []):
        ids = fields["stop_token_ids"]
        if not isinstance(ids, list):
            raise RequestError("vLLM sampling parameter 'stop_token_ids' must be a list of token ids")
        ours["stop_token_ids"] = tuple(_convert(t, int, "stop_token_ids") for t in ids)
    if fields.get("logit_bias") is not None:
        ours["logit_bias"] = logit_bias.from_vllm(fields["logit_bias"])
    if fields.get("allowed_token_ids") is not None:
        ours["allowed_token_ids"] = logit_bias.allowed_from_vllm(fields["allowed_token_ids"])
    if fields.get("bad_words") not in (None, "", []):
        words = fields["bad_words"]
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise RequestError(f"vLLM sampling parameter 'bad_words' must be a list of strings, got {words!r}")
        ours["vllm_bad_words"] = tuple(words)
    if "Streaming" in fields:
        ours["stream"] = _convert(fields["Streaming"], bool, "Streaming")
    if _convert(fields.get("ignore_eos", False), bool, "ignore_eos"):
        ours["ignore_eos"] = True
    if fields.get("logprobs") not in (None, "None", "null"):
        k = _convert(fields["logprobs"], int, "logprobs")
        if not 0 <= k <= MAX_LOGPROBS:
            raise RequestError(f"vLLM sampling parameter 'logprobs' must be in [0, {MAX_LOGPROBS}], got {k}")
        ours["logprobs"] = k
    return ours


MAX_LOGPROBS = 20


def bad_word_sequences(words: tuple[str, ...], encode_word) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad words as token sequences: each word (leading spaces stripped) tokenized without special tokens,
    and again after a space where that gives a different first token in as many tokens (a word starting a text
    and the same word inside one). A word of no tokens bans nothing."""
    seqs = []
    for word in words:
        plain = encode_word(word.lstrip())
        if not plain:
            continue
        seqs.append(tuple(plain))
        spaced = encode_word(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(tuple(spaced))
    return tuple(seqs)


def _object(raw: str | None, what: str) -> dict:
    if not raw:  # absent or empty
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise RequestError(f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object")
    return value


def _convert(value, kind, name: str):
    try:
        if kind is bool:
            return _bool(value)
        return kind(float(value)) if kind is int and isinstance(value, str) and "." in value else kind(value)
    except (TypeError, ValueError):
        raise RequestError(f"vLLM sampling parameter {name!r}: expected {kind.__name__}, got {value!r}") from None


def _bool(value) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(value)
        return value.lower() in ("true", "1")
    return bool(value)


def _is_default(value, default) -> bool:
    if default is None:
        return value in (None, "", [], "None", "null")
    try:
        if isinstance(default, bool):
            return _bool(value) == default
        return float(value) == float(default)
    except (TypeError, ValueError):
        return False
