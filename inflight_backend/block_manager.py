"""The paged KV cache's bookkeeping: which physical blocks each sequence holds, and which are free.

The manager never touches tensors; the runner turns block tables into slot mappings. Allocation is all or
nothing: a failed `allocate` leaves every table as it was. A block may be in several tables (`share`: sequences
of one prompt share its full blocks, which nobody writes again); it returns to the pool when the last table
holding it lets it go.
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
        self._refs: dict[int, int] = {}  # blocks in more than one table: how many hold each

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

    def share(self, source_id: str, req_id: str, num_blocks: int) -> None:
        """Start `req_id`'s (empty) table with the first `num_blocks` blocks of `source_id`'s, shared, not copied:
        their K/V must be final (full blocks of a computed prefix)."""
        if self._tables.get(req_id):
            raise ValueError(f"{req_id!r} already holds blocks")
        shared = self._tables[source_id][:num_blocks]
        if len(shared) != num_blocks:
            raise ValueError(f"{source_id!r} holds {len(shared)} blocks, not {num_blocks}")
        for block in shared:
            self._refs[block] = self._refs.get(block, 1) + 1
        self._tables[req_id] = list(shared)

    def free(self, req_id: str) -> None:
        """Let go of every block of `req_id`; those no other table holds return to the pool (no-op for an
        unknown id)."""
        for block in self._tables.pop(req_id, ()):
            refs = self._refs.get(block)
            if refs is None:
                self._free.append(block)
            elif refs == 2:
                del self._refs[block]
            else:
                self._refs[block] = refs - 1

    def check_integrity(self) -> None:
        """Raise if a block is lost, or held by more tables than its count says (free + used == total)."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                held[block] = held.get(block, 0) + 1
        every = list(held) + list(self._free)
        counts_ok = all(n == self._refs.get(b, 1) for b, n in held.items()) and set(self._refs) <= set(held)
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)) or not counts_ok:
            raise AssertionError(
                f"KV block accounting broken: {len(held)} held + {len(self._free)} free != {self.num_blocks} "
                "total, or a block is held by more tables than its reference count")
