"""The exported ONNX graph computes the PyTorch engine's logits on a mixed prefill/decode step (evaluated on the
CPU by onnx's ReferenceEvaluator, PagedAttention by our native kernel)."""
import numpy as np
import pytest
import torch

from inflight_backend.block_manager import BlockManager
from inflight_backend.runners.step_inputs import StepInputs
from inflight_backend.runners.torch_runner import TorchRunner
from inflight_backend.request import Request, SamplingParams
from inflight_backend.scheduler_output import ScheduledRequest, SchedulerOutput, is_decode

onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install .[tensorrt])")
from inflight_backend.tensorrt.onnx_export import DOMAIN, OP_TYPE, export  # noqa: E402
from inflight_backend.tensorrt.reference import evaluator  # noqa: E402

ATOL = 1e-3  # fp32; the two graphs order some reductions differently


def schedule(bm, items):
    out = SchedulerOutput()
    for req, n in items:
        assert bm.allocate(req.req_id, req.num_computed_tokens + n)
        sample = req.num_computed_tokens + n == req.num_tokens
        out.scheduled.append(ScheduledRequest(req, n, sample, bm.block_table(req.req_id), is_decode(req)))
    return out


def feeds(out: SchedulerOutput, runner: TorchRunner, block_size: int) -> dict:
    step = StepInputs.build(out, block_size)
    inputs = {name: torch.tensor(values, dtype=dtype).numpy() for name, (values, dtype) in step.engine_inputs().items()}
    inputs["kv_pool"] = torch.stack([torch.stack(pair) for pair in runner.kv_caches]).numpy().copy()
    return inputs


# (logits atol, pool atol) per dtype: fp32 reorders some reductions; fp16 rounds every activation (logits ~30).
TOLERANCE = {"float32": (ATOL, 1e-4), "float16": (0.15, 2e-2)}


@pytest.fixture(scope="module")
def mistral_window_model(tmp_path_factory):
    """Mistral with a 12-token sliding window (tests/test_model_families.py): shorter than the step's prompts."""
    from tests.test_model_families import make_family_checkpoint

    path = str(tmp_path_factory.mktemp("mistral-window") / "m")
    make_family_checkpoint(path, "mistral")
    return path


@pytest.mark.parametrize("checkpoint, block_size, dtype", [("tiny_model", 16, "float32"), ("gqa_model", 4, "float32"),
                                                           ("tied_model", 1, "float32"), ("gqa_model", 8, "float16"),
                                                           ("mistral_window_model", 16, "float32")])
def test_onnx_graph_matches_the_pytorch_engine_on_a_mixed_step(checkpoint, block_size, dtype, request):
    path = request.getfixturevalue(checkpoint)
    model = export(path, block_size, dtype=dtype)
    onnx.checker.check_model(model)
    layers = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    runner = TorchRunner(path, 128, block_size, dtype=dtype, attention="torch")
    assert len(layers) == runner.model.config.num_hidden_layers
    windows = [next((a.i for a in n.attribute if a.name == "sliding_window"), None) for n in layers]
    assert windows == list(runner.model.config.layer_windows or [0] * len(layers))

    bm = BlockManager(128, block_size)
    rng = np.random.default_rng(0)
    a = Request("a", rng.integers(0, 258, 20).tolist(), SamplingParams(8))
    c = Request("c", rng.integers(0, 258, 25).tolist(), SamplingParams(8))
    first = schedule(bm, [(a, 20), (c, 10)])  # a: whole prompt; c: a first chunk
    runner.execute(first)
    for item in first.scheduled:
        item.request.num_computed_tokens += item.num_tokens
    a.output_ids.append(7)
    b = Request("b", rng.integers(0, 258, 30).tolist(), SamplingParams(8))
    mixed = schedule(bm, [(a, 1), (b, 30), (c, 15)])  # decode + whole prompt + last chunk
    inputs = feeds(mixed, runner, block_size)
    assert inputs["kv_pool"].dtype == np.dtype(dtype)
    logits_onnx, pool_onnx = evaluator(model).run(None, inputs)
    logits_torch = runner.execute(mixed)
    logits_atol, pool_atol = TOLERANCE[dtype]
    assert logits_onnx.dtype == np.float32 and pool_onnx.dtype == np.dtype(dtype)
    np.testing.assert_allclose(logits_onnx, logits_torch.numpy(), atol=logits_atol, rtol=0)
    assert (logits_onnx.argmax(-1) == logits_torch.numpy().argmax(-1)).all()
    pool_torch = torch.stack([torch.stack(pair) for pair in runner.kv_caches]).numpy()
    np.testing.assert_allclose(pool_onnx, pool_torch, atol=pool_atol, rtol=0)  # the new K/V landed in their slots
