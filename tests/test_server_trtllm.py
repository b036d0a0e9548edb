"""TensorRT-LLM's Triton clients against our server: the exact request shapes, names and types that
tensorrtllm_backend's clients send (end_to_end_grpc_client.py, inflight_batcher_llm_client.py,
benchmark_core_model.py; every tensor with a batch dimension), over gRPC streams and unary calls and over HTTP,
against `ensemble` (decoupled) and `tensorrt_llm` (not decoupled). Outputs are parsed as those clients parse them.
"""
import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from inflight_backend.make_model import byte_level_tokenizer
from inflight_backend.server import ServerError, TritonServer
from tests.conftest import Oracle, free_port, model_config, write_repository
from tests.triton_helpers import http_post, metric

pytestmark = pytest.mark.server
TOKENIZER = byte_level_tokenizer()
EOS = 257
PROMPT = "Born in north-east France, Soyer trained as a"


def tensor(module, name, array, dtype):
    t = module.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def ensemble_inputs(prompt, max_tokens, stream, module=grpcclient, **extra):
    """end_to_end_grpc_client.py's prepare_inputs: every tensor [1, 1] (beam_width 1, temperature 1.0 and
    exclude_input_in_output false always sent)."""
    inputs = [tensor(module, "text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
              tensor(module, "max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
              tensor(module, "stream", np.array([[stream]], dtype=bool), "BOOL"),
              tensor(module, "beam_width", np.array([[1]], dtype=np.int32), "INT32"),
              tensor(module, "temperature", np.array([[extra.pop("temperature", 1.0)]], dtype=np.float32), "FP32"),
              tensor(module, "exclude_input_in_output", np.array([[False]], dtype=bool), "BOOL")]
    for name, (value, dtype) in extra.items():
        inputs.append(tensor(module, name, np.array(value, dtype=_NUMPY[dtype]), dtype))
    return inputs


_NUMPY = {"INT32": np.int32, "FP32": np.float32, "BOOL": bool, "UINT64": np.uint64, "BYTES": object,
          "FP16": np.float16}


def core_inputs(ids, output_len, streaming=None, end_id=EOS, pad_id=0, **extra):
    """inflight_batcher_llm_client.py / benchmark_core_model.py: input_ids [1, N], input_lengths [1, 1],
    request_output_len [1, 1], end_id, pad_id, and (the former) beam_width 1, temperature 1.0, runtime_top_k 1,
    runtime_top_p 0.0, streaming."""
    i32 = np.int32
    inputs = [tensor(grpcclient, "input_ids", np.array([ids], dtype=i32), "INT32"),
              tensor(grpcclient, "input_lengths", np.array([[len(ids)]], dtype=i32), "INT32"),
              tensor(grpcclient, "request_output_len", np.array([[output_len]], dtype=i32), "INT32"),
              tensor(grpcclient, "end_id", np.array([[end_id]], dtype=i32), "INT32"),
              tensor(grpcclient, "pad_id", np.array([[pad_id]], dtype=i32), "INT32")]
    if streaming is not None:
        inputs += [tensor(grpcclient, "beam_width", np.array([[1]], dtype=i32), "INT32"),
                   tensor(grpcclient, "temperature", np.array([[1.0]], dtype=np.float32), "FP32"),
                   tensor(grpcclient, "streaming", np.array([[streaming]], dtype=bool), "BOOL"),
                   tensor(grpcclient, "runtime_top_k", np.array([[1]], dtype=i32), "INT32"),
                   tensor(grpcclient, "runtime_top_p", np.array([[0.0]], dtype=np.float32), "FP32")]
    for name, (value, dtype) in extra.items():
        inputs.append(tensor(grpcclient, name, np.array(value, dtype=_NUMPY[dtype]), dtype))
    return inputs


def stream(url, model, inputs, outputs=None):
    """start_stream / async_stream_infer / stop_stream, as those clients do: every result, then the error if any."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    requested = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
    client.async_stream_infer(model, inputs, outputs=requested, request_id="1", enable_empty_final_response=True)
    got, error = [], None
    while True:
        result, err = results.get(timeout=120)
        if err is not None:
            error = str(err)
            break
        got.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return got, error


def url(server):
    return f"127.0.0.1:{server.grpc_port}"


@pytest.fixture(scope="module")
def oracle(tiny_model):
    return Oracle(tiny_model)


def greedy(oracle, ids, n):
    return oracle.generate(ids, n)


def test_end_to_end_grpc_client_streaming_and_not(server, oracle):
    """Its request with top_k 1 (greedy, so the tokens can be checked): streamed chunks (`output[0].decode()`)
    concatenate to transformers' text; not streamed, text_output is the prompt followed by it."""
    ids = TOKENIZER.encode(PROMPT).ids
    want = TOKENIZER.decode(greedy(oracle, ids, 24))
    top_k = {"top_k": ([[1]], "INT32")}
    for model in ("ensemble", "tensorrt_llm"):
        got, error = stream(url(server), model, ensemble_inputs(PROMPT, 24, False, **top_k), ["text_output"])
        assert error is None and len(got) == 1
        assert got[0].as_numpy("text_output")[0].decode() == PROMPT + want
    got, error = stream(url(server), "ensemble", ensemble_inputs(PROMPT, 24, True, **top_k), ["text_output"])
    assert error is None and len(got) >= 1  # a chunk per token, fewer where the responder fell behind (coalescing)
    assert "".join(r.as_numpy("text_output")[0].decode() for r in got) == want
    # with log-probabilities asked for, tokens are never merged: exactly one chunk per token
    per_token = {**top_k, "return_log_probs": ([[True]], "BOOL")}
    got, error = stream(url(server), "ensemble", ensemble_inputs(PROMPT, 24, True, **per_token), ["text_output"])
    assert error is None and len(got) == len(greedy(oracle, ids, 24)) > 1
    assert "".join(r.as_numpy("text_output")[0].decode() for r in got) == want


def test_end_to_end_grpc_client_as_sent_samples_at_temperature_one(server):
    got, error = stream(url(server), "ensemble", ensemble_inputs(PROMPT, 16, True))
    assert error is None
    assert sum(r.as_numpy("output_ids").shape[-1] for r in got) == int(got[-1].as_numpy("num_output_tokens")[0][0])
    assert all(r.as_numpy("batch_index")[0][0] == 0 and r.as_numpy("sequence_index")[0][0] == 0 for r in got)


def test_inflight_batcher_llm_client_streaming(server, oracle):
    """Its request (input_ids [1, N], runtime_top_k 1: greedy): each response's output_ids[0][0] holds the new
    tokens and sequence_length[0][0] their count; together they are transformers' tokens."""
    ids = TOKENIZER.encode(PROMPT).ids
    got, error = stream(url(server), "ensemble", core_inputs(ids, 30, streaming=True))
    assert error is None
    tokens = []
    for result in got:
        length = result.as_numpy("sequence_length")[0][0]
        assert result.as_numpy("output_ids").shape[:2] == (1, 1)
        tokens += list(result.as_numpy("output_ids")[0][0][:length])
    assert tokens == greedy(oracle, ids, 30)


def test_inflight_batcher_llm_client_unary_returns_prompt_and_output(server, oracle):
    """Without --streaming it calls async_infer (gRPC ModelInfer) with parameters {'Streaming': False}: one
    response whose output_ids[0][0][:sequence_length] is the prompt followed by the generated tokens."""
    ids = TOKENIZER.encode(PROMPT).ids
    client = grpcclient.InferenceServerClient(url(server))
    done: queue.SimpleQueue = queue.SimpleQueue()
    client.async_infer("tensorrt_llm", core_inputs(ids, 30, streaming=False), lambda result, error: done.put(
        (result, error)), parameters={"Streaming": False})
    result, error = done.get(timeout=120)
    assert error is None
    length = result.as_numpy("sequence_length")[0][0]
    assert list(result.as_numpy("output_ids")[0][0][:length]) == ids + greedy(oracle, ids, 30)
    with pytest.raises(Exception, match="decoupled"):  # ModelInfer on the streaming model: Triton's own refusal
        client.infer("ensemble", core_inputs(ids, 4, streaming=False))
    client.close()


def test_benchmark_core_model_unary_requests_share_iterations(server, oracle, oracle_cases):
    """benchmark_core_model.py's requests (input_ids, input_lengths, request_output_len, pad_id, end_id; no
    outputs named): 8 concurrent gRPC async_infer calls, each answered once with output_ids first ([1, 1, L]),
    all equal to transformers', in fewer engine steps than run one after another."""
    client = grpcclient.InferenceServerClient(url(server))
    cases = oracle_cases[:8]
    done: queue.SimpleQueue = queue.SimpleQueue()
    steps_before = metric(server.metrics_port, "inflight_steps_total", "tensorrt_llm")
    for i, (ids, n) in enumerate(cases):
        client.async_infer("tensorrt_llm", core_inputs(ids, n), partial_put(done, i), request_id=str(i))
    results = dict(done.get(timeout=120) for _ in cases)
    steps = metric(server.metrics_port, "inflight_steps_total", "tensorrt_llm") - steps_before
    for i, (ids, n) in enumerate(cases):
        result, error = results[i]
        assert error is None
        response = result.get_response(as_json=True)
        assert response["outputs"][0]["name"] == "output_ids" and response["id"] == str(i)
        assert list(result.as_numpy("output_ids")[0][0]) == ids + greedy(oracle, ids, n)
    assert steps < sum(len(greedy(oracle, ids, n)) for ids, n in cases)
    client.close()


def partial_put(q, i):
    return lambda result, error: q.put((i, (result, error)))


def test_a_request_of_several_rows_gets_each_row_with_its_batch_index(server, oracle, oracle_cases):
    """--batch-inputs: rows of different prompt lengths (input_ids padded, input_lengths per row). Streamed,
    every response names its row; not streamed (unary), one response holds every row, output_ids padded."""
    cases = oracle_cases[1:4]
    width = max(len(ids) for ids, _ in cases)
    batch = {"input_ids": np.array([ids + [0] * (width - len(ids)) for ids, _ in cases], dtype=np.int32),
             "input_lengths": np.array([[len(ids)] for ids, _ in cases], dtype=np.int32),
             "request_output_len": np.array([[n] for _, n in cases], dtype=np.int32),
             "pad_id": np.array([[-7]] * len(cases), dtype=np.int32)}
    inputs = [tensor(grpcclient, k, v, "INT32") for k, v in batch.items()]
    wants = [greedy(oracle, ids, n) for ids, n in cases]
    got, error = stream(url(server), "ensemble", inputs + [
        tensor(grpcclient, "streaming", np.array([[True]] * len(cases)), "BOOL")])
    assert error is None
    rows = {i: [] for i in range(len(cases))}
    for result in got:
        rows[int(result.as_numpy("batch_index")[0][0])] += list(result.as_numpy("output_ids")[0][0])
    assert [rows[i] for i in range(len(cases))] == wants
    result = grpcclient.InferenceServerClient(url(server)).infer("tensorrt_llm", inputs)
    assert list(result.as_numpy("batch_index").reshape(-1)) == list(range(len(cases)))
    lengths = result.as_numpy("sequence_length").reshape(-1)
    for row, ((ids, _), want) in enumerate(zip(cases, wants)):
        assert list(result.as_numpy("output_ids")[row][0][:lengths[row]]) == ids + want
        assert set(result.as_numpy("output_ids")[row][0][lengths[row]:]) <= {-7}


def test_log_probs_and_generation_logits_in_tensorrt_llms_shapes(server, oracle):
    """return_log_probs / return_generation_logits / return_context_logits: output_log_probs [1, 1, n] and
    cum_log_probs [1, 1] equal transformers' log_softmax; generation_logits [1, 1, n, vocab] and context_logits
    [1, prompt, vocab] its logits, streamed and unary."""
    ids = TOKENIZER.encode(PROMPT).ids
    flags = {"return_log_probs": ([[True]], "BOOL"), "return_generation_logits": ([[True]], "BOOL"),
             "return_context_logits": ([[True]], "BOOL")}
    want = greedy(oracle, ids, 12)
    logprobs = oracle.logprobs(ids, want)
    chosen = logprobs[np.arange(len(want)), want].numpy()
    logits = oracle.logits(ids + want)[len(ids) - 1:len(ids) - 1 + len(want)].numpy()
    got, error = stream(url(server), "ensemble", core_inputs(ids, 12, streaming=True, **flags))
    assert error is None
    # streamed as TensorRT-LLM streams them: each response has the log-probabilities of every token so far
    for n, r in enumerate(got, start=1):
        np.testing.assert_allclose(r.as_numpy("output_log_probs")[0][0], chosen[:n], atol=1e-4)
    np.testing.assert_allclose(got[-1].as_numpy("cum_log_probs")[0][0], chosen.sum(), atol=1e-3)
    streamed_logits = np.concatenate([r.as_numpy("generation_logits")[0][0] for r in got])
    np.testing.assert_allclose(streamed_logits, logits, atol=1e-4)
    context = [r.as_numpy("context_logits") for r in got]  # on every response, as TensorRT-LLM sends them
    assert all(c is not None and c.shape == (1, len(ids), logits.shape[-1]) for c in context)
    np.testing.assert_allclose(context[-1][0], oracle.logits(ids).numpy(), atol=1e-4)
    result = grpcclient.InferenceServerClient(url(server)).infer("tensorrt_llm", core_inputs(ids, 12, **flags))
    np.testing.assert_allclose(result.as_numpy("context_logits")[0], oracle.logits(ids).numpy(), atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("output_log_probs")[0][0], chosen, atol=1e-4)
    assert result.as_numpy("generation_logits").shape == (1, 1, len(want), logits.shape[-1])
    assert result.as_numpy("cum_log_probs").shape == (1, 1)


def test_bad_and_stop_words_as_strings_and_token_lists(server, oracle):
    """ensemble's bad_words/stop_words [1, K] strings and tensorrt_llm's bad_words_list/stop_words_list
    [1, 2, L]: a banned token never appears; the output ends right after the stop sequence."""
    ids = TOKENIZER.encode(PROMPT).ids
    free = greedy(oracle, ids, 20)
    stop_seq = free[6:8]
    words = np.array([[stop_seq, [2, -1]]], dtype=np.int32)
    got, error = stream(url(server), "ensemble", core_inputs(ids, 20, streaming=True,
                                                                stop_words_list=(words, "INT32")))
    assert error is None
    tokens = [t for r in got for t in r.as_numpy("output_ids")[0][0]]
    first = next(j for j in range(len(free)) if free[j:j + 2] == stop_seq)
    assert tokens == free[:first + 2]
    banned = [[[free[0]], [1]]]
    got, error = stream(url(server), "ensemble", core_inputs(ids, 20, streaming=True,
                                                                bad_words_list=(banned, "INT32")))
    tokens = [t for r in got for t in r.as_numpy("output_ids")[0][0]]
    assert error is None and tokens == oracle.generate(ids, 20, bad_words_ids=[[free[0]]])
    ascii_token = next(t for t in free if 32 < t < 127)  # one byte, one token: the string bad word's tokens
    got, error = stream(url(server), "ensemble", ensemble_inputs(
        PROMPT, 20, True, temperature=0.0, bad_words=([[chr(ascii_token).encode()]], "BYTES")))
    tokens = [t for r in got for t in TOKENIZER.encode(r.as_numpy("text_output")[0].decode("utf-8", "replace"),
                                                       add_special_tokens=False).ids]
    assert error is None and ascii_token not in tokens


def test_num_return_sequences_each_with_its_sequence_index(server):
    """num_return_sequences 3 with a seed: three sequences, each equal to the same request sent alone with
    seed + its index; sequences 1 and 2 reused the prompt's full KV blocks (kv_cache_reused_blocks)."""
    extra = {"num_return_sequences": ([[3]], "INT32"), "seed": ([[11]], "UINT64"),
             "return_perf_metrics": ([[True]], "BOOL")}
    prompt = "Sequences: " + PROMPT  # a prefix no earlier request left in the prefix cache
    got, error = stream(url(server), "ensemble", ensemble_inputs(prompt, 10, True, **extra))
    assert error is None
    seqs, reused = {}, {}
    for r in got:
        index = int(r.as_numpy("sequence_index")[0][0])
        seqs.setdefault(index, []).extend(r.as_numpy("output_ids")[0][0])
        if r.as_numpy("kv_cache_reused_blocks") is not None:
            reused[index] = int(r.as_numpy("kv_cache_reused_blocks")[0][0])
    assert sorted(seqs) == [0, 1, 2]
    prompt_blocks = len(TOKENIZER.encode(prompt).ids[:-1]) // 16
    assert reused == {0: 0, 1: prompt_blocks, 2: prompt_blocks} and prompt_blocks >= 2
    for s in range(3):
        alone, error = stream(url(server), "ensemble",
                              ensemble_inputs(prompt, 10, True, seed=([[11 + s]], "UINT64")))
        assert error is None and [t for r in alone for t in r.as_numpy("output_ids")[0][0]] == seqs[s]


@pytest.mark.parametrize("name, value, dtype", [
    ("beam_width", [[4]], "INT32"), ("lora_task_id", [[3]], "UINT64"), ("stop", [[True]], "BOOL"),
    ("prompt_embedding_table", [[[1.0, 2.0]]], "FP16")])
def test_unsupported_inputs_are_errors_naming_them_and_the_server_keeps_serving(server, name, value, dtype):
    got, error = stream(url(server), "ensemble", ensemble_inputs(PROMPT, 4, True, **{name: (value, dtype)}))
    assert error is not None and f"'{name}'" in error
    got, error = stream(url(server), "ensemble", ensemble_inputs(PROMPT, 4, True))
    assert error is None and got


def test_streaming_needs_the_decoupled_model(server):
    got, error = stream(url(server), "tensorrt_llm", ensemble_inputs(PROMPT, 4, True))
    assert error is not None and "decoupled" in error


def test_http_infer_and_generate_on_the_batched_models(server, oracle):
    """HTTP /infer (tritonclient.http) on the unary model, and /generate with TensorRT-LLM's field names; an
    unknown /generate field is an error naming it."""
    ids = TOKENIZER.encode(PROMPT).ids
    want = TOKENIZER.decode(greedy(oracle, ids, 10))
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    result = client.infer("tensorrt_llm", ensemble_inputs(PROMPT, 10, False, module=httpclient, temperature=0.0))
    assert result.as_numpy("text_output")[0].decode() == PROMPT + want
    client.close()
    status, body = http_post(server.http_port, "/v2/models/tensorrt_llm/generate",
                             {"text_input": PROMPT, "max_tokens": 10, "temperature": 0.0, "beam_width": 1})
    assert status == 200, body
    assert json.loads(body)["text_output"] == PROMPT + want
    status, body = http_post(server.http_port, "/v2/models/tensorrt_llm/generate",
                             {"text_input": PROMPT, "max_token": 10})
    assert "max_token" in body and status != 200


def test_the_dynamic_batcher_hands_execute_several_requests_each_its_own_stream(server, oracle, oracle_cases):
    """TensorRT-LLM's configs carry `dynamic_batching`: Triton then hands execute() several queued requests at
    once (llm_dynamic holds them until 4 are there). Triton counts fewer executions than requests, and each
    request is still its own stream: transformers' tokens, one FINAL."""
    cases = oracle_cases[4:8]
    client = grpcclient.InferenceServerClient(url(server))

    def counts():
        stats = client.get_inference_statistics("llm_dynamic", as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))

    before = counts()
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, (ids, n) in enumerate(cases):
        client.async_stream_infer("llm_dynamic", core_inputs(ids, n, streaming=True), request_id=str(i),
                                  enable_empty_final_response=True)
    tokens, finals = {i: [] for i in range(len(cases))}, {i: 0 for i in range(len(cases))}
    while sum(finals.values()) < len(cases):
        result, error = results.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        i = int(response.id)
        ids = result.as_numpy("output_ids")
        if ids is not None:
            tokens[i] += list(ids[0][0][:result.as_numpy("sequence_length")[0][0]])
        finals[i] += response.parameters["triton_final_response"].bool_param
    client.stop_stream()
    inferences, executions = (after - was for after, was in zip(counts(), before))
    client.close()
    assert [tokens[i] for i in range(len(cases))] == [greedy(oracle, ids, n) for ids, n in cases]
    assert all(count == 1 for count in finals.values())
    assert inferences == len(cases) and executions < inferences


def test_a_dynamic_batcher_on_the_unbatched_layout_is_refused_at_load(tmp_path, tiny_model):
    """With max_batch_size 0 Triton itself would accept it; the backend names what to change."""
    repo = write_repository(tmp_path / "repo", {"unbatched": model_config(tiny_model, "unbatched",
                                                                          dynamic_batching="")})
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp_path / "tritonserver.log")
    with pytest.raises(ServerError):
        server.start()
    assert "dynamic_batching needs max_batch_size > 0" in (tmp_path / "tritonserver.log").read_text()
