"""Reference paged attention in plain torch: gathers each sequence's blocks, then softmax(QK^T)V in fp32."""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        if meta.decode_only:
            return _decode(q, k_cache, v_cache, meta, scale, window)
        out = torch.empty_like(q)
        starts = meta.query_start_loc
        for i, context_len in enumerate(meta.context_lens):
            rows = slice(starts[i], starts[i + 1])
            k, v = _gather(k_cache, v_cache, meta.block_tables[i], context_len)
            out[rows] = _attend(q[rows], k, v, context_len, scale, window)
        return out


def _gather(k_cache, v_cache, block_table, context_len):
    num_blocks = -(-context_len // k_cache.shape[1])
    blocks = block_table[:num_blocks]
    k = k_cache[blocks].flatten(0, 1)[:context_len]  # (S, Hkv, D)
    v = v_cache[blocks].flatten(0, 1)[:context_len]
    return k, v


def _attend(q, k, v, context_len, scale, window=0):
    """q: (Tq, H, D), k/v: (S, Hkv, D); query j sits at position S - Tq + j and sees keys up to it (the last
    `window` of them when window > 0)."""
    num_q, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    qh = q.transpose(0, 1).float()  # (H, Tq, D)
    kh = k.transpose(0, 1).float().repeat_interleave(group, 0)  # (H, S, D)
    vh = v.transpose(0, 1).float().repeat_interleave(group, 0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # (H, Tq, S)
    if num_q > 1 or window:
        q_pos = torch.arange(context_len - num_q, context_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
        mask = k_pos > q_pos  # (Tq, S)
        if window:
            mask |= k_pos <= q_pos - window
        scores.masked_fill_(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)  # (H, Tq, D)
    return out.transpose(0, 1).to(q.dtype)


def _decode(q, k_cache, v_cache, meta, scale, window=0):
    """All sequences decode one token: gather padded contexts and attend in one batched matmul."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = max(meta.context_lens)
    tables = meta.block_tables[:, : -(-max_len // block_size)]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].float()  # (B, S, Hkv, D)
    v = v_cache[tables].flatten(1, 2)[:, :max_len].float()
    group = num_heads // num_kv_heads
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k) * scale  # (B, Hkv, G, S)
    lens = torch.tensor(meta.context_lens, device=q.device).view(num_seqs, 1, 1, 1)
    k_pos = torch.arange(max_len, device=q.device).view(1, 1, 1, -1)
    mask = k_pos >= lens
    if window:
        mask |= k_pos < lens - window
    scores.masked_fill_(mask, float("-inf"))
    out = torch.einsum("bhgs,bshd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
