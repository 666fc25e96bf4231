"""Tests for the physical block pool: exact ids, free-queue order, hashes, invariants."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamchat.cache.block_pool import BlockPool, NoFreeBlocks


def test_allocate_hands_out_ids_in_order_and_never_the_null_block():
    """Fresh blocks come out 1, 2, 3, ...; block 0 is the null block."""
    pool = BlockPool(5)
    assert [pool.allocate() for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    pool.check()


def test_unhashed_blocks_are_reused_before_cached_ones():
    """A freed block without a hash goes to the front; a cached one to the back."""
    pool = BlockPool(5)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, 111, (1, 2))
    pool.free(a)
    pool.free(b)
    # free queue: b (unhashed, front), 4 (never used), a (cached, back)
    assert pool.num_free == 3 and pool.num_cached_free == 1
    assert pool.allocate() == b
    assert pool.allocate() == 4
    assert pool.lookup(111, (1, 2)) == a
    assert pool.allocate() == a
    assert pool.lookup(111, (1, 2)) is None, "an evicted cached block is never found again"
    assert pool.num_cache_evictions == 1
    pool.free(c)
    pool.check()


def test_touch_revives_a_cached_free_block():
    """Taking a reference to a free cached block removes it from the free queue."""
    pool = BlockPool(4)
    a = pool.allocate()
    pool.register(a, 7, (9,))
    pool.free(a)
    assert pool.ref_counts[a] == 0 and pool.num_free == 3
    pool.touch(pool.lookup(7, (9,)))
    assert pool.ref_counts[a] == 1 and pool.num_free == 2
    pool.check()


def test_hash_collision_is_a_miss():
    """Same hash, other tokens: the token comparison refuses the block."""
    pool = BlockPool(4)
    a = pool.allocate()
    pool.register(a, 42, (1, 2, 3))
    assert pool.lookup(42, (1, 2, 4)) is None
    assert pool.lookup(42, (1, 2, 3)) == a


def test_misuse_raises():
    """Freeing an unreferenced block or an out-of-range id is an error."""
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.free(1)
    with pytest.raises(ValueError):
        pool.touch(0)
    with pytest.raises(ValueError):
        BlockPool(1)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/touch/free/register/lookup sequences keep the pool's invariants."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(9)
        self.refs: dict[int, int] = {}
        self.hashes: dict[int, tuple[int, tuple]] = {}

    @precondition(lambda self: self.pool.num_free > 0)
    @rule()
    def allocate(self):
        b = self.pool.allocate()
        assert self.refs.get(b, 0) == 0
        self.refs[b] = 1
        self.hashes.pop(b, None)

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(sorted(k for k, v in self.refs.items() if v)))
        self.pool.free(b)
        self.refs[b] -= 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def touch(self, data):
        b = data.draw(st.sampled_from(sorted(k for k, v in self.refs.items() if v)))
        self.pool.touch(b)
        self.refs[b] += 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data(), h=st.integers(0, 5))
    def register(self, data, h):
        b = data.draw(st.sampled_from(sorted(k for k, v in self.refs.items() if v)))
        ok = self.pool.register(b, h, (h,))
        if ok:
            self.hashes[b] = (h, (h,))

    @rule(h=st.integers(0, 5))
    def lookup(self, h):
        found = self.pool.lookup(h, (h,))
        expected = [b for b, (hh, _) in self.hashes.items() if hh == h]
        assert found == (expected[0] if expected else None)
        if found is not None:
            self.pool.touch(found)
            self.refs[found] = self.refs.get(found, 0) + 1

    @invariant()
    def consistent(self):
        self.pool.check()
        for b in range(1, 9):
            assert self.pool.ref_counts[b] == self.refs.get(b, 0)
        # the figures' counts against their definitions, block by block
        free = [b for b in range(1, 9) if self.refs.get(b, 0) == 0]
        assert self.pool.num_cached_free == sum(1 for b in free if self.pool.is_cached(b))
        assert self.pool.num_shared == sum(1 for b in range(1, 9) if self.refs.get(b, 0) > 1)


TestPoolMachine = PoolMachine.TestCase
