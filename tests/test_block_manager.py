import pytest

from inflight_backend.block_manager import BlockManager, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_tables_and_free_returns_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 5)  # 2 blocks
    assert bm.allocate("b", 4)  # 1 block
    assert bm.allocate("a", 8)  # still 2 blocks
    assert len(bm.block_table("a")) == 2 and len(bm.block_table("b")) == 1
    assert bm.allocate("a", 9)  # grows to 3
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 2
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 5 and bm.block_table("a") == []
    bm.check_integrity()


def test_block_table_is_a_copy_the_caller_cannot_corrupt():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    table = bm.block_table("a")
    table.append(table[0])  # a caller's edit stays in its own list
    assert len(bm.block_table("a")) == 2 and bm.allocate("a", 0) == bm.block_table("a")
    assert bm.allocate("b", 0) == [] and bm.block_table("b") == []
    bm.check_integrity()


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate("a", 2)
    table = bm.block_table("a")
    assert not bm.allocate("a", 9)  # needs 5 blocks
    assert bm.block_table("a") == table and bm.num_free_blocks == 2
    assert not bm.allocate("b", 7)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 2
    bm.check_integrity()


def test_integrity_check_catches_a_double_owned_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm._tables["b"] = bm.block_table("a")  # corrupt on purpose
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_shared_blocks_return_to_the_pool_when_the_last_holder_lets_go():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 10)  # 3 blocks
    bm.share("a", "b", 2)
    bm.share("a", "c", 2)
    assert bm.block_table("b") == bm.block_table("a")[:2] and bm.num_used_blocks == 3
    assert bm.allocate("b", 12)  # one block of its own past the shared two
    assert bm.num_used_blocks == 4 and bm.block_table("b")[2] not in bm.block_table("a")
    bm.check_integrity()
    bm.free("a")
    assert bm.num_used_blocks == 3  # a's third block is free; the shared two stay for b and c
    bm.check_integrity()
    bm.free("b")
    bm.check_integrity()
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check_integrity()
    assert bm.allocate("zz", 2)
    with pytest.raises(ValueError, match="holds 1 blocks, not 2"):
        bm.share("zz", "d", 2)
    bm.share("zz", "d", 1)
    with pytest.raises(ValueError, match="already holds"):
        bm.share("zz", "d", 1)


def test_integrity_check_catches_a_wrong_reference_count():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)
    bm.share("a", "b", 1)
    bm._refs[bm.block_table("a")[0]] = 3  # corrupt on purpose
    with pytest.raises(AssertionError):
        bm.check_integrity()
