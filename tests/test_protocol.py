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
    ({"text_input": np.array([b"a"], dtype=object), "top_p": np.array([-0.1])}, "top_p"),
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
    assert ours == {"temperature": 0.1, "top_p": 0.95, "max_tokens": 100, "top_k": 0, "num_return_sequences": 1}
    p = parse(text_input=np.array([b"hi"], dtype=object), sampling=ours)
    assert (p.params.max_tokens, p.params.temperature, p.params.top_p, p.params.top_k) == (100, 0.1, 0.95, 0)
    stop = sampling_parameters('{"stop": ["x", "yz"], "include_stop_str_in_output": true}', "{}")
    assert stop == {"stop_words": ("x", "yz"), "include_stop_str_in_output": True}
    assert sampling_parameters('{"stop": "x"}', "{}")["include_stop_str_in_output"] is False  # vLLM's default
    more = sampling_parameters('{"logprobs": "3", "stop_token_ids": [5, 7], "ignore_eos": true}', "{}")
    p = parse(text_input=np.array([b"hi"], dtype=object), sampling=more)
    assert p.params.logprobs == 3 and p.params.stop_token_seqs == ((5,), (7,)) and p.params.end_id == -1


@pytest.mark.parametrize("tensor, params, message", [
    ('{"best_of": 2}', "{}", r"\['best_of'\] are not supported"),
    ('{"truncate_prompt_tokens": 5, "prompt_logprobs": 3}', "{}",
     r"\['prompt_logprobs', 'truncate_prompt_tokens'\] are not supported"),
    ('{"logit_bias": [5]}', "{}", "'logit_bias' must be an object of token id -> bias"),
    ('{"logit_bias": {"x": 1}}', "{}", "'logit_bias': 'x': 1 is not token id: number"),
    ('{"allowed_token_ids": []}', "{}", "'allowed_token_ids' must be a non-empty list"),
    ('{"logprobs": 99}', "{}", "'logprobs' must be in"),
    ('{"max_tokens": "many"}', "{}", "'max_tokens': expected int"),
    ('{"max_tokens": 5}', '{"max_tokens": 6}', r"\['max_tokens'\] differ"),
    ('[1, 2]', "{}", "must be a JSON object"),
    ("{", "{}", "not valid JSON"),
    ('{"stop": 5}', "{}", "stop must be a string or a list of strings, got 5"),
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
    with pytest.raises(RequestError, match="When streaming, `exclude_input_in_output` = False is not allowed"):
        parse(text_input=np.array([b"hi"], dtype=object), stream=np.array([True]),
              exclude_input_in_output=np.array([False]))
    assert parse(text_input=np.array([b"hi"], dtype=object), return_logprobs=np.array([True])).returns == {"logprobs"}


HI = np.array([b"hi"], dtype=object)


def test_tensorrt_llm_defaults_pass_and_anything_else_is_an_error_naming_the_input():
    """What TensorRT-LLM's clients send by default (beam_width 1, pad/end ids, input_lengths, empty LoRA and prompt
    tables, runtime_top_p 0 for "off") is accepted; an unsupported input at a non-default value is refused."""
    p = parse(input_ids=np.array([5, 6, 7, 0], dtype=np.int32), input_lengths=np.array([3], dtype=np.int32),
              beam_width=np.array([1], dtype=np.int32), pad_id=np.array([0], dtype=np.int32),
              end_id=np.array([-1], dtype=np.int32), runtime_top_k=np.array([1], dtype=np.int32),
              runtime_top_p=np.array([0.0], dtype=np.float32), lora_weights=np.zeros((0, 4), dtype=np.float16),
              prompt_vocab_size=np.array([0], dtype=np.int32), len_penalty=np.array([0.7], dtype=np.float32),
              guided_decoding_guide_type=np.array([b""], dtype=object), embedding_bias=np.zeros(8, np.float32))
    assert p.prompt_ids == [5, 6, 7] and p.params.end_id == -1 and p.params.top_p == 1.0 and p.params.greedy
    for name, value in [("beam_width", np.array([4], dtype=np.int32)), ("stop", np.array([True])),
                        ("lora_task_id", np.array([3], dtype=np.uint64)),
                        ("prompt_embedding_table", np.ones((2, 4), dtype=np.float16)),
                        ("guided_decoding_guide_type", np.array([b"json"], dtype=object)),
                        ("sampling_param_best_of", np.array([2], dtype=np.int32)),
                        ("runtime_top_p_decay", np.array([0.9], dtype=np.float32))]:
        with pytest.raises(RequestError, match=f"input '{name}' is not supported"):
            parse(text_input=HI, **{name: value})


def test_input_lengths_must_fit_input_ids():
    for lengths in ([0], [5], [1, 1]):
        with pytest.raises(RequestError, match="input_lengths"):
            parse(input_ids=np.array([5, 6], dtype=np.int32), input_lengths=np.array(lengths, dtype=np.int32))
    with pytest.raises(RequestError, match="input_lengths goes with input_ids"):
        parse(text_input=HI, input_lengths=np.array([2], dtype=np.int32))


def test_word_lists_are_read_in_tensorrt_llms_format():
    """[flat ids, end offsets padded with -1]: words [5], [6, 7] and [8]; string bad words are tokenized."""
    words = np.array([[5, 6, 7, 8, 0], [1, 3, 4, -1, -1]], dtype=np.int32)
    p = parse_request({"text_input": HI, "stop_words_list": words, "bad_words_list": words[None],
                       "bad_words": np.array([b"ab", b""], dtype=object)}.get, lambda t: [1],
                      16, LIMITS, encode_word=lambda w: [ord(c) for c in w])
    assert p.params.stop_token_seqs == ((5,), (6, 7), (8,))
    assert p.params.bad_token_seqs == ((5,), (6, 7), (8,), (97, 98))
    for bad in ([[5, 6], [3, -1]], [[5, 6], [2, 1]], [[5, 6, 7]]):
        with pytest.raises(RequestError, match="stop_words_list"):
            parse(text_input=HI, stop_words_list=np.array(bad, dtype=np.int32))


def test_llm_api_sampling_params_and_return_flags():
    p = parse(text_input=HI, sampling_param_max_tokens=np.array([7], dtype=np.int32),
              sampling_param_temperature=np.array([0.5], dtype=np.float32),
              sampling_param_stop=np.array([b"zz"], dtype=object), return_log_probs=np.array([True]),
              return_cumulative_logprob=np.array([True]), return_generation_logits=np.array([True]),
              num_return_sequences=np.array([3], dtype=np.int32))
    assert (p.params.max_tokens, p.params.temperature, p.params.stop_words) == (7, 0.5, ("zz",))
    assert p.returns == {"output_log_probs", "cum_log_probs", "cumulative_logprob", "generation_logits"}
    assert p.params.logprobs == 0 and p.params.return_generation_logits and p.num_return_sequences == 3
    with pytest.raises(RequestError, match="num_return_sequences"):
        parse(text_input=HI, num_return_sequences=np.array([0], dtype=np.int32))


def test_a_batched_request_splits_into_rows():
    from inflight_backend.trtllm_layout import split_rows

    batch = {"input_ids": np.array([[5, 6, 0], [7, 8, 9]], dtype=np.int32),
             "input_lengths": np.array([[2], [3]], dtype=np.int32),
             "request_output_len": np.array([[4], [5]], dtype=np.int32)}
    rows = [parse_request(g, None, 16, LIMITS) for g in split_rows(batch.get)]
    assert [(r.prompt_ids, r.params.max_tokens) for r in rows] == [([5, 6], 4), ([7, 8, 9], 5)]
    batch["request_output_len"] = np.array([[4]], dtype=np.int32)
    with pytest.raises(RequestError, match="needs 2 rows"):
        [parse_request(g, None, 16, LIMITS) for g in split_rows(batch.get)]
