"""One streaming HTTP client for every server: each request on its own connection and thread, its server-sent
events read line by line, every token's arrival time recorded. The peers (`vllm:`, `llamacpp:`) and Triton's
`/generate_stream` (`triton:...+http`) are driven by this same code, so no server is measured through a cheaper or
dearer client than another (each shares the server's cores).
"""
from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable

from benchmarks.targets import Submitter, new_records
from benchmarks.workload import WorkItem

Body = Callable[[list[int], int], "tuple[str, dict]"]  # (prompt ids, output tokens) -> (path, JSON body)
Tokens = Callable[[dict], "tuple[int, bool]"]  # one event -> (tokens it carries, whether it is the last)


def post(port: int, path: str, body: dict, timeout: float = 3600.0):
    """(connection, response) of a JSON POST to the loopback server on `port`; the caller closes the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def stream_all(port: int, name: str, items: list[WorkItem], arrivals: list[float], concurrency: int | None,
               body: Body, tokens_in: Tokens):
    """Every item streamed from the server on `port` at its arrival (or under `concurrency`); the records."""
    records = new_records(items, arrivals)
    sub = Submitter(records, concurrency)
    lock = threading.Lock()  # Submitter's token/finished are for one delivering thread: serialise them

    def one(i: int) -> None:
        path, payload = body(items[i].prompt_ids, items[i].output_len)
        conn, response = post(port, path, payload)
        try:
            if response.status != 200:
                raise RuntimeError(f"{name}: HTTP {response.status}: {response.read()[:300]!r}")
            for line in response:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                count, last = tokens_in(json.loads(line[5:]))
                if count:
                    now = sub.now()
                    with lock:
                        for _ in range(count):
                            sub.token(i, now)
                if last:
                    break
        finally:
            conn.close()
            with lock:
                sub.finished()

    sub.run(lambda i: threading.Thread(target=one, args=(i,), daemon=True).start())
    return records
