"""CUDA graphs of decode steps (`cuda_graphs: true`): on a GPU a decode step of a large batch is mostly kernel
launches from Python (an 8B model's step launches about 800 kernels), which one graph replay replaces.

A graph is captured, on first use, per (batch bucket, context bucket): batches are padded up to a power of two
(the largest: max_batch_size), and the paged-attention kernel's split over the context is fixed at capture, so the
longest context of a step is rounded up to a power-of-two number of the kernel's 512-key partitions (partitions
past a sequence's keys do nothing). Steps the graphs do not cover run eagerly: prefill or mixed steps, contexts
past MAX_CONTEXT, and steps whose logits rows are not one per sequence.

Every graph reads its inputs from static buffers that each step fills before the replay; padded rows attend to
one key and write no KV (slot -1). The graph's logits are its own static output: the caller uses them before the
next step (the engine samples at once, and clones the rows it keeps)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention import AttentionMetadata, NativePagedAttention
from .step_inputs import StepInputs

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

MAX_CONTEXT = 8192  # longest context a graph covers (16 partitions of the kernel's 512 keys)
PARTITION = 512  # keys per partition of the CUDA attention kernel (kPartition in paged_attention.cu)


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below max_batch_size, then max_batch_size."""
    return [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size] + [max_batch_size]


def context_bucket(longest: int, limit: int) -> int:
    """The context a step's graph is captured for: its longest context rounded up to a power-of-two number of
    the kernel's partitions, at most `limit` (which covers at least `longest`)."""
    parts = -(-longest // PARTITION)
    return min(PARTITION << (parts - 1).bit_length(), limit)


class DecodeGraphs:
    """Captures and replays the model's decode steps. `attention` must be the native backend: the torch
    reference reads sequence lengths on the host, which a graph would freeze. (The buffers and the padding work
    on any device; only `_capture` needs CUDA, and the CPU tests replace it.)"""

    def __init__(self, model, kv_caches: list, attention, max_batch_size: int, block_size: int,
                 max_context: int, device: torch.device) -> None:
        if not isinstance(attention, NativePagedAttention):
            raise RuntimeError("cuda_graphs: true needs the native CUDA attention kernels "
                               "(build/lib/libinflight_pa_cuda.so, attention_backend auto or native)")
        self.model, self.kv_caches, self.attention = model, kv_caches, attention
        self.max_context = min(max_context, MAX_CONTEXT)
        self.buckets = batch_buckets(max_batch_size)
        rows, width = max_batch_size, -(-self.max_context // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.sample_indices = torch.arange(rows, dtype=torch.int64, device=device)
        self.pool: _POOL_HANDLE | None = None  # the graphs' shared memory pool, made at the first capture
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}

    def covers(self, step: StepInputs) -> bool:
        num_seqs = len(step.context_lens)
        return (step.decode_only and num_seqs <= self.buckets[-1] and len(step.sample_indices) == num_seqs
                and max(step.context_lens) <= self.max_context
                and len(step.block_tables[0]) <= self.block_tables.shape[1])

    def run(self, step: StepInputs) -> torch.Tensor:
        """The step's logits (num_seqs, vocab), a view of the graph's output. Only for steps `covers` accepts."""
        n = len(step.context_lens)
        batch = next(b for b in self.buckets if b >= n)
        context = context_bucket(max(step.context_lens), self.max_context)
        self._fill(step, n, batch)
        key = (batch, context)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, context)
        graph, logits, _ = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _fill(self, step: StepInputs, n: int, batch: int) -> None:
        self.input_ids[:n].copy_(torch.tensor(step.input_ids, dtype=torch.int64))
        self.positions[:n].copy_(torch.tensor(step.positions, dtype=torch.int64))
        self.slot_mapping[:n].copy_(torch.tensor(step.slot_mapping, dtype=torch.int64))
        self.context_lens[:n].copy_(torch.tensor(step.context_lens, dtype=torch.int32))
        tables = torch.tensor(step.block_tables, dtype=torch.int32)
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        if batch > n:  # padding rows: one key each (whatever block their stale table row names), no KV written
            self.slot_mapping[n:batch].fill_(-1)
            self.context_lens[n:batch].fill_(1)

    def graph_args(self, batch: int, context: int) -> tuple:
        """The model's arguments for a graph of `batch` rows and `context` keys: views of the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch],
            query_start_loc=list(range(batch + 1)), context_lens=[context] * batch, decode_only=True,
            query_start_loc_tensor=self.query_start_loc[:batch + 1], context_lens_tensor=self.context_lens[:batch])
        return self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta, self.sample_indices[:batch]

    def _capture(self, batch: int, context: int):
        args = self.graph_args(batch, context)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # One eager run first, on a side stream (as torch's graph docs do): it sizes the attention workspace
        # outside the capture and initialises cuBLAS. Its KV writes are this step's own, which the replay repeats.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(*args)
        torch.cuda.current_stream().wait_stream(side)
        if self.attention.uses_fallback:
            raise RuntimeError("cuda_graphs: true: the CUDA attention kernels do not support this model "
                               "(head sizes 64 and 128; fp32, bf16, fp16)")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(*args)
        # the workspace the graph writes stays alive with it, should the backend later grow a new one
        return graph, logits, self.attention.workspace
