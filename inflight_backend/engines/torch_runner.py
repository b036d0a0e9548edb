"""The PyTorch engine: packs a step's tokens, builds the paged-attention metadata, runs the Llama model."""
from __future__ import annotations

import torch

from ..attention import AttentionMetadata, make_backend
from ..checkpoint import load_model
from ..scheduler import SchedulerOutput
from .base import ModelRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchRunner(ModelRunner):
    """Runs a checkpoint with torch on CPU or CUDA over a preallocated paged KV pool."""

    def __init__(self, checkpoint: str, num_blocks: int, block_size: int, device: str = "cpu",
                 dtype: str = "float32", attention: str = "auto") -> None:
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        self.attention = make_backend(attention, self.device)
        self.model = load_model(checkpoint, self.attention, self.dtype, device)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        input_ids, positions, slots, sample_indices = [], [], [], []
        query_start_loc, context_lens = [0], []
        bs = self.block_size
        for item in output.scheduled:
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            input_ids += req.token_ids(start, end)
            positions += range(start, end)
            table = item.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + item.num_tokens)
            context_lens.append(end)
            if item.sample:
                sample_indices.append(query_start_loc[-1] - 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._block_tables(output),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            decode_only=len(input_ids) == len(context_lens),
            query_start_loc_tensor=self._tensor(query_start_loc, torch.int32),
            context_lens_tensor=self._tensor(context_lens, torch.int32),
        )
        return self.model(self._tensor(input_ids), self._tensor(positions), self.kv_caches, meta,
                          self._tensor(sample_indices))

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, output: SchedulerOutput) -> torch.Tensor:
        width = max(len(item.block_table) for item in output.scheduled)
        rows = [item.block_table + [0] * (width - len(item.block_table)) for item in output.scheduled]
        return self._tensor(rows, torch.int32)
