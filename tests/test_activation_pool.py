"""models/activation_pool.py: a buffer is handed out again only when nothing refers to its storage."""
from __future__ import annotations

import pytest

from inflight_backend.models import activation_pool
from inflight_backend.models.activation_pool import ActivationPool


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(activation_pool, "REUSE_BYTES", 64)  # 16 floats and up come from the pool
    return ActivationPool(max_buffers=2)


def test_small_outputs_are_left_to_malloc():
    assert ActivationPool().take(4, 1024) is None  # 16 KB


def test_a_buffer_nothing_holds_is_handed_out_again(pool):
    first = pool.take(8, 8)
    ptr = first.data_ptr()
    del first
    again = pool.take(4, 8)  # smaller: a view of the same buffer
    assert again.data_ptr() == ptr and again.shape == (4, 8) and again.is_contiguous()


def test_a_buffer_still_held_through_a_view_is_not_reused(pool):
    first = pool.take(8, 8)
    first.fill_(1.0)
    ptr, view = first.data_ptr(), first[2:4]
    del first
    second = pool.take(8, 8)
    second.fill_(2.0)
    assert second.data_ptr() != view.data_ptr() and bool((view == 1.0).all())
    del view
    assert pool.take(8, 8).data_ptr() == ptr  # free again; `second` is still held


def test_the_pool_keeps_at_most_max_buffers_and_replaces_a_free_one_too_small(pool):
    held = [pool.take(8, 8) for _ in range(3)]  # the third is a one-off: the pool is full
    assert len(pool._buffers) == 2
    del held
    big = pool.take(16, 16)  # neither free buffer fits: the larger is replaced
    assert len(pool._buffers) == 2 and any(b.data_ptr() == big.data_ptr() for b in pool._buffers)
