"""Hostile requests and vanished clients through the real server: each fails or stops alone, the streams
beside it finish with their exact tokens, and every rejection is counted."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import LONG_STREAM, Oracle
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
REASONS = ("stop", "length", "cancelled", "error")


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


def test_cancelled_streams_among_64_stop_and_the_others_finish(server):
    """64 open streams, half cancelled by their clients after a few tokens: the others run to their length, every
    request ends once, and the blocks come back. (Triton 2.51's gRPC frontend occasionally fails to flag a
    cancelled stream's request, which then runs to its max_tokens: cancellations are counted, not required;
    that each flagged request is cancelled is test_cancel_watcher's.)"""
    model, port = "llm", server.metrics_port
    before = {r: metric(port, "inflight_requests_finished_total", model, reason=r) for r in REASONS}
    results = [None] * 64

    def send(i):  # a cancelled stream is forced to 1,000 tokens: its client's cancel comes long before its end
        cancel = i % 2 == 0
        n = 1000 if cancel else 24
        results[i] = grpc_generate(url(server), model, {"text_input": f"stream {i}", "max_tokens": n,
                                                        "min_tokens": n, "stream": True},
                                   cancel_after=3 if cancel else None)

    run_threads([lambda i=i: send(i) for i in range(64)])
    assert all(r.error is None and r.finish_reason == "length" and len(r.ids) == 24 for r in results[1::2])
    assert all(len(r.ids) >= 3 and not r.final for r in results[::2])
    wait_until_ended(port, model, before, 64)
    after = {r: metric(port, "inflight_requests_finished_total", model, reason=r) for r in REASONS}
    assert after["cancelled"] - before["cancelled"] > 0 and after["error"] == before["error"]
    assert wait_for_metric(port, "inflight_kv_blocks_used", model, 0) == 0


# A client process that opens N streams (N requests of MAX_TOKENS, default 1900), prints a line per response
# ("token I", "final I", "stopping I" for the server's shutdown error, "error I" for any other; I is the stream)
# and keeps its streams open until it is killed. The model: $KILLED_CLIENT_MODEL, else llm.
KILLED_CLIENT = """
import os, sys, time
import tritonclient.grpc as grpcclient
from tests.triton_helpers import infer_inputs
url, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1900
gated = sys.argv[4:] == ["gated"]  # connect, say so, and send only once a line comes on stdin
model = os.environ.get("KILLED_CLIENT_MODEL", "llm")
def line(result, error, i):  # one write per response ("token 3"): lines never mix
    if error is not None:
        kind = "stopping" if "shutting down" in str(error) else "error"
    else:
        kind = "final" if result.get_response().parameters["triton_final_response"].bool_param else "token"
    return f"{kind} {i}\\n".encode()
clients = [grpcclient.InferenceServerClient(url) for i in range(n)]
for i, c in enumerate(clients):
    c.start_stream(callback=lambda result, error, i=i: os.write(1, line(result, error, i)))
requests = [infer_inputs({"text_input": f"killed {i}", "max_tokens": max_tokens, "min_tokens": max_tokens,
                          "stream": True}) for i in range(n)]
if gated:
    os.write(1, b"connected 0\\n")
    sys.stdin.readline()
for c, inputs in zip(clients, requests):  # sent together: on a loaded machine, slow set-up between requests
    c.async_stream_infer(model, inputs)   # let the first ones finish before the last began
time.sleep(600)
"""


def test_a_killed_client_stops_its_requests(server):
    """A client process killed with SIGKILL (no cancel sent): each of its requests that Triton marks cancelled
    ends as cancelled, and every one ends and frees its blocks.

    Not all are marked: Triton 2.51's gRPC frontend sometimes misses the cancellation of some of a dead client's
    streams that shared one connection (its verbose log then shows fewer "Issuing cancellation" lines than
    streams), and no other signal reaches a Python model (send() to a dead stream succeeds). Those run to
    max_tokens: LONG_STREAM on the long-context model, so that none ends before the kill, however fast the
    machine, and a missed one ends in seconds (6 fit the pool)."""
    model, port, n, max_tokens = "llm_long", server.metrics_port, 6, LONG_STREAM
    before = {r: metric(port, "inflight_requests_finished_total", model, reason=r) for r in REASONS}
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, url(server), str(n), str(max_tokens)],
                              stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)),
                              env={**os.environ, "KILLED_CLIENT_MODEL": model})
    try:
        await_tokens_on_every_stream(client, n)  # all n requests are in (and running: they fit the pool together)
    finally:
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
    wait_until_ended(port, model, before, n)  # a missed cancellation runs its LONG_STREAM tokens
    after = {r: metric(port, "inflight_requests_finished_total", model, reason=r) for r in REASONS}
    assert sum(after.values()) - sum(before.values()) == n
    assert after["cancelled"] > before["cancelled"] and after["error"] == before["error"]
    assert wait_for_metric(port, "inflight_kv_blocks_used", model, 0) == 0
    assert grpc_generate(url(server), model, {"text_input": "after", "max_tokens": 2}).error is None


def wait_until_ended(port: int, model: str, before: dict, n: int, timeout: float = 120.0) -> None:
    """Until n more requests have ended (any reason) than `before` counted."""
    deadline = time.monotonic() + timeout
    while (ended := sum(metric(port, "inflight_requests_finished_total", model, reason=r) - before[r]
                        for r in REASONS)) < n:
        assert time.monotonic() < deadline, f"{ended} of {n} requests ended"
        time.sleep(0.1)


def await_tokens_on_every_stream(client: subprocess.Popen, n: int, final_ok: bool = False) -> None:
    """Read KILLED_CLIENT's output until each of its n streams has had a token. With final_ok, a stream may also
    have ended (under load some of a killed client's streams can finish before its last one is scheduled)."""
    seen: set[bytes] = set()
    while len(seen) < n:
        kind, index = client.stdout.readline().split()
        assert kind == b"token" or (final_ok and kind == b"final"), (kind, index)
        seen.add(index)
