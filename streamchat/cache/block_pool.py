"""The physical block pool: ref counts, a free queue, and cached blocks by hash.

Owns which block ids are free, used or cached. Knows nothing about sessions,
requests or tensors: its words are allocate, free, touch, lookup, register,
num_free. Torch-free.

Block 0 is the null block: never allocated, used to pad block tables.

Free queue order (allocate pops from the front):

    front -> [never-hashed blocks ...][cached blocks, least recently freed first] <- back

A freed block without a hash goes to the front (nothing to lose by reusing
it); a freed block with a hash goes to the back and stays findable by
`lookup` until `allocate` takes it, which forgets its hash. Callers free a
table tail first, so the tail of a prefix is reused before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    """The pool has no block to give; the caller must make room or wait."""


class CachedBlock(NamedTuple):
    block_hash: int
    token_ids: tuple[int, ...]


class BlockPool:
    """`num_blocks` blocks with ids 1..num_blocks-1 usable (0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._meta: dict[int, CachedBlock] = {}  # block_id -> its hash and tokens
        self._by_hash: dict[int, int] = {}  # block_hash -> block_id
        self.num_cache_evictions = 0
        self._cached_free = 0  # free blocks with a findable hash, kept as blocks move
        self._shared = 0  # blocks with more than one reference

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out, cached ones included."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a findable hash. Counted as blocks move: the engine's figures ask
        after every command while it is idle, and a set intersection over the pool took 0.14 ms at
        20,000 blocks, 0.86 at 100,000."""
        return self._cached_free

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one owner (counted as references come and go; counting the ref
        counts took 0.24 ms at 20,000 blocks, 0.77 at 100,000)."""
        return self._shared

    def allocate(self) -> int:
        """Take a free block (ref count 0 -> 1); a cached one loses its hash."""
        if not self._free:
            raise NoFreeBlocks("KV pool exhausted")
        block_id, _ = self._free.popitem(last=False)
        if self._forget(block_id):
            self.num_cache_evictions += 1
            self._cached_free -= 1
        self.ref_counts[block_id] = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference; a free cached block leaves the free queue."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            del self._free[block_id]
            self._cached_free -= block_id in self._meta
        self.ref_counts[block_id] += 1
        self._shared += self.ref_counts[block_id] == 2

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block joins the free queue."""
        self._check_id(block_id)
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} freed more often than referenced")
        self.ref_counts[block_id] -= 1
        self._shared -= self.ref_counts[block_id] == 1
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None
            if block_id in self._meta:
                self._cached_free += 1
            else:
                self._free.move_to_end(block_id, last=False)

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Make a used full block findable by hash; False if the hash is taken."""
        assert self.ref_counts[block_id] > 0, "only a used block can be registered"
        if block_hash in self._by_hash or block_id in self._meta:
            return False
        self._meta[block_id] = CachedBlock(block_hash, tuple(token_ids))
        self._by_hash[block_hash] = block_id
        return True

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block holding exactly these tokens under this hash, or None.

        The token comparison makes a hash collision a miss, never a wrong hit.
        Does not take a reference: call `touch` to keep the block.
        """
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self._meta[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._meta

    def _forget(self, block_id: int) -> bool:
        meta = self._meta.pop(block_id, None)
        if meta is None:
            return False
        del self._by_hash[meta.block_hash]
        return True

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range 1..{self.num_blocks - 1}")

    def check(self) -> None:
        """Assert conservation, ref counts and a consistent hash map."""
        assert self.ref_counts[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free
        used = [b for b in range(1, self.num_blocks) if self.ref_counts[b] > 0]
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        assert len(used) + len(self._free) == self.num_usable, "free + used != total"
        assert not set(used) & set(self._free), "a block is both free and used"
        assert len(self._by_hash) == len(self._meta)
        assert self._cached_free == len(self._meta.keys() & self._free.keys()), "cached-free count drifted"
        assert self._shared == sum(1 for c in self.ref_counts if c > 1), "shared count drifted"
        for block_hash, block_id in self._by_hash.items():
            assert self._meta[block_id].block_hash == block_hash
