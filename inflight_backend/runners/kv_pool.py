"""The paged KV pool's tensors, on the CPU in 2 MiB pages where Linux gives them.

A decode reads its sequences' K and V rows block by block from scattered places in the pool: with 4 KiB pages
a long context's blocks are TLB misses (a 32-sequence x 2,048-key batch reads 67 MB a layer), and the loads
that should run ahead of the arithmetic wait on page walks. Each CPU cache tensor is a private anonymous mapping
of its own (fresh pages: memory from the allocator's heap may already be backed by small ones), advised with
`MADV_HUGEPAGE` before its first touch and then zeroed, so the kernel backs it with 2 MiB pages where
transparent huge pages are enabled (`always` or `madvise`) and the whole pool is resident from the start, as
with torch.zeros. Where they are not, the advice fails or does nothing and the pool keeps small pages: a speed
hint, no change in what is computed. Measured in docs/PERFORMANCE.md ("Decode paged attention").
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU, at least a huge page of it, in a mapping of its own advised as huge pages."""
    size = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or size < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor holds the mapping (frombuffer keeps a reference) and starts at its first 2 MiB boundary
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, offset, size // HUGE_PAGE * HUGE_PAGE)
        except OSError:  # transparent huge pages unavailable: small pages, the same tensor
            pass
    return torch.frombuffer(region, dtype=dtype, count=math.prod(shape), offset=offset).view(shape).zero_()
