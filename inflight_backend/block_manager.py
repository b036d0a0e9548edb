"""The paged KV cache's bookkeeping: which physical blocks each sequence holds, which hold reusable content, and
which are free.

The manager never touches tensors; the runner turns block tables into slot mappings. Allocation is all or
nothing: a failed `allocate` leaves every table as it was. A block may be in several tables (sequences that share
a prefix's full blocks, which nobody writes again); it is let go when the last table holding it is.

Prefix caching (`enable_reuse`): once a full block's K/V are computed, `commit` files it under its content: its
tokens and the content of every block before it (chained through an id per cached content, never a hash, so two
prefixes can never be confused). A block nobody holds keeps its content, as "cached" (free to take, still findable
by `lookup`) until the pool needs it: then the least recently released is evicted (a sequence's blocks are released
last block first, so a prefix's tail goes before its head). free + cached + held == total, always.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


_ROOT = 0  # the content id before a sequence's first block


@dataclass(slots=True)
class CacheCounters:
    """Since start: what lookups found and what eviction cost."""

    num_reused_blocks: int = 0  # blocks taken from the cache instead of being computed
    num_evictions: int = 0  # cached blocks whose content was dropped to make room


class BlockManager:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens each, shared by all sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.counters = CacheCounters()
        self._free: deque[int] = deque(range(num_blocks))  # no content
        self._cached: OrderedDict[int, None] = OrderedDict()  # content kept, nobody holds them: LRU order
        self._tables: dict[str, list[int]] = {}
        self._refs: dict[int, int] = {}  # held blocks: how many tables hold each
        self._content: dict[tuple[int, tuple[int, ...]], int] = {}  # (previous content id, tokens) -> block
        self._key: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}  # block -> (its content key, its id)
        self._committed: dict[str, tuple[int, int]] = {}  # req_id -> (blocks filed, content id of the last)
        self._next_id = _ROOT + 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: empty ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks nobody holds whose content a later request may still reuse."""
        return len(self._cached)

    def block_table(self, req_id: str) -> list[int]:
        """A copy of `req_id`'s block table ([] when it holds none); only allocate() hands out the live list."""
        return list(self._tables.get(req_id, ()))

    def num_missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks still to take so that `req_id` can hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self._tables.get(req_id, ())))

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow `req_id`'s table to hold `num_tokens` tokens and return it (the live list: callers only read it).
        None (and no change) if the pool is short."""
        table = self._tables.get(req_id)
        if table is not None and num_tokens <= len(table) * self.block_size:
            return table  # most decode steps: the last block has room
        missing = self.num_missing_blocks(req_id, num_tokens)
        if missing > self.num_free_blocks:
            return None
        if not missing:  # (only when it holds no table and asks for no tokens: a table with room returned above)
            return []
        table = self._tables.setdefault(req_id, [])
        for _ in range(missing):
            block = self._free.popleft() if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return table

    def lookup(self, token_ids: list[int], max_blocks: int) -> list[int]:
        """The blocks holding the longest cached prefix of `token_ids`, in whole blocks, at most `max_blocks`."""
        if not self.enable_reuse:
            return []
        found, content_id, size = [], _ROOT, self.block_size
        for i in range(min(max_blocks, len(token_ids) // size)):
            block = self._content.get((content_id, tuple(token_ids[i * size:(i + 1) * size])))
            if block is None:
                break
            found.append(block)
            content_id = self._key[block][1]
        return found

    def num_held_elsewhere(self, blocks: list[int]) -> int:
        """How many of `blocks` are held by some table (taking them costs no free block)."""
        return sum(1 for b in blocks if b in self._refs)

    def take(self, req_id: str, blocks: list[int]) -> None:
        """Start `req_id`'s (empty) table with `blocks` (a computed prefix found by `lookup`, or another
        sequence's full prompt blocks), shared, not copied."""
        if self._tables.get(req_id):
            raise ValueError(f"{req_id!r} already holds blocks")
        for block in blocks:
            if block in self._cached:
                del self._cached[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
        self._tables[req_id] = list(blocks)
        self.counters.num_reused_blocks += len(blocks)
        if blocks and self.enable_reuse and blocks[-1] in self._key:
            self._committed[req_id] = (len(blocks), self._key[blocks[-1]][1])

    def share(self, source_id: str, req_id: str, num_blocks: int) -> None:
        """`take` the first `num_blocks` blocks of `source_id`'s table (their K/V must be final)."""
        shared = self._tables[source_id][:num_blocks]
        if len(shared) != num_blocks:
            raise ValueError(f"{source_id!r} holds {len(shared)} blocks, not {num_blocks}")
        self.take(req_id, shared)

    def commit(self, req_id: str, token_ids, num_computed: int) -> None:
        """File the full blocks of `req_id` computed so far (`token_ids(start, end)` gives its tokens) under their
        content. Content already filed under another block keeps that block; this one stays private."""
        if not self.enable_reuse:
            return
        done, content_id = self._committed.get(req_id, (0, _ROOT))
        full = min(num_computed // self.block_size, len(self._tables.get(req_id, ())))
        if full <= done:
            return
        table, size = self._tables[req_id], self.block_size
        for i in range(done, full):
            key = (content_id, tuple(token_ids(i * size, (i + 1) * size)))
            block = self._content.get(key)
            if block is None:
                block = table[i]
                if block in self._key:  # already filed (shared from another sequence): same content
                    content_id = self._key[block][1]
                    continue
                self._content[key] = block
                self._key[block] = (key, self._next_id)
                self._next_id += 1
            content_id = self._key[block][1]
        self._committed[req_id] = (full, content_id)

    def free(self, req_id: str) -> None:
        """Let go of every block of `req_id` (no-op for an unknown id): one nobody else holds becomes cached if
        its content is filed, else free. The last block goes first, so eviction takes tails before heads."""
        self._committed.pop(req_id, None)
        for block in reversed(self._tables.pop(req_id, ())):
            refs = self._refs[block]
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            if block in self._key:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        key, _ = self._key.pop(block)
        del self._content[key]
        self.counters.num_evictions += 1
        return block

    def check_integrity(self) -> None:
        """Raise if a block is lost or in two states, a count disagrees with the tables, or the content index and
        the blocks disagree."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                held[block] = held.get(block, 0) + 1
        every = list(held) + list(self._free) + list(self._cached)
        problems = []
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)):
            problems.append(f"{len(held)} held + {len(self._free)} free + {len(self._cached)} cached != "
                            f"{self.num_blocks}, or a block is in two states")
        if held != self._refs:
            problems.append("reference counts disagree with the tables")
        if any(self._content.get(key) != block for block, (key, _) in self._key.items()) or \
                len(self._content) != len(self._key) or any(b not in self._key for b in self._cached):
            problems.append("the content index disagrees with the blocks")
        if problems:
            raise AssertionError("KV block accounting broken: " + "; ".join(problems))
