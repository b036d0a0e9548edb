"""Large activation buffers handed out again once nothing holds them: a prefill step's biggest GEMM outputs.

A 2,048-token prefill step on a 1024-wide model writes a 45 MB gate/up output in every layer. glibc serves a block
that large with a fresh mapping and unmaps it on free (its mmap threshold is 32 MB at most; a thread's arena also
unmaps a whole heap when it empties), so each layer faulted its output in again and the kernel zeroed every page:
about 0.25 s of a 4.5 s prefill step (docs/PERFORMANCE.md, issue 16's section). A model's PackedLinear layers
share one pool; a buffer is reused only when no tensor (the one handed out, or any view of it) still refers to its
storage, so a caller may keep what it got as long as it likes.
"""
from __future__ import annotations

import torch

REUSE_BYTES = 16 << 20  # smaller blocks: glibc's heap reuses them itself (its mmap threshold adapts up to 32 MB)


def _unheld(buffer: torch.Tensor) -> bool:
    # References to the storage: `buffer` itself and the storage object made here; any other is a caller's tensor.
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2


class ActivationPool:
    """At most `max_buffers` fp32 buffers; take() returns a tensor of the asked shape backed by a free one."""

    def __init__(self, max_buffers: int = 4) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[torch.Tensor] = []

    def take(self, rows: int, cols: int) -> torch.Tensor | None:
        """An uninitialised (rows, cols) fp32 tensor from the pool; None when it is small enough for malloc."""
        numel = rows * cols
        if numel * 4 < REUSE_BYTES:
            return None
        free = [i for i, b in enumerate(self._buffers) if _unheld(b)]
        fits = [i for i in free if self._buffers[i].numel() >= numel]
        if fits:
            buffer = self._buffers[min(fits, key=lambda i: self._buffers[i].numel())]
        else:
            buffer = torch.empty(numel, dtype=torch.float32)
            if free:  # replace the largest free buffer, too small for this step: the pool does not grow
                self._buffers[max(free, key=lambda i: self._buffers[i].numel())] = buffer
            elif len(self._buffers) < self.max_buffers:
                self._buffers.append(buffer)
        return buffer[:numel].view(rows, cols)
