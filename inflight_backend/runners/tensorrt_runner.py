"""The TensorRT engine behind the same runner interface as the PyTorch one (`engine: tensorrt`, `engine_path`).

Deserializes a plan from `inflight build-engine`, keeps the KV pool (layers, 2, blocks, block_size, KV heads,
head size) on the GPU in torch memory, binds the step's tensors and enqueues on torch's current CUDA stream.
Needs a CUDA device and a TensorRT that runs on it (TensorRT-RTX: Ampere/Ada/Blackwell; Hopper: full TensorRT).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..scheduler_output import SchedulerOutput
from .base import ModelRunner
from .step_inputs import StepInputs


class TensorRTRunner(ModelRunner):
    def __init__(self, engine_path: str, num_blocks: int, block_size: int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("engine: tensorrt needs a CUDA device; none is visible (use engine: pytorch)")
        from ..tensorrt.plugin import register, trt

        register()  # the plan references the PagedAttention creator by name
        path = Path(engine_path)
        spec = json.loads((path / "engine.json").read_text())["spec"]
        pool_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[spec["dtype"]]
        if spec["block_size"] != block_size:
            raise ValueError(f"engine built for block_size {spec['block_size']}, config asks {block_size}")
        from ..checkpoint import load_config

        cfg = load_config(spec["checkpoint"])
        self.vocab_size = cfg.vocab_size
        self.block_size = block_size
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
            (path / "engine.plan").read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {path / 'engine.plan'} on this GPU")
        self.context = self.engine.create_execution_context()
        self.device = torch.device("cuda")
        self.kv_pool = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads,
                                   cfg.head_dim, dtype=pool_dtype, device=self.device)
        self.dtype = spec["dtype"]

    def describe(self) -> str:
        return f"tensorrt plan ({self.dtype}), attention: PagedAttention plugin (CUDA kernels)"

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, greedy_only: bool = False) -> torch.Tensor:
        step = StepInputs.build(output, self.block_size)
        tensors = {name: torch.tensor(values, dtype=dtype, device=self.device)
                   for name, (values, dtype) in step.engine_inputs().items()}
        tensors["kv_pool"] = self.kv_pool
        logits = torch.empty(len(step.sample_indices), self.vocab_size, dtype=torch.float32, device=self.device)
        for name, tensor in tensors.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        self.context.set_tensor_address("logits", logits.data_ptr())
        self.context.set_tensor_address("kv_pool_out", self.kv_pool.data_ptr())  # aliased: updated in place
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return logits
