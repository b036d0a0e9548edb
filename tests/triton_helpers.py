"""Client-side helpers for the end-to-end tests: real tritonclient gRPC streams and HTTP generate calls."""
from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from inflight_backend.declared_io import all_inputs
from inflight_backend.server import read_metrics

_NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_BOOL": np.bool_, "TYPE_FP32": np.float32,
          "TYPE_UINT64": np.uint64, "TYPE_INT64": np.int64}


def infer_inputs(values: dict, types: dict | None = None) -> list[grpcclient.InferInput]:
    """Build gRPC inputs from Python values; scalars become shape [1], lists shape [n]. `types` overrides."""
    specs = all_inputs()
    inputs = []
    for name, value in values.items():
        triton_type = (types or {}).get(name) or specs[name][0]
        array = np.array(value if isinstance(value, (list, tuple)) else [value], dtype=_NUMPY[triton_type])
        if triton_type == "TYPE_STRING":
            array = np.array([v.encode() if isinstance(v, str) else v for v in array], dtype=np.object_)
        tensor = grpcclient.InferInput(name, list(array.shape), triton_type.removeprefix("TYPE_")
                                       .replace("STRING", "BYTES"))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class StreamResult:
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    num_responses: int = 0
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None
    error: str | None = None
    final: bool = False
    output_names: set[str] = field(default_factory=set)  # every output any response carried

    @property
    def text(self) -> str:
        return "".join(self.texts)


def grpc_generate(url: str, model: str, values: dict, types: dict | None = None, cancel_after: int | None = None,
                  timeout: float = 120.0, on_token=None, cancel_event=None, outputs: list[str] | None = None
                  ) -> StreamResult:
    """Send one request on its own gRPC stream and collect every response until the FINAL flag.
    The stream is cancelled after `cancel_after` tokens, or at the first response after `cancel_event` is set.
    `outputs` names the outputs to request (default: all)."""
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.monotonic())))
    out = StreamResult()
    try:
        requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
        client.async_stream_infer(model, infer_inputs(values, types), outputs=requested,
                                  enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while not out.final:
            result, error, when = responses.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                out.error, out.final = str(error), True
                break
            _collect(out, result, when)
            if on_token is not None:
                on_token(out)
            stop = cancel_event is not None and cancel_event.is_set()
            if (stop or cancel_after is not None and len(out.ids) >= cancel_after) and not out.final:
                client.stop_stream(cancel_requests=True)
                return out
    finally:
        client.stop_stream()
        client.close()
    return out


def _collect(out: StreamResult, result, when: float) -> None:
    out.num_responses += 1
    out.final = result.get_response().parameters["triton_final_response"].bool_param
    text, ids = result.as_numpy("text_output"), result.as_numpy("output_ids")
    if text is not None:
        out.texts.append(b"".join(text.reshape(-1)).decode("utf-8"))
    if ids is not None and ids.size:
        out.ids += ids.reshape(-1).tolist()
        out.token_times += [when] * ids.size
    out.output_names.update(o.name for o in result.get_response().outputs)
    if (reason := result.as_numpy("finish_reason")) is not None:
        out.finish_reason = reason.reshape(-1)[0].decode()
    if (count := result.as_numpy("num_input_tokens")) is not None:
        out.num_input_tokens = int(count[0])
    if (count := result.as_numpy("num_output_tokens")) is not None:
        out.num_output_tokens = int(count[0])
    if (count := result.as_numpy("num_cached_tokens")) is not None:
        out.num_cached_tokens = int(count[0])


def http_post(port: int, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def metrics(port: int) -> dict[tuple, float]:
    return read_metrics(port)


def metric(port: int, name: str, model: str, **labels) -> float:
    """One metric's value; 0 for a labelled series not created yet."""
    key = (name, frozenset({"model": model, **labels}.items()))
    return metrics(port).get(key, 0.0)


def wait_for_metric(port: int, name: str, model: str, expected: float, timeout: float = 30.0, **labels) -> float:
    """Metrics are updated after responses are sent; wait (bounded) for the value to settle."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric(port, name, model, **labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
