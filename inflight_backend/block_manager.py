"""The paged KV cache's bookkeeping: which physical blocks each sequence owns, and which are free.

The manager never touches tensors; the runner turns block tables into slot mappings. Allocation is all or
nothing: a failed `allocate` leaves every table as it was.
"""
from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens each, shared by all sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def block_table(self, req_id: str) -> list[int]:
        return self._tables.get(req_id, [])

    def num_missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks still to take so that `req_id` can hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.block_table(req_id)))

    def allocate(self, req_id: str, num_tokens: int) -> bool:
        """Grow `req_id`'s table to hold `num_tokens` tokens. False (and no change) if the pool is short."""
        missing = self.num_missing_blocks(req_id, num_tokens)
        if missing > len(self._free):
            return False
        if missing:
            table = self._tables.setdefault(req_id, [])
            table.extend(self._free.popleft() for _ in range(missing))
        return True

    def free(self, req_id: str) -> None:
        """Return every block of `req_id` to the pool (no-op for an unknown id)."""
        self._free.extend(self._tables.pop(req_id, ()))

    def check_integrity(self) -> None:
        """Raise if a block is lost or owned twice (free + used == total, all distinct)."""
        owned = [b for table in self._tables.values() for b in table]
        every = owned + list(self._free)
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)):
            raise AssertionError(
                f"KV block accounting broken: {len(owned)} owned + {len(self._free)} free "
                f"!= {self.num_blocks} total, or a block is owned twice")
