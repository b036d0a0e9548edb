"""End to end through a real tritonserver: oracle outputs, streaming, sharing of steps."""
import subprocess
import sys
import threading
import time

import pytest

from inflight_backend.make_model import byte_level_tokenizer
from tests.conftest import LONG_STREAM, Oracle
from tests.test_server_faults import REASONS, wait_until_ended
from tests.triton_helpers import grpc_generate, http_post, metric, sse_events, wait_for_metric

pytestmark = pytest.mark.server
TOKENIZER = byte_level_tokenizer()


def url(server):
    return f"127.0.0.1:{server.grpc_port}"


@pytest.fixture(scope="module", params=[("llm", "tiny_model"), ("llm_gqa", "gqa_model")], ids=["default", "gqa"])
def served(request, oracle_cases):
    model, checkpoint = request.param
    oracle = Oracle(request.getfixturevalue(checkpoint))
    return model, [oracle.generate(ids, n) for ids, n in oracle_cases]


def test_oracle_one_request_at_a_time(server, served, oracle_cases):
    model, expected = served
    for (ids, n), want in zip(oracle_cases, expected):
        out = grpc_generate(url(server), model, {"input_ids": ids, "max_tokens": n, "stream": True})
        assert out.error is None and out.ids == want
        assert out.num_output_tokens == len(want) and out.num_input_tokens == len(ids)
        assert out.finish_reason == ("stop" if want[-1] == 257 else "length")


def test_oracle_concurrent_staggered_arrivals(server, served, oracle_cases):
    """Prompts arriving one by one join the running batch: each gives transformers' tokens, and they share
    steps with a request already decoding (a holder of up to 1,900 tokens, running from before the first
    arrival until the last ends, so the sharing does not depend on how fast this machine decodes)."""
    model, expected = served
    results = [None] * len(oracle_cases)
    holding, done = threading.Event(), threading.Event()

    def send(i):
        ids, n = oracle_cases[i]
        results[i] = grpc_generate(url(server), model, {"input_ids": ids, "max_tokens": n, "stream": True})

    steps_before = metric(server.metrics_port, "inflight_steps_total", model)
    tokens_before = metric(server.metrics_port, "inflight_generated_tokens_total", model)
    ended_before = {r: metric(server.metrics_port, "inflight_requests_finished_total", model, reason=r)
                    for r in REASONS}
    holder = threading.Thread(target=lambda: grpc_generate(
        url(server), model, {"text_input": "hold", "max_tokens": 1900, "min_tokens": 1900, "stream": True},
        on_token=lambda out: holding.set(), cancel_event=done))
    holder.start()
    assert holding.wait(60)
    threads = []
    for i in range(len(oracle_cases)):
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        time.sleep(0.02)  # staggered: later prompts join while earlier ones decode
    for t in threads:
        t.join()
    done.set()
    holder.join()
    assert [r.ids for r in results] == expected
    # every stream has ended (the holder too), and the counters were published after the last one ended
    wait_until_ended(server.metrics_port, model, ended_before, len(oracle_cases) + 1)
    assert wait_for_metric(server.metrics_port, "inflight_requests", model, 0, state="running") == 0
    steps = metric(server.metrics_port, "inflight_steps_total", model) - steps_before
    tokens = metric(server.metrics_port, "inflight_generated_tokens_total", model) - tokens_before
    assert tokens >= sum(len(e) for e in expected) and steps < tokens  # some steps carried several sequences


def test_grpc_stream_deltas_concatenate_to_the_full_decode(server):
    prompt = "naïve café — 日本語 🙂"
    out = grpc_generate(url(server), "llm", {"text_input": prompt, "max_tokens": 40, "stream": True})
    assert out.error is None and out.finish_reason in ("stop", "length")
    assert out.text == TOKENIZER.decode(out.ids)
    assert out.num_input_tokens == len(prompt.encode()) + 1 and out.num_output_tokens == len(out.ids)
    # a response per token, unless the responder fell behind the engine and sent some together (coalescing:
    # this tiny model can outpace it on a loaded machine, so timing decides how many): never more than tokens
    assert 1 <= out.num_responses <= len(out.ids)
    # outputs carrying a per-token value are never merged: with log-probabilities, one response per token
    per_token = grpc_generate(url(server), "llm", {"text_input": prompt, "max_tokens": 40, "stream": True,
                                                    "return_log_probs": True})
    assert per_token.ids == out.ids and per_token.num_responses == len(out.ids) > 1
    assert per_token.text == out.text
    assert not any(t.endswith("\ufffd") for t in per_token.texts[:-1])  # an incomplete character is held back


def test_only_the_requested_outputs_are_sent(server):
    values = {"text_input": "requested outputs", "max_tokens": 12, "min_tokens": 12, "stream": True}
    everything = grpc_generate(url(server), "llm", values)
    ids_only = grpc_generate(url(server), "llm", values, outputs=["output_ids"])
    assert ids_only.error is None and ids_only.ids == everything.ids and len(ids_only.ids) == 12
    assert ids_only.output_names == {"output_ids"}
    assert {"text_output", "output_ids", "finish_reason", "num_output_tokens"} <= everything.output_names
    reason = grpc_generate(url(server), "llm", values, outputs=["output_ids", "finish_reason"])
    assert reason.finish_reason == "length" and reason.output_names == {"output_ids", "finish_reason"}


def test_http_generate_stream_and_generate(server):
    prompt = "Grüße aus München ✓"
    status, body = http_post(server.http_port, "/v2/models/llm/generate_stream",
                             {"text_input": prompt, "max_tokens": 24, "stream": True})
    assert status == 200
    events = sse_events(body)
    ids = [i for e in events for i in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]
    assert "".join(e["text_output"] for e in events) == TOKENIZER.decode(ids)
    assert events[-1]["num_output_tokens"] == len(ids)
    assert 1 <= len(events) <= len(ids)  # an event per token unless the responder fell behind (coalescing, as above)
    assert events[-1]["finish_reason"] in ("stop", "length")
    status, body = http_post(server.http_port, "/v2/models/llm/generate_stream",
                             {"text_input": prompt, "max_tokens": 24, "stream": True, "return_log_probs": True})
    per_token = sse_events(body)  # per-token values are never merged: one event per token
    assert status == 200 and len(per_token) == len(ids) > 1
    assert "".join(e["text_output"] for e in per_token) == TOKENIZER.decode(ids)

    status, body = http_post(server.http_port, "/v2/models/llm/generate", {"text_input": prompt, "max_tokens": 24})
    assert status == 200
    import json
    whole = json.loads(body)
    assert whole["text_output"] == prompt + TOKENIZER.decode(ids)  # input included unless excluded
    status, body = http_post(server.http_port, "/v2/models/llm/generate",
                             {"text_input": prompt, "max_tokens": 24, "exclude_input_in_output": True})
    assert json.loads(body)["text_output"] == TOKENIZER.decode(ids)


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_http_fields_that_name_no_input_are_refused_by_name(server, path):
    """Triton hands JSON fields that name no input to the model as parameters; none is silently dropped."""
    status, body = http_post(server.http_port, f"/v2/models/llm/{path}",
                             {"text_input": "hi", "max_token": 100, "num_return_sequence": 2, "stream": True})
    assert status != 200 or "error" in body
    assert "['max_token', 'num_return_sequence']" in body
    status, body = http_post(server.http_port, f"/v2/models/llm/{path}", {"text_input": "hi", "max_tokens": 2})
    assert status == 200 and "error" not in body


def test_steps_are_shared_and_a_late_request_is_served_at_once(server):
    """Seven long requests are mid-generation when a short one arrives: it is served, start to end, while all
    seven still run (they are cancelled after it; each could run LONG_STREAM tokens on the long-context model,
    so neither a loaded machine that delays the late client's connection nor a fast one lets them finish first;
    together they fit the pool; they stream 16 tokens a response, so receiving them does not slow this process's
    late client), and the steps are shared."""
    model, port = "llm_long", server.metrics_port
    steps_before = metric(port, "inflight_steps_total", model)
    tokens_before = metric(port, "inflight_generated_tokens_total", model)
    ended_before = {r: metric(port, "inflight_requests_finished_total", model, reason=r) for r in REASONS}
    started = threading.Barrier(8, timeout=300)  # (a broken wait fails the test instead of hanging it)
    late_done = threading.Event()
    results = [None] * 8

    def early(i):
        waited = []

        def on_token(out):  # a response may carry several tokens (coalesced): wait once, at 5 or more
            if len(out.ids) >= 5 and not waited:
                waited.append(True)
                started.wait()
        results[i] = grpc_generate(url(server), model, {"text_input": f"request {i}", "max_tokens": LONG_STREAM,
                                                        "min_tokens": LONG_STREAM, "stream": True,
                                                        "stream_interval": 16},
                                   on_token=on_token, cancel_event=late_done)

    threads = [threading.Thread(target=early, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    started.wait()  # every early request is mid-generation
    results[7] = grpc_generate(url(server), model, {"text_input": "late", "max_tokens": 5, "stream": True})
    late_done.set()
    for t in threads:
        t.join()
    assert results[7].error is None and results[7].finish_reason in ("length", "stop")
    # none had ended when the late one had: it did not wait behind their long streams (their responses come 16
    # tokens apart, so one may have had its last before the late one's first: no comparison of those times)
    assert not any(r.final for r in results[:7])
    # all eight end (one whose cancellation Triton missed runs to its end first); the whole test may take
    # less than the 0.2 s between two publications of the engine's counters
    wait_until_ended(port, model, ended_before, 8)
    assert wait_for_metric(port, "inflight_kv_blocks_used", model, 0) == 0  # the cancelled ones freed their blocks
    # steps were shared: fewer steps than tokens generated. The server's count, not the clients': a client blocked
    # at the barrier receives nothing while one stream, alone on a slow machine, runs hundreds of steps
    tokens = wait_for_change(lambda: metric(port, "inflight_generated_tokens_total", model), tokens_before)
    assert metric(port, "inflight_steps_total", model) - steps_before < tokens - tokens_before


def wait_for_change(read, old: float, timeout: float = 30.0) -> float:
    """The value once it differs from `old` (the last publication after the requests ended)."""
    deadline = time.monotonic() + timeout
    while (value := read()) == old and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_cli_generate_streams_the_completion(server):
    cli = [sys.executable, "-m", "inflight_backend.cli", "generate", "Hello", "--max-tokens", "12",
           "--url", url(server)]
    done = subprocess.run(cli, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    expected = grpc_generate(url(server), "llm", {"text_input": "Hello", "max_tokens": 12, "stream": True})
    assert done.stdout.decode() == expected.text
    assert b"finish_reason=" in done.stderr


def test_models_use_the_configured_attention_backend(server):
    log = server.log_file.read_text()
    ready = {line.split("model ")[1].split(" ")[0]: line for line in log.splitlines() if "inflight: model" in line}
    assert "attention: native" in ready["llm"]  # auto: the kernel library is built by `make native`
    assert "attention: torch" in ready["llm_gqa"]


def test_concurrent_streams_and_stream_interval_carry_exactly_the_unstreamed_tokens_and_text(server):
    """24 streams at once (the responder may merge a stream's waiting tokens into one response) and streams with
    stream_interval 5: each concatenates to the ids and text of the same request answered in one response; every
    response but the last of a stream_interval stream carries at least 5 tokens; the last one is FINAL."""
    prompts = [f"coalesce {i} {'xyz' * i}" for i in range(24)]
    whole = [grpc_generate(url(server), "llm", {"text_input": p, "max_tokens": 23, "stream": False,
                                                "exclude_input_in_output": True}) for p in prompts]
    streamed = [None] * len(prompts)
    interval = [None] * 4

    def send(i):
        streamed[i] = grpc_generate(url(server), "llm", {"text_input": prompts[i], "max_tokens": 23, "stream": True})

    def send_interval(i):
        values = {"text_input": prompts[i], "max_tokens": 23, "stream": True, "stream_interval": 5}
        seen = []
        interval[i] = grpc_generate(url(server), "llm", values, on_token=lambda r: seen.append(len(r.ids)))
        interval[i].sizes = [b - a for a, b in zip([0] + seen, seen)]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(24)]
    threads += [threading.Thread(target=send_interval, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, result in enumerate(streamed):
        assert result.error is None and result.final
        assert (result.ids, result.text) == (whole[i].ids, whole[i].text), i
        assert result.num_responses <= len(result.ids) + 1
    for i, result in enumerate(interval):
        assert (result.ids, result.text) == (whole[i].ids, whole[i].text), i
        assert all(size >= 5 for size in result.sizes[:-1]) and sum(result.sizes) == len(result.ids), result.sizes
        assert len(result.sizes) <= len(result.ids) // 5 + 1


@pytest.mark.parametrize("values, message", [
    ({"stream": False, "stream_interval": 4}, "stream_interval applies to streamed requests only"),
    ({"stream": True, "stream_interval": 0}, "stream_interval must be in [1, 4096], got 0"),
    ({"stream": True, "stream_interval": 2, "return_log_probs": True}, "stream_interval > 1 cannot be combined"),
])
def test_bad_stream_intervals_are_refused_by_name(server, values, message):
    result = grpc_generate(url(server), "llm", {"text_input": "x", "max_tokens": 3, **values})
    assert result.error is not None and message in result.error


def test_a_client_that_reads_ids_only_gets_the_same_ids(server):
    """Asking for output_ids alone (as benchmarks and token-counting clients do) skips detokenizing; the ids are
    those of a request that reads everything."""
    values = {"text_input": "ids only, please", "max_tokens": 20, "stream": True}
    full = grpc_generate(url(server), "llm", values)
    ids_only = grpc_generate(url(server), "llm", values, outputs=["output_ids"])
    assert ids_only.ids == full.ids and full.text
    assert ids_only.output_names == {"output_ids"}


def test_a_model_in_two_instances_gives_each_its_share_of_the_cores_and_the_same_tokens(server):
    """instance_group count 2: two stub processes, each an engine on half of torch's threads (their spinning
    OpenMP threads would otherwise outnumber the cores), both giving the default model's greedy tokens."""
    import torch

    threads = max(1, torch.get_num_threads() // 2)
    ready = [line for line in server.log_file.read_text(errors="replace").splitlines()
             if "inflight: model llm_two ready" in line]
    assert len(ready) == 2 and all(f"{threads} CPU threads" in line for line in ready), ready
    for i in range(4):  # Triton spreads them over both instances
        inputs = {"text_input": f"instance prompt {i}", "max_tokens": 8, "stream": True}
        assert grpc_generate(url(server), "llm_two", inputs).ids == grpc_generate(url(server), "llm", inputs).ids
