"""Response tensors (`responses.py`): only what a request asked for is built; TensorRT-LLM's batched shapes and
this backend's unbatched ones; rows of a unary response stacked and padded; vLLM's logprobs JSON."""
import json

import numpy as np

from inflight_backend import responses
from inflight_backend.outputs import RequestOutput, RequestTimes
from inflight_backend.responses import Piece


def final_output():
    return RequestOutput("0", [7], "x", "length", num_input_tokens=3, num_output_tokens=5,
                         times=RequestTimes(arrival=1.0, first_scheduled=1.1, first_token=1.2, last_token=1.5))


def piece(ids=(7,), final=True, **kw):
    return Piece("x", list(ids), list(ids), 0, 0, final=final_output() if final else None, **kw)


def test_all_outputs_when_the_client_names_none():
    t = responses.tensors(piece(), frozenset(), True, None, str, kv_blocks=2)
    assert {"text_output", "output_ids", "sequence_length", "batch_index", "finish_reason", "num_input_tokens",
            "num_output_tokens", "arrival_time_ns", "last_token_time_ns", "kv_cache_alloc_total_blocks"} <= set(t)
    assert list(t)[0] == "output_ids"  # benchmark_core_model.py reads the first output's shape
    assert t["output_ids"].shape == (1, 1, 1) and t["text_output"].shape == (1,)
    assert "output_log_probs" not in t and "generation_logits" not in t


def test_only_requested_outputs_are_built():
    wanted = frozenset({"output_ids", "num_output_tokens", "last_token_time_ns"})
    t = responses.tensors(piece(), frozenset(), True, wanted, str)
    assert set(t) == wanted
    assert t["num_output_tokens"].tolist() == [[5]] and t["last_token_time_ns"].tolist() == [[1_500_000_000]]
    t = responses.tensors(piece(final=False), frozenset(), True, wanted, str)  # no final-only tensors yet
    assert set(t) == {"output_ids"} and t["output_ids"].dtype == np.int32


def test_unbatched_shapes_drop_the_row_and_beam_axes():
    t = responses.unbatched(responses.tensors(piece(ids=(7, 8)), frozenset({"output_log_probs"}), False, None,
                                              str))
    assert t["output_ids"].tolist() == [7, 8] and t["text_output"].shape == (1,)
    assert t["finish_reason"].shape == (1,) and t["batch_index"].shape == (1,)


def test_stacked_rows_are_padded():
    a = responses.tensors(piece(ids=(1, 2, 3)), frozenset(), False, None, str)
    b = responses.tensors(Piece("y", [4], [4], 1, 0, final=final_output()), frozenset(), False, None, str)
    t = responses.stack([a, b], pad_id=-3)
    assert t["output_ids"].tolist() == [[[1, 2, 3]], [[4, -3, -3]]]
    assert t["sequence_length"].tolist() == [[3], [1]] and t["batch_index"].tolist() == [[0], [1]]
    assert t["text_output"].tolist() == [b"x", b"y"]
    u = responses.unbatched(t)
    assert u["output_ids"].tolist() == [[1, 2, 3], [4, -3, -3]] and u["sequence_length"].tolist() == [3, 1]


def test_vllm_logprobs_json():
    p = piece(ids=(5, 6), logprobs=[-0.1, -2.0], top=[((5, -0.1), (9, -3.0)), ((9, -0.5), (6, -2.0))])
    t = responses.tensors(p, frozenset({"logprobs", "cumulative_logprob"}), False, None, lambda t: f"<{t}>")
    entries = json.loads(t["logprobs"][0])
    assert entries[0] == {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "<5>"},
                          "9": {"logprob": -3.0, "rank": 2, "decoded_token": "<9>"}}
    assert entries[1]["6"]["rank"] == 2 and entries[1]["9"]["rank"] == 1
    assert json.loads(responses.tensors(piece(), frozenset({"logprobs"}), False, None, str)["logprobs"][0]) is None
