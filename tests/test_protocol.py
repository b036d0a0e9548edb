import numpy as np
import pytest

from inflight_backend.engine import RequestError
from inflight_backend.protocol import parse_request


def parse(**inputs):
    arrays = {k: (v if isinstance(v, np.ndarray) else np.array([v])) for k, v in inputs.items()}
    return parse_request(arrays.get, lambda text: [256] + list(text.encode()), default_max_tokens=16)


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
])
def test_bad_inputs_raise_a_clear_error(inputs, message):
    with pytest.raises(RequestError, match=message):
        parse(**inputs)
