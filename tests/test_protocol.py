import numpy as np
import pytest

from inflight_backend.protocol import PromptLimits, parse_request
from inflight_backend.vllm_protocol import sampling_parameters
from inflight_backend.request import RequestError

LIMITS = PromptLimits(max_bytes=100, max_tokens=50)


def parse(encode=None, sampling=None, **inputs):
    arrays = {k: (v if isinstance(v, np.ndarray) else np.array([v])) for k, v in inputs.items()}
    return parse_request(arrays.get, encode or (lambda text: [256] + list(text.encode())), default_max_tokens=16,
                         limits=LIMITS, sampling=sampling)


def test_defaults_are_greedy_non_streaming():
    p = parse(text_input=np.array([b"hi"], dtype=object))
    assert p.prompt_ids == [256, 104, 105] and p.prompt_text == "hi"
    assert p.params.max_tokens == 16 and p.params.greedy and not p.stream and not p.exclude_input_in_output


def test_tensorrt_llm_aliases_are_accepted():
    p = parse(input_ids=np.array([5, 6], dtype=np.int32), request_output_len=np.array([3], dtype=np.int32),
              streaming=np.array([True]), runtime_top_k=np.array([4], dtype=np.int32),
              runtime_top_p=np.array([0.5], dtype=np.float32), random_seed=np.array([9], dtype=np.uint64),
              temperature=np.array([0.7], dtype=np.float32))
    assert p.prompt_ids == [5, 6] and p.stream
    assert (p.params.max_tokens, p.params.top_k, p.params.top_p, p.params.seed) == (3, 4, 0.5, 9)


def test_stop_words_are_read_as_strings():
    p = parse(text_input=np.array([b"hi"], dtype=object), stop_words=np.array([b"x", b"yz"], dtype=object))
    assert p.params.stop_words == ("x", "yz")


@pytest.mark.parametrize("inputs, message", [
    ({}, "missing prompt"),
    ({"text_input": np.array([b""], dtype=object)}, "empty prompt"),
    ({"text_input": np.array([b"a"], dtype=object), "temperature": np.array([-1.0])}, "temperature"),
    ({"text_input": np.array([b"a"], dtype=object), "top_p": np.array([0.0])}, "top_p"),
    ({"text_input": np.array([b"a"], dtype=object), "top_p": np.array([1.5])}, "top_p"),
    ({"text_input": np.array([b"a"], dtype=object), "top_k": np.array([-2])}, "top_k"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "exactly one string"),
    ({"text_input": np.array([b"a"], dtype=object), "max_tokens": np.array([1, 2])}, "exactly one value"),
    ({"input_ids": np.array([1.5])}, "integers"),
    ({"text_input": np.array([b"\xff"], dtype=object)}, "UTF-8"),
    ({"text_input": np.array([b"a"], dtype=object), "temperature": np.array([np.nan], dtype=np.float32)},
     "'temperature' must be a finite number"),
    ({"text_input": np.array([b"a"], dtype=object), "temperature": np.array([np.inf], dtype=np.float32)},
     "'temperature' must be a finite number"),
    ({"text_input": np.array([b"a"], dtype=object), "runtime_top_p": np.array([np.nan], dtype=np.float32)},
     "'runtime_top_p' must be a finite number"),
    ({"text_input": np.array([b"a"], dtype=object), "max_tokens": np.array([b"3"], dtype=object)}, "'max_tokens'"),
    ({"text_input": np.array([b"x" * 101], dtype=object)}, r"101 bytes; the limit is 100 \(max_prompt_bytes\)"),
    ({"text_input": np.array([b"x" * 60], dtype=object)}, r"61 tokens; the limit is 50 \(max_prompt_tokens\)"),
    ({"input_ids": np.arange(51, dtype=np.int32)}, r"51 tokens; the limit is 50"),
])
def test_bad_inputs_raise_a_clear_error(inputs, message):
    with pytest.raises(RequestError, match=message):
        parse(**inputs)


def test_an_oversized_prompt_is_refused_before_it_is_tokenized():
    calls = []
    with pytest.raises(RequestError, match="max_prompt_bytes"):
        parse(encode=calls.append, text_input=np.array(["é" * 51], dtype=object))  # 102 UTF-8 bytes
    assert calls == []
    assert parse(text_input=np.array(["é" * 24], dtype=object)).prompt_ids[1:3] == list("é".encode())


def test_subnormal_and_tiny_temperatures_are_accepted_and_greedy():
    for t in (1e-45, 1e-40, 1e-6):
        p = parse(text_input=np.array([b"a"], dtype=object), temperature=np.array([t], dtype=np.float32))
        assert p.params.greedy


def test_unknown_fields_are_refused_by_name():
    assert sampling_parameters(None, "{}") == {}
    assert sampling_parameters(None, '{"triton_enable_empty_final_response": true}') == {}
    with pytest.raises(RequestError, match=r"unknown field\(s\) \['beam_width', 'max_token'\]"):
        sampling_parameters(None, '{"max_token": 100, "beam_width": 4}')


def test_vllm_sampling_parameters_as_vllms_client_sends_them():
    sent = '{"temperature": "0.1", "top_p": "0.95", "max_tokens": "100", "top_k": -1, "n": "1"}'
    ours = sampling_parameters(sent, sent)  # the tensor, and the same as request parameters
    assert ours == {"temperature": 0.1, "top_p": 0.95, "max_tokens": 100, "top_k": 0}
    p = parse(text_input=np.array([b"hi"], dtype=object), sampling=ours)
    assert (p.params.max_tokens, p.params.temperature, p.params.top_p, p.params.top_k) == (100, 0.1, 0.95, 0)
    stop = sampling_parameters('{"stop": ["x", "yz"], "include_stop_str_in_output": true}', "{}")
    assert stop == {"stop_words": ("x", "yz")}


@pytest.mark.parametrize("tensor, params, message", [
    ('{"n": 2}', "{}", r"\['n'\] are not supported"),
    ('{"min_p": "0.5", "logprobs": 3}', "{}", r"\['logprobs', 'min_p'\] are not supported"),
    ('{"stop": "x"}', "{}", "include_stop_str_in_output"),
    ('{"max_tokens": "many"}', "{}", "'max_tokens': expected int"),
    ('{"max_tokens": 5}', '{"max_tokens": 6}', r"\['max_tokens'\] differ"),
    ('[1, 2]', "{}", "must be a JSON object"),
    ("{", "{}", "not valid JSON"),
])
def test_vllm_sampling_parameters_we_cannot_honour_are_errors(tensor, params, message):
    with pytest.raises(RequestError, match=message):
        sampling_parameters(tensor, params)


def test_an_input_given_twice_must_agree_and_streams_never_echo_the_prompt():
    with pytest.raises(RequestError, match="'max_tokens' .* differ"):
        parse(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], dtype=np.int32),
              sampling={"max_tokens": 6})
    assert parse(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([6], dtype=np.int32),
                 sampling={"max_tokens": 6}).params.max_tokens == 6
    with pytest.raises(RequestError, match="not allowed when streaming"):
        parse(text_input=np.array([b"hi"], dtype=object), stream=np.array([True]),
              exclude_input_in_output=np.array([False]))
    with pytest.raises(RequestError, match="'return_logprobs'"):
        parse(text_input=np.array([b"hi"], dtype=object), return_logprobs=np.array([True]))
