"""Hostile requests and vanished clients through the real server: each fails or stops alone, the streams
beside it finish with their exact tokens, and every rejection is counted."""
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import Oracle
from tests.triton_helpers import grpc_generate, metric, wait_for_metric

pytestmark = pytest.mark.server

HOSTILE = [  # (values, types, the error names this)
    ({"text_input": "a", "temperature": float("nan")}, None, "'temperature' must be a finite number"),
    ({"text_input": "a", "temperature": float("inf")}, None, "'temperature' must be a finite number"),
    ({"text_input": "a", "top_p": float("nan")}, None, "'top_p' must be a finite number"),
    ({"text_input": "x" * (10 << 20)}, None, "(max_prompt_bytes)"),
    ({"input_ids": [5] * 5000}, None, "(max_prompt_tokens)"),
    ({"text_input": "a", "max_tokens": "many"}, {"max_tokens": "TYPE_STRING"}, "max_tokens"),
]
NEAR_ZERO = [1e-40, 1e-45]  # were accepted and then failed the whole batch; now greedy, their limit


@pytest.fixture(scope="module")
def expected(tiny_model, oracle_cases):
    oracle = Oracle(tiny_model)
    return [oracle.generate(ids, n) for ids, n in oracle_cases[:8]]


def url(server):
    return f"127.0.0.1:{server.grpc_port}"


def run_threads(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_hostile_requests_fail_alone_while_other_streams_finish_exactly(server, oracle_cases, expected):
    port = server.metrics_port
    rejected = {r: metric(port, "inflight_requests_rejected_total", "llm", reason=r) for r in ("invalid", "too_large")}
    good, bad, near_zero = [None] * len(expected), [None] * len(HOSTILE), [None] * len(NEAR_ZERO)

    def normal(i):
        ids, n = oracle_cases[i]
        good[i] = grpc_generate(url(server), "llm", {"input_ids": ids, "max_tokens": n, "stream": True})

    def hostile(i):
        values, types, _ = HOSTILE[i]
        bad[i] = grpc_generate(url(server), "llm", {**values, "stream": True}, types)

    def tiny_temperature(i):
        near_zero[i] = grpc_generate(url(server), "llm", {"input_ids": oracle_cases[3][0], "max_tokens": 7,
                                                          "temperature": NEAR_ZERO[i], "stream": True})

    run_threads([lambda i=i: normal(i) for i in range(len(good))] + [lambda i=i: hostile(i) for i in range(len(bad))]
                + [lambda i=i: tiny_temperature(i) for i in range(len(near_zero))])
    assert [r.ids for r in good] == expected and all(r.error is None for r in good)
    for result, (_, _, message) in zip(bad, HOSTILE):
        assert result.error is not None and message in result.error, result.error
    assert [r.ids for r in near_zero] == [expected[3][:7]] * len(NEAR_ZERO)
    assert wait_for_metric(port, "inflight_requests_rejected_total", "llm", rejected["too_large"] + 2,
                           reason="too_large") == rejected["too_large"] + 2
    # The string max_tokens never reaches the model: Triton refuses the datatype itself.
    assert wait_for_metric(port, "inflight_requests_rejected_total", "llm", rejected["invalid"] + 3,
                           reason="invalid") == rejected["invalid"] + 3
    assert wait_for_metric(port, "inflight_kv_blocks_used", "llm", 0) == 0


def test_every_cancelled_stream_of_64_stops(server):
    """64 open streams, half cancelled by their clients after a few tokens: each of those ends as cancelled
    and stops generating; the others run to their length."""
    model, port = "llm", server.metrics_port
    before = {r: metric(port, "inflight_requests_finished_total", model, reason=r) for r in ("cancelled", "length")}
    generated_before = metric(port, "inflight_generated_tokens_total", model)
    results = [None] * 64

    def send(i):
        cancel = i % 2 == 0
        results[i] = grpc_generate(url(server), model, {"text_input": f"stream {i}", "max_tokens": 1000 if cancel
                                                        else 24, "min_tokens": 24, "stream": True},
                                   cancel_after=3 if cancel else None)

    run_threads([lambda i=i: send(i) for i in range(64)])
    assert all(r.error is None and r.finish_reason == "length" and len(r.ids) == 24 for r in results[1::2])
    assert all(len(r.ids) >= 3 and not r.final for r in results[::2])
    assert wait_for_metric(port, "inflight_requests_finished_total", model, before["cancelled"] + 32,
                           reason="cancelled") == before["cancelled"] + 32
    assert metric(port, "inflight_requests_finished_total", model, reason="length") == before["length"] + 32
    assert wait_for_metric(port, "inflight_kv_blocks_used", model, 0) == 0
    generated = metric(port, "inflight_generated_tokens_total", model) - generated_before
    assert generated < 32 * 24 + 32 * 500, "cancelled requests ran on"  # each would run to 1000


# A client process that opens N streams (N requests of 1900 tokens), prints a line per response ("token",
# "final", "stopping" for the server's shutdown error, "error" for any other) and keeps its streams open until
# it is killed.
KILLED_CLIENT = """
import os, sys, time
import tritonclient.grpc as grpcclient
from tests.triton_helpers import infer_inputs
url, n = sys.argv[1], int(sys.argv[2])
def line(result, error):  # one write per response: lines never mix
    if error is not None:
        return b"stopping\\n" if "shutting down" in str(error) else b"error\\n"
    return b"final\\n" if result.get_response().parameters["triton_final_response"].bool_param else b"token\\n"
clients = []
for i in range(n):
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: os.write(1, line(result, error)))
    c.async_stream_infer("llm", infer_inputs({"text_input": f"killed {i}", "max_tokens": 1900, "min_tokens": 1900,
                                              "stream": True}))
    clients.append(c)
time.sleep(600)
"""


def test_a_killed_client_stops_all_its_requests(server):
    """A client process killed with SIGKILL (no cancel sent): the server notices each stream is gone, ends
    every one of its requests as cancelled and frees their blocks."""
    model, port, n = "llm", server.metrics_port, 6
    cancelled = metric(port, "inflight_requests_finished_total", model, reason="cancelled")
    generated_before = metric(port, "inflight_generated_tokens_total", model)
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, url(server), str(n)], stdout=subprocess.PIPE,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    for _ in range(3 * n):  # tokens are arriving on its streams
        assert client.stdout.readline() == b"token\n"
    os.kill(client.pid, signal.SIGKILL)
    client.wait()
    assert wait_for_metric(port, "inflight_requests_finished_total", model, cancelled + n, timeout=60,
                           reason="cancelled") == cancelled + n
    assert wait_for_metric(port, "inflight_kv_blocks_used", model, 0) == 0
    assert metric(port, "inflight_generated_tokens_total", model) - generated_before < n * 1900
    assert grpc_generate(url(server), model, {"text_input": "after", "max_tokens": 2}).error is None
