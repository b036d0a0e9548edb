"""The attention-backend interface and the per-step metadata the runner builds for it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each sequence's packed query tokens are and where its K/V live.

    Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]` of the packed tokens; its context
    (cached plus new tokens) has `context_lens[i]` tokens, the new ones last, reachable through
    `block_tables[i]` (padded with 0 past its own blocks). New token t's K/V go to flat slot `slot_mapping[t]`.
    """

    slot_mapping: torch.Tensor  # (T,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int32
    query_start_loc: list[int]  # (B + 1,)
    context_lens: list[int]  # (B,)
    decode_only: bool  # every sequence has exactly one query token
    query_start_loc_tensor: torch.Tensor  # the same, as int32 tensors on the model's device, for kernels
    context_lens_tensor: torch.Tensor

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)


class AttentionBackend:
    """Writes new K/V into the paged cache and attends through block tables.

    Cache layout per layer: (num_blocks, block_size, num_kv_heads, head_dim).
    """

    name = "base"

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """k, v: (T, num_kv_heads, head_dim) for the packed new tokens."""
        num_kv_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k
        v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int = 0) -> torch.Tensor:
        """q: (T, num_heads, head_dim) -> (T, num_heads, head_dim); causal within each sequence. With `window`
        W > 0, the query at position t sees only keys t - W + 1 .. t (sliding-window attention)."""
        raise NotImplementedError
