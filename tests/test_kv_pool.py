"""runners/kv_pool.py: the KV pool's CPU tensors are ordinary zeroed tensors that own their memory, and, where
Linux has transparent huge pages for advised memory, sit in 2 MiB pages."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from inflight_backend.runners import kv_pool

SHAPE = (512, 16, 4, 64)  # 4 MiB in bf16: blocks x block size x KV heads x head size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cache_is_a_zeroed_writable_tensor_of_its_shape(dtype):
    cache = kv_pool.zeros(SHAPE, dtype, torch.device("cpu"))
    assert cache.shape == SHAPE and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    cache[3, 5, 1] = 2.5
    assert cache[3, 5, 1].float().eq(2.5).all() and cache.float().sum().item() == 2.5 * 64


def test_a_cache_starts_on_a_huge_page_boundary_and_keeps_its_memory():
    cache = kv_pool.zeros(SHAPE, torch.bfloat16, torch.device("cpu"))
    assert cache.data_ptr() % kv_pool.HUGE_PAGE == 0
    view = cache[10:20]
    del cache
    gc.collect()
    torch.empty(64 << 20, dtype=torch.uint8).fill_(7)  # memory freed by a lost mapping would be handed out again
    view.fill_(1)
    assert view.float().sum().item() == view.numel()


def test_small_tensors_are_plain_zeros():
    small = kv_pool.zeros((4, 16, 2, 8), torch.float32, torch.device("cpu"))
    assert small.shape == (4, 16, 2, 8) and not small.any()


def _huge_pages_for_advised_memory() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and re.search(r"\[(always|madvise)\]", path.read_text()) is not None


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not _huge_pages_for_advised_memory(),
                    reason="this kernel has no transparent huge pages for madvised memory")
def test_a_cache_sits_in_huge_pages_where_the_kernel_has_them():
    cache = kv_pool.zeros((1024, 16, 4, 64), torch.bfloat16, torch.device("cpu"))  # 8 MiB
    # a fragmented machine may give small pages for some of it; most of a fresh 8 MiB comes whole
    assert _anon_huge_kb(cache.data_ptr()) >= 4096
