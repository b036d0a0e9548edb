"""The PyTorch engine: packs a step's tokens, builds the paged-attention metadata, runs the Llama model."""
from __future__ import annotations

import torch

from ..attention import AttentionMetadata, make_backend
from ..checkpoint import load_model
from ..models import device_kernels
from ..scheduler_output import SchedulerOutput
from .base import ModelRunner
from . import kv_pool
from .cuda_graphs import DecodeGraphs
from .step_inputs import StepInputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchRunner(ModelRunner):
    """Runs a checkpoint with torch on CPU or CUDA over a preallocated paged KV pool."""

    def __init__(self, checkpoint: str, num_blocks: int, block_size: int, device: str = "cpu",
                 dtype: str = "float32", attention: str = "auto", linear: str = "auto",
                 amx_gemm: str = "auto", cuda_graphs: bool = False, max_batch_size: int = 64,
                 greedy_screen: str = "auto", cuda_fused_ops: str = "off") -> None:
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        self.attention = make_backend(attention, self.device)
        self.model = device_kernels.place(load_model(checkpoint, self.attention, self.dtype), device, linear,
                                          amx_gemm, greedy_screen, cuda_fused_ops)
        self.screens_greedy = self.model.greedy_screen is not None
        self._screened = False  # whether the last execute returned a screen's logits
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(kv_pool.zeros(shape, self.dtype, self.device), kv_pool.zeros(shape, self.dtype, self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.graphs = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise RuntimeError(f"cuda_graphs: true applies to CUDA devices (device {self.device})")
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.attention, max_batch_size, block_size,
                                       cfg.max_position_embeddings, self.device)

    def describe(self) -> str:
        graphs = f", decode steps in CUDA graphs (to {self.graphs.max_context} tokens)" if self.graphs else ""
        return (f"pytorch {self.dtype} on {self.device}, attention: {self.attention.name}, "
                f"linear: {self.model.linear_layout}{graphs}; {self.model.load_report}")

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, greedy_only: bool = False) -> torch.Tensor:
        screen = self.model.greedy_screen
        self._screened = greedy_only and screen is not None and screen.worthwhile
        step = StepInputs.build(output, self.block_size)
        if self.graphs is not None and self.graphs.covers(step):
            return self.graphs.run(step)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slot_mapping),
            block_tables=self._tensor(step.block_tables, torch.int32),
            query_start_loc=step.query_start_loc,
            context_lens=step.context_lens,
            decode_only=step.decode_only,
            query_start_loc_tensor=self._tensor(step.query_start_loc, torch.int32),
            context_lens_tensor=self._tensor(step.context_lens, torch.int32),
        )
        return self.model(self._tensor(step.input_ids), self._tensor(step.positions), self.kv_caches, meta,
                          self._tensor(step.sample_indices), screen=self._screened)

    def refine_greedy(self, logits: torch.Tensor) -> None:
        if self._screened and self.model.greedy_screen is not None:
            self._screened = False
            self.model.greedy_screen.refine(logits)

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
