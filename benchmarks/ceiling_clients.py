"""serving_ceiling.py's load generators, one process each (spawned: no inherited threads or gRPC state).

Each sends its share of the requests once `start` is set (after `ready`, so imports and connections are not
timed) and puts its tokens, end time, CPU seconds and first errors on `result_queue`.
"""
from __future__ import annotations

import json
import threading
import time


def grpc_input(name: str, array, kind: str):
    """A tritonclient gRPC input holding `array` (Triton type name `kind`). Defined here, not imported from the
    measured tree: with --baseline, `benchmarks` is the older commit's package, which may not have it."""
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(array.shape), kind)
    t.set_data_from_numpy(array)
    return t


def grpc_client(port: int, requests: list[tuple[str, list[int]]], output_len: int, ready, start,
                 result_queue, batched: bool = False) -> None:
    """`batched`: to the batched-layout model (every input with a leading batch dimension of 1)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    done, tokens, lock = threading.Event(), [0], threading.Lock()
    remaining = [len(requests)]
    errors: list[str] = []
    last: dict[str, float] = {}  # each stream's last response time
    gaps: list[float] = []  # each token's share of the time since its stream's last response

    def callback(result, error):
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        now = time.perf_counter()
        ids = result.as_numpy("output_ids")
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        n = 0 if ids is None else int(ids.size)
        with lock:
            tokens[0] += n
            if n:
                if response.id in last:
                    gaps.extend([(now - last[response.id]) / n] * n)
                last[response.id] = now
            if final:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

    def tensor(name, array, dtype):
        return grpc_input(name, array.reshape(1, -1) if batched else array, dtype)

    model = "bench_batched" if batched else "bench"
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=callback)
    n = np.array([output_len], dtype=np.int32)
    bodies = [(rid, [tensor("input_ids", np.array(ids, dtype=np.int32), "INT32"), tensor("max_tokens", n, "INT32"),
                     tensor("min_tokens", n, "INT32"), tensor("stream", np.array([True]), "BOOL")])
              for rid, ids in requests]
    wanted = [grpcclient.InferRequestedOutput("output_ids")]
    cpu = time.process_time()
    ready.wait()
    start.wait()
    if not bodies:
        done.set()
    for rid, inputs in bodies:
        client.async_stream_infer(model, inputs, request_id=rid, outputs=wanted, enable_empty_final_response=True)
    done.wait()
    end = time.perf_counter()
    client.stop_stream()
    client.close()
    result_queue.put({"tokens": tokens[0], "end": end, "cpu": time.process_time() - cpu, "errors": errors[:3],
                      "gaps": gaps})


def http_client(port: int, requests: list[tuple[str, list[int]]], output_len: int, ready, start,
                 result_queue) -> None:
    import http.client

    tokens, errors, lock = [0], [], threading.Lock()

    def one(ids):
        body = json.dumps({"input_ids": ids, "max_tokens": output_len, "min_tokens": output_len, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v2/models/bench/generate_stream", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        count = 0
        for line in response:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    errors.append(event["error"])
                    break
                ids = event.get("output_ids", [])
                count += len(ids) if isinstance(ids, list) else 1
        conn.close()
        with lock:
            tokens[0] += count

    threads = [threading.Thread(target=one, args=(ids,)) for _, ids in requests]
    cpu = time.process_time()
    ready.wait()
    start.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result_queue.put({"tokens": tokens[0], "end": time.perf_counter(), "cpu": time.process_time() - cpu,
                      "errors": errors[:3]})
