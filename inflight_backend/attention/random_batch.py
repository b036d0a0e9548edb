"""Random packed, paged attention batches for kernel checks (the tests and the GPU check share them)."""
from __future__ import annotations

import random

import torch

from .base import AttentionMetadata
from .torch_ref import TorchPagedAttention

# Stated tolerances (max abs error; outputs are convex combinations of V rows with |V| <~ 4):
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

CASES = [  # (block_size, group, max_context, max_query, num_seqs)
    (1, 1, 64, 1, 5), (16, 4, 2048, 1, 4), (32, 8, 700, 1, 8), (16, 1, 300, 40, 4), (1, 4, 100, 17, 3),
    (32, 8, 2048, 64, 2), (16, 4, 1, 1, 3), (7, 2, 129, 9, 6), (128, 4, 1000, 5, 3), (16, 2, 700, 300, 2),
]

# Sliding windows (tokens) checked on WINDOW_STEP: one token, under a block, a block, past one CUDA partition
# (512 keys), past every context; WINDOW_STEP holds decodes and prompt chunks shorter and longer than them.
WINDOWS = [1, 7, 16, 100, 513, 4096]
WINDOW_STEP = [(c, 1) for c in (5, 700, 33, 1200, 17)] + [(40, 40), (600, 200), (1500, 700), (90, 9)]


def random_batch(rng, *, block_size, num_heads, num_kv_heads, head_size, dtype, num_seqs=None, max_context=None,
                 max_query=None, lengths=None, device="cpu"):
    """A packed batch with block tables in random physical order and random context/query lengths (num_seqs,
    max_context, max_query) or the given ones (`lengths`: (context, queries) per sequence)."""
    if lengths is None:
        assert None not in (num_seqs, max_context, max_query), "random lengths need num_seqs, max_context, max_query"
        ctx = [rng.randint(1, max_context) for _ in range(num_seqs)]
        nq = [rng.randint(1, min(c, max_query)) for c in ctx]
    else:
        ctx, nq = [c for c, _ in lengths], [n for _, n in lengths]
    blocks_needed = [-(-c // block_size) for c in ctx]
    num_blocks = sum(blocks_needed) + 3
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    tables, it = [], iter(physical)
    for n in blocks_needed:
        tables.append([next(it) for _ in range(n)])
    width = max(blocks_needed)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    qsl = [0]
    for n in nq:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], num_heads, head_size, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_start_loc=qsl, context_lens=ctx, decode_only=all(n == 1 for n in nq),
        query_start_loc_tensor=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens_tensor=torch.tensor(ctx, dtype=torch.int32, device=device))
    return q, k_cache, v_cache, meta


def max_error(backend, dtype, device: str, head_size: int, case: tuple, seed: int) -> float:
    """Largest absolute difference between `backend` and the fp32 torch reference on one random CASES batch."""
    block_size, group, max_context, max_query, num_seqs = case
    batch = random_batch(
        random.Random(seed), num_seqs=num_seqs, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
        head_size=head_size, max_context=max_context, max_query=max_query, dtype=dtype, device=device)
    return _error(backend, dtype, batch, head_size ** -0.5)


def window_error(backend, dtype, device: str, head_size: int, window: int, block_size: int, seed: int,
                 lengths=WINDOW_STEP) -> float:
    """max_error's measure on `lengths` ((context, queries) per sequence) with a sliding window of `window`
    tokens (GQA, 4 query heads per KV head)."""
    batch = random_batch(random.Random(seed), block_size=block_size, num_heads=8, num_kv_heads=2,
                         head_size=head_size, dtype=dtype, lengths=lengths, device=device)
    return _error(backend, dtype, batch, head_size ** -0.5, window)


def _error(backend, dtype, batch, scale: float, window: int = 0) -> float:
    q, k_cache, v_cache, meta = batch
    cpu_meta = AttentionMetadata(meta.slot_mapping.cpu(), meta.block_tables.cpu(), meta.query_start_loc,
                                 meta.context_lens, meta.decode_only, meta.query_start_loc_tensor.cpu(),
                                 meta.context_lens_tensor.cpu())
    want = TorchPagedAttention().forward(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), cpu_meta,
                                         scale, window)
    got = backend.forward(q, k_cache, v_cache, meta, scale, window)
    if got.dtype != dtype:
        raise AssertionError(f"output dtype {got.dtype}, expected {dtype}")
    return (got.cpu().float() - want).abs().max().item()
