"""Random mixes of the options clients send, over HTTP /generate and /generate_stream, to the unbatched model and
to TensorRT-LLM's batched decoupled layout, many at once, some streams dropped by their client midway. Each
request ends with its final response (a finish reason on the last) or with an error that names an input it
sent; afterwards every KV block is free. Seeded: the same requests every run."""
import http.client
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.triton_helpers import sse_events, wait_for_metric

pytestmark = pytest.mark.server
NUM_REQUESTS = 96
MODELS = ("llm", "ensemble")
PROMPTS = ("Hello", "The quick brown fox jumps", "a b c d e f g", "Once upon a time " * 12)
OPTIONS = {  # each input with the values drawn for it; some combinations are errors (min_tokens past max_tokens,
    # stream_interval without stream, values the sampling parameters contradict)
    "temperature": (0.0, 0.3, 1.0, 1.7),
    "top_k": (0, 1, 5, 50),
    "top_p": (1.0, 0.9, 0.1),
    "seed": (0, 7, 2**32 - 1),
    "min_tokens": (0, 1, 3, 16),
    "stop_words": (["a"], ["ab", "c"], ["\n"]),
    "bad_words": (["a"], ["e", "o"]),
    "repetition_penalty": (1.0, 1.3, 0.8),
    "presence_penalty": (0.0, 0.5, -0.5),
    "frequency_penalty": (0.0, 0.5),
    "num_return_sequences": (1, 2, 3),
    "return_log_probs": (True, False),
    "stream_interval": (1, 2, 7),
    "exclude_input_in_output": (True, False),
    "return_finish_reason": (True,),
    "return_num_output_tokens": (True,),
    "priority": (0, 1, 5),
    "end_id": (0, 2, 65),
    "stream": (True, False),
    "embedding_bias_words": (["a"], ["Z", "e"]),
    "embedding_bias_weights": ([2.0], [0.5, -1.0]),
}


def plan(rng: random.Random) -> tuple[str, str, dict, bool]:
    """(model, endpoint, body, whether the client drops the stream after its first event)."""
    body = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.choice((1, 2, 5, 16))}
    for name in rng.sample(sorted(OPTIONS), rng.randrange(0, 7)):
        body[name] = rng.choice(OPTIONS[name])
    if rng.random() < 0.2:  # vLLM's sampling parameters beside (or against) the inputs
        vllm = {"temperature": rng.choice((0, 0.7)), "n": rng.choice((1, 2))}
        if rng.random() < 0.5:
            vllm["min_p"] = rng.choice((0.0, 0.1, 1.0))
        if rng.random() < 0.3:  # 300 is past the test model's vocabulary
            vllm["logit_bias"] = {str(rng.choice((65, 300))): rng.choice((-5.0, 3.0))}
        if rng.random() < 0.3:
            vllm["bad_words"] = rng.choice((["e"], ["an", " "], "e"))  # a string, not a list: an error
        body["sampling_parameters"] = json.dumps(vllm)
    model, endpoint = rng.choice(MODELS), rng.choice(("generate", "generate_stream"))
    # Triton's /generate takes exactly one response: no streams there, nor several sequences in the batched
    # layout (which answers one response per sequence, as TensorRT-LLM's backend does)
    if endpoint == "generate":
        body.pop("stream", None)
        if model == "ensemble":
            body.pop("num_return_sequences", None)
            body.pop("sampling_parameters", None)
    drop = endpoint == "generate_stream" and rng.random() < 0.25
    return model, endpoint, body, drop


def send(port: int, model: str, endpoint: str, body: dict, drop: bool) -> tuple[int, list[dict]]:
    """The HTTP status and the response's events (one for /generate); none when the client dropped it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", f"/v2/models/{model}/{endpoint}", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if drop:
            reply.readline()
            return reply.status, []
        text = reply.read().decode("utf-8", "replace")
        return reply.status, sse_events(text) if endpoint == "generate_stream" else [json.loads(text)]
    finally:
        conn.close()


def names_an_input(message: str, body: dict) -> bool:
    sent = set(body) | set(json.loads(body.get("sampling_parameters", "{}")))
    return any(name in message for name in sent)


def finished(reason) -> bool:
    reasons = reason if isinstance(reason, list) else [reason]
    return bool(reasons) and all(r in ("stop", "length") for r in reasons)


def test_random_option_mixes_end_with_a_final_response_or_an_error_naming_an_input(server):
    rng = random.Random(20261207)
    requests = [plan(rng) for _ in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda r: send(server.http_port, *r), requests))
    answered = errors = 0
    for (model, endpoint, body, drop), (status, events) in zip(requests, results):
        if drop:
            continue
        assert events, (model, endpoint, body, status)
        failed = [e["error"] for e in events if "error" in e]
        if failed:
            errors += 1
            assert status in (200, 400) and len(failed) == 1, (model, endpoint, body, status, events)
            assert names_an_input(failed[0], body), (model, endpoint, body, failed)
        else:
            answered += 1
            assert status == 200 and finished(events[-1].get("finish_reason")), (model, endpoint, body, events)
    assert answered > NUM_REQUESTS // 3 and errors > 0  # the mix holds both kinds
    for model in MODELS:
        assert wait_for_metric(server.metrics_port, "inflight_kv_blocks_used", model, 0) == 0
        for state in ("running", "waiting"):
            assert wait_for_metric(server.metrics_port, "inflight_requests", model, 0, state=state) == 0
