"""vLLM's Triton backend clients against our server: the exact request its samples/client.py builds (text_input,
stream, sampling_parameters as a JSON string tensor, exclude_input_in_output, the same dict again as request
parameters, only text_output requested), over gRPC streaming, and its fields over HTTP."""
import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from inflight_backend.make_model import byte_level_tokenizer
from tests.conftest import Oracle
from tests.triton_helpers import http_post

pytestmark = pytest.mark.server
TOKENIZER = byte_level_tokenizer()
PROMPT = "Hello, my name is"


def vllm_client_request(url, prompt, stream, sampling_parameters, exclude_input_in_output):
    """What vllm_backend's samples/client.py create_request + stream_infer send; returns (texts, error)."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
              grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
              grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
    inputs[2].set_data_from_numpy(np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
    inputs[3].set_data_from_numpy(np.array([exclude_input_in_output], dtype=bool))
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("llm", inputs, outputs=[grpcclient.InferRequestedOutput("text_output")],
                              request_id="1", parameters=sampling_parameters, enable_empty_final_response=True)
    texts = []
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return texts, str(error)
            if (text := result.as_numpy("text_output")) is not None:
                texts.append(text[0].decode("utf-8"))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return texts, None
    finally:
        client.stop_stream()
        client.close()  # an idle open channel would keep the model from unloading at shutdown


@pytest.fixture(scope="module")
def greedy(tiny_model):
    """transformers' greedy continuation: (its ids, its text)."""
    ids = Oracle(tiny_model).generate(TOKENIZER.encode(PROMPT).ids, 20)
    return ids, TOKENIZER.decode(ids)


@pytest.mark.parametrize("stream", [True, False])
def test_the_vllm_sample_clients_request(server, greedy, stream):
    url = f"127.0.0.1:{server.grpc_port}"
    params = {"temperature": "0", "top_p": "0.95", "max_tokens": "20"}  # its own, with temperature 0: greedy
    texts, error = vllm_client_request(url, PROMPT, stream, params, exclude_input_in_output=stream)
    assert error is None
    ids, text = greedy
    assert "".join(texts) == (text if stream else PROMPT + text)
    # streaming: a response per token, or fewer where the responder fell behind and coalesced some (timing
    # decides which); with log-probabilities asked for, tokens are never merged: exactly one response each
    assert (1 <= len(texts) <= len(ids)) if stream else len(texts) == 1
    if stream:
        texts, error = vllm_client_request(url, PROMPT, stream, {**params, "logprobs": "0"},
                                           exclude_input_in_output=True)
        assert error is None and "".join(texts) == text and len(texts) == len(ids) > 1


def test_vllm_sampling_parameters_we_cannot_honour_are_errors_naming_them(server):
    url = f"127.0.0.1:{server.grpc_port}"
    _, error = vllm_client_request(url, PROMPT, True, {"max_tokens": "5", "best_of": "2"}, True)
    assert error is not None and "['best_of'] are not supported" in error
    _, error = vllm_client_request(url, PROMPT, True, {"max_tokens": "5"}, False)
    assert error == ("Error generating stream: When streaming, `exclude_input_in_output` = False is not "
                     "allowed.") or "Error generating stream: When streaming" in error
    status, body = http_post(server.http_port, "/v2/models/llm/generate",
                             {"text_input": PROMPT, "max_tokens": 3, "prompt_logprobs": 2})
    assert status != 200 or "error" in body
    assert "['prompt_logprobs'] are not supported" in body
    status, body = http_post(server.http_port, "/v2/models/llm/generate",
                             {"text_input": PROMPT, "max_tokens": 3, "top_k": 1, "seed": 3})
    assert status == 200 and json.loads(body)["text_output"].startswith(PROMPT)


def test_n_sequences_over_http_generate_come_in_one_response(server):
    """`n` over Triton's /generate, which takes exactly one response: one response holds every sequence, as
    vLLM's backend answers (text_output, a text per sequence), each the request alone with seed + s."""
    body = {"text_input": PROMPT, "max_tokens": 6, "temperature": 1.5, "seed": 21, "exclude_input_in_output": True}
    status, text = http_post(server.http_port, "/v2/models/llm/generate",
                             {**body, "sampling_parameters": json.dumps({"n": 3})})
    assert status == 200 and "error" not in text, text
    got = json.loads(text)
    assert got["sequence_index"] == [0, 1, 2] and len(got["text_output"]) == 3
    alone = []
    for s in range(3):
        status, text = http_post(server.http_port, "/v2/models/llm/generate", {**body, "seed": 21 + s})
        assert status == 200, text
        alone.append(json.loads(text)["text_output"])
    assert got["text_output"] == alone and len(set(alone)) > 1  # sampled: the sequences differ


def test_penalties_act_over_http_and_in_vllm_sampling_parameters(server, tiny_model):
    """`repetition_penalty` as an input (TensorRT-LLM's name) over HTTP /generate, and the same in vLLM's
    sampling parameters over gRPC: both give transformers' generate(repetition_penalty=1.3)."""
    ids = TOKENIZER.encode(PROMPT).ids
    want = Oracle(tiny_model).generate(ids, 30, repetition_penalty=1.3)
    status, body = http_post(server.http_port, "/v2/models/llm/generate",
                             {"input_ids": ids, "max_tokens": 30, "repetition_penalty": 1.3,
                              "exclude_input_in_output": True})
    assert status == 200 and json.loads(body)["output_ids"] == want
    texts, error = vllm_client_request(f"127.0.0.1:{server.grpc_port}", PROMPT, True,
                                       {"max_tokens": "30", "repetition_penalty": "1.3", "temperature": "0"}, True)
    assert error is None and "".join(texts) == TOKENIZER.decode(want)


def vllm_stream(url, prompt, sampling_parameters, flags=(), outputs=("text_output",)):
    """vLLM backend's request with its optional return_* inputs; every response (until FINAL) or the error."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
              grpcclient.InferInput("sampling_parameters", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True], dtype=bool))
    inputs[2].set_data_from_numpy(np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
    for name in flags:
        inputs.append(grpcclient.InferInput(name, [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([True], dtype=bool))
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("llm", inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                              enable_empty_final_response=True)
    got = []
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return got, str(error)
            got.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got, None
    finally:
        client.stop_stream()
        client.close()  # an idle open channel would keep the model from unloading at shutdown


def test_vllm_logprobs_and_cumulative_logprob(server, tiny_model, greedy):
    """logprobs: 2 with return_logprobs: each response's JSON holds the sampled token's log-probability (equal to
    transformers' log_softmax within 1e-4) among its top 2; cumulative_logprob is their running sum; the other
    return_* outputs on every response, as vLLM's backend sends them."""
    url = f"127.0.0.1:{server.grpc_port}"
    got, error = vllm_stream(url, PROMPT, {"temperature": "0", "max_tokens": "20", "logprobs": "2"},
                             ("return_logprobs", "return_cumulative_logprob", "return_finish_reason",
                              "return_num_input_tokens", "return_num_output_tokens"),
                             ("text_output", "logprobs", "cumulative_logprob", "finish_reason", "num_input_tokens",
                              "num_output_tokens"))
    assert error is None
    ids, _ = greedy
    want = Oracle(tiny_model).logprobs(TOKENIZER.encode(PROMPT).ids, ids)
    entries = [e for r in got for e in json.loads(r.as_numpy("logprobs")[0])]
    assert len(entries) == len(ids)
    for row, (token, entry) in enumerate(zip(ids, entries)):
        assert entry[str(token)]["rank"] == 1 and len(entry) == 2
        assert abs(entry[str(token)]["logprob"] - float(want[row, token])) < 1e-4
    total = float(want[range(len(ids)), ids].sum())
    assert abs(float(got[-1].as_numpy("cumulative_logprob")[0]) - total) < 1e-3
    assert [r.as_numpy("finish_reason")[0] for r in got[:-1]] == [b"None"] * (len(got) - 1)
    assert got[-1].as_numpy("finish_reason")[0] in (b"stop", b"length")
    # vLLM's types and meanings: UINT32; the prompt's length; the tokens in each response
    assert all(r.as_numpy("num_output_tokens").dtype == np.uint32 for r in got)
    assert [int(r.as_numpy("num_output_tokens")[0]) for r in got] == [1] * len(got)
    assert {int(r.as_numpy("num_input_tokens")[0]) for r in got} == {len(TOKENIZER.encode(PROMPT).ids)}


def test_vllm_stop_strings_are_cut_and_n_sequences_come_with_their_index(server, greedy):
    """`stop` without include_stop_str_in_output (vLLM's default): the text ends before the stop string;
    `n`: that many sequences, each response naming its sequence_index."""
    url = f"127.0.0.1:{server.grpc_port}"
    _, text = greedy
    word = next(text[i:i + 2] for i in range(3, len(text)) if "\ufffd" not in text[i:i + 2])
    got, error = vllm_stream(url, PROMPT, {"temperature": "0", "max_tokens": "20", "stop": [word]})
    assert error is None
    assert "".join(r.as_numpy("text_output")[0].decode() for r in got) == text[:text.index(word)]
    got, error = vllm_stream(url, PROMPT, {"temperature": "0", "max_tokens": "5", "n": "3"},
                             outputs=("text_output", "sequence_index"))
    assert error is None and {int(r.as_numpy("sequence_index")[0]) for r in got} == {0, 1, 2}
