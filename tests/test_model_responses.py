"""The Triton entry builds only the response tensors a request asked for (checked with a stand-in for
triton_python_backend_utils, which exists only inside Triton; the end-to-end tests use the real one)."""
import sys
import types

import numpy as np
import pytest

from inflight_backend.engine import RequestOutput, RequestTimes


class _Tensor:
    def __init__(self, name, array):
        self._name, self.array = name, array

    def name(self):
        return self._name


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name(): t.array for t in output_tensors or []}


@pytest.fixture()
def model_module(monkeypatch):
    fake = types.SimpleNamespace(Tensor=_Tensor, InferenceResponse=_Response, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "inflight_backend.model", raising=False)
    import inflight_backend.model as model

    yield model
    sys.modules.pop("inflight_backend.model", None)


def stream(model, outputs, perf=False):
    return model._Stream(sender=None, stream=True, prefix_text="", prefix_ids=[], arrival=0.0,
                         return_perf_metrics=perf, outputs=outputs)


def final_output():
    return RequestOutput("0", [7], "x", "length", num_input_tokens=3, num_output_tokens=5,
                         times=RequestTimes(arrival=1.0, first_scheduled=1.1, first_token=1.2, last_token=1.5))


def test_all_outputs_when_the_client_names_none(model_module):
    response = model_module._response("x", [7], final_output(), stream(model_module, None, perf=True))
    assert {"text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens",
            "arrival_time_ns", "last_token_time_ns"} <= set(response.tensors)
    assert response.tensors["output_ids"].tolist() == [7]


def test_only_requested_outputs_are_built(model_module):
    wanted = frozenset({"output_ids", "num_output_tokens", "last_token_time_ns"})
    response = model_module._response("x", [7], final_output(), stream(model_module, wanted, perf=True))
    assert set(response.tensors) == wanted
    assert response.tensors["num_output_tokens"].tolist() == [5]
    assert response.tensors["last_token_time_ns"].tolist() == [1_500_000_000]
    partial = RequestOutput("0", [9], "y")  # not finished: no final-only tensors even if asked for
    response = model_module._response("y", [9], partial, stream(model_module, wanted))
    assert set(response.tensors) == {"output_ids"}
    assert response.tensors["output_ids"].dtype == np.int32
