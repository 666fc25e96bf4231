"""Tests for block tables: sink + window eviction, prefix sharing, exact block accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamchat.cache.block_pool import BlockPool, NoFreeBlocks
from streamchat.cache.manager import KVCacheManager


def make(num_blocks=64, sink=4, window=64, bs=16, **kw):
    pool = BlockPool(num_blocks)
    return pool, KVCacheManager(pool, bs, sink, window, b"test", **kw)


def test_append_places_tokens_in_exact_slots():
    """Slots are block_id * block_size + offset, positions count from 0."""
    pool, mgr = make()
    seq = mgr.new_seq()
    placed = mgr.append(seq, list(range(20)))
    assert seq.block_ids == [1, 2]
    assert placed.positions == list(range(20))
    assert placed.slots == [16 + i for i in range(16)] + [32, 33, 34, 35]
    placed = mgr.append(seq, [7])
    assert placed.slots == [36] and placed.positions == [20]
    mgr.check([seq])


def test_window_evicts_oldest_block_after_sinks_and_returns_it():
    """Past the window, the oldest non-sink block leaves; positions stay contiguous."""
    pool, mgr = make(sink=4, window=32)  # 1 sink block + 2 window blocks
    seq = mgr.new_seq()
    mgr.append(seq, list(range(48)))  # blocks 1 (sink), 2, 3
    assert seq.block_ids == [1, 2, 3] and seq.evicted_tokens == 0
    placed = mgr.append(seq, [100])
    assert seq.block_ids == [1, 3, 2], "block 2 freed then reused for the new tail"
    assert placed.positions == [32], "cache position, not conversation position"
    assert seq.token_ids[:16] == list(range(16)) and seq.token_ids[16:32] == list(range(32, 48))
    assert seq.evicted_tokens == 16 and not seq.pristine
    mgr.check([seq])


def test_memory_is_bounded_far_past_the_window():
    """100,000 tokens fed one block at a time hold exactly sink + window blocks."""
    pool, mgr = make(num_blocks=64, sink=4, window=256)
    seq = mgr.new_seq()
    bound = 1 + 256 // 16 + 1
    for i in range(0, 100_000, 16):
        mgr.append(seq, [i % 50_000] * 16)
        assert len(seq.block_ids) <= bound
    assert len(seq.block_ids) == 1 + 16
    assert seq.num_tokens == 16 + 256
    assert seq.evicted_tokens == 100_000 - 272
    assert pool.num_free == pool.num_usable - 17, "every evicted block went back to the pool"
    mgr.check([seq])


def test_pinned_system_prompt_joins_the_sinks():
    """A 40-token system prompt pins ceil(40/16) = 3 blocks that never leave."""
    pool, mgr = make(sink=4, window=32)
    seq = mgr.new_seq(pinned_tokens=40)
    assert seq.num_sink_blocks == 3
    mgr.append(seq, list(range(48)))
    for i in range(10):
        mgr.append(seq, [1000 + i] * 16)
    assert seq.token_ids[:48] == list(range(48))
    assert len(seq.block_ids) == 3 + 2
    mgr.check([seq])


def test_block_aligned_chunks_match_token_by_token():
    """Feeding one block per append gives the same table contents as one token at a time."""
    _, m1 = make(sink=4, window=48)
    _, m2 = make(sink=4, window=48)
    s1, s2 = m1.new_seq(), m2.new_seq()
    tokens = list(range(300))
    pos1 = [p for t in tokens for p in m1.append(s1, [t]).positions]
    pos2 = [p for i in range(0, 300, 16) for p in m2.append(s2, tokens[i:i + 16]).positions]
    assert pos1 == pos2
    assert s1.token_ids == s2.token_ids and s1.evicted_tokens == s2.evicted_tokens


def test_prefix_blocks_are_shared_once_across_sessions():
    """N sessions with one 50-token prompt hold its 3 full blocks once, ref count N."""
    pool, mgr = make(num_blocks=128)
    prompt = list(range(1000, 1050))
    seqs = []
    for i in range(5):
        seq = mgr.new_seq(pinned_tokens=50)
        taken = mgr.match_prefix(seq, prompt)
        assert taken == (0 if i == 0 else 48)
        mgr.append(seq, prompt[taken:])
        mgr.commit(seq)
        seqs.append(seq)
    shared = seqs[0].block_ids[:3]
    assert all(s.block_ids[:3] == shared for s in seqs)
    assert [pool.ref_counts[b] for b in shared] == [5, 5, 5]
    assert len({s.block_ids[3] for s in seqs}) == 5, "the partial last block is each session's own"
    assert pool.num_used == 3 + 5
    assert mgr.num_prefix_hit_tokens == 4 * 48
    mgr.check(seqs)


def test_eviction_never_touches_a_shared_block_of_another_session():
    """A session evicting shared blocks only drops its own references."""
    pool, mgr = make(num_blocks=64, sink=4, window=48)
    a, b = mgr.new_seq(), mgr.new_seq()
    prefix = list(range(64))
    mgr.append(a, prefix)
    mgr.commit(a)
    assert mgr.match_prefix(b, prefix) == 64
    for i in range(6):
        mgr.append(b, [500 + i] * 16)
    assert a.block_ids == [1, 2, 3, 4] and [pool.ref_counts[x] for x in a.block_ids] == [2, 1, 1, 1]
    assert a.token_ids == prefix
    mgr.check([a, b])


def test_freed_prefix_stays_cached_until_the_pool_needs_room():
    """A freed session's hashed blocks are found again; once reallocated they are gone."""
    pool, mgr = make(num_blocks=6)
    a = mgr.new_seq()
    mgr.append(a, list(range(32)))
    mgr.commit(a)
    mgr.free(a)
    b = mgr.new_seq()
    assert mgr.match_prefix(b, list(range(32))) == 32
    mgr.free(b)
    c = mgr.new_seq()
    mgr.append(c, list(range(500, 580)))  # takes every block, cached ones last
    d = mgr.new_seq()
    assert mgr.match_prefix(d, list(range(32))) == 0
    mgr.check([c, d])


def test_blocks_after_an_eviction_are_never_offered_for_reuse():
    """Once a session evicted, its new full blocks are not registered."""
    pool, mgr = make(sink=4, window=32)
    a = mgr.new_seq()
    mgr.append(a, list(range(48)))
    mgr.commit(a)
    for i in range(48, 80, 16):
        mgr.append(a, list(range(i, i + 16)))
        mgr.commit(a)
    assert a.evicted_tokens == 32 and a.token_ids == list(range(16)) + list(range(48, 80))
    assert [pool.is_cached(x) for x in a.block_ids] == [True, False, False]
    b = mgr.new_seq()
    # the pre-eviction blocks (tokens 0..47) are still valid cached KV; 48..79 were never offered
    assert mgr.match_prefix(b, list(range(80))) == 48
    mgr.check([a, b])


def test_full_pool_raises_and_changes_nothing():
    """An append that cannot fit raises NoFreeBlocks with the table untouched."""
    pool, mgr = make(num_blocks=3, window=64)
    seq = mgr.new_seq()
    mgr.append(seq, list(range(20)))
    with pytest.raises(NoFreeBlocks):
        mgr.append(seq, list(range(20)))
    assert seq.num_tokens == 20 and seq.block_ids == [1, 2]
    mgr.check([seq])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=40))
def test_random_appends_and_frees_keep_tables_and_pool_consistent(ops):
    """Random appends, prefix matches and frees over 4 sequences never break check()."""
    pool, mgr = make(num_blocks=40, sink=4, window=48)
    seqs = [mgr.new_seq() for _ in range(4)]
    for which, n in ops:
        seq = seqs[which]
        if n > 35:
            mgr.free(seq)
            continue
        n = min(n, mgr.max_chunk)  # callers split longer appends (the scheduler does)
        if mgr.can_append(seq, n):
            if seq.num_tokens == 0:
                taken = mgr.match_prefix(seq, list(range(n)))
                mgr.append(seq, list(range(taken, n))) if n > taken else None
            else:
                mgr.append(seq, [which] * n)
            mgr.commit(seq)
        bound = 1 + 3 + 1
        assert len(seq.block_ids) <= bound
        mgr.check(seqs)


def test_an_append_may_use_the_blocks_its_own_eviction_frees():
    """With a pool of exactly sink + window + 1 blocks, a multi-block append past the window fits."""
    pool, mgr = make(num_blocks=1 + 1 + 4 + 1, sink=4, window=64)  # null + sink + window + one
    seq = mgr.new_seq()
    for i in range(0, 80, 16):
        mgr.append(seq, list(range(i, i + 16)))
    assert pool.num_free == 1
    assert mgr.can_append(seq, 48)
    mgr.append(seq, list(range(80, 128)))
    assert len(seq.block_ids) == 1 + 4 and seq.evicted_tokens == 48
    mgr.check([seq])


def test_h2o_evicts_the_least_scored_eligible_block_never_sinks_pinned_or_recent():
    """Under h2o the victim is the lowest-score block between the sink region (sinks + pinned system
    prompt) and the protected recent blocks, whatever the sink and recent blocks score."""
    from streamchat.cache.manager import H2O

    pool, mgr = make(sink=4, window=96, eviction="h2o", h2o=H2O(recent_tokens=32))
    seq = mgr.new_seq(pinned_tokens=20)  # 2 sink blocks: sinks + the pinned prompt
    mgr.append(seq, list(range(128)))  # 8 blocks: 2 sink, 6 window (full)
    assert seq.block_ids == [1, 2, 3, 4, 5, 6, 7, 8] and seq.eviction == "h2o"
    # table idx:         0    1    2    3    4    5     6    7
    mgr.observe(seq, [0.0, 0.0, 5.0, 0.5, 3.0, 1.0, 0.1, 0.0], num_queries=128)
    assert mgr.victims(seq, 1) == [3], "idx 0, 1 (sinks), 6, 7 (recent 32 tokens) are protected"
    mgr.append(seq, [999])
    assert seq.block_ids == [1, 2, 3, 5, 6, 7, 8, 4], "block 4 (idx 3) left; the tail reuses it"
    assert seq.token_ids[48:64] == list(range(64, 80)), "a hole in the conversation, none in the table"
    assert seq.block_scores == [0.0, 0.0, 5.0, 3.0, 1.0, 0.1, 0.0, 0.0]
    assert seq.evicted_tokens == 16 and mgr.evicted_by_policy == {"sink_window": 0, "h2o": 16}
    mgr.append(seq, list(range(1000, 1015)))  # fills the new block: 8 blocks full again
    mgr.append(seq, [7])
    # idx 6, 7 (blocks 8, 4) are the recent ones now; eligible idx 2..5 score 5, 3, 1, 0.1
    assert seq.block_ids == [1, 2, 3, 5, 6, 8, 4, 7], "block 7 (idx 5, 0.1) left and came back as the tail"
    assert seq.block_scores == [0.0, 0.0, 5.0, 3.0, 1.0, 0.0, 0.0, 0.0]
    mgr.check([seq])


def test_h2o_takes_the_oldest_recent_block_when_too_few_are_eligible():
    """Evicting more blocks than lie outside the recent window goes on with the oldest recent ones."""
    from streamchat.cache.manager import H2O

    pool, mgr = make(sink=4, window=64, eviction="h2o", h2o=H2O(recent_tokens=32))
    seq = mgr.new_seq()
    mgr.append(seq, list(range(80)))  # 1 sink + 4 window blocks; idx 3, 4 recent
    mgr.observe(seq, [0.0, 2.0, 1.0, 0.0, 0.0], num_queries=80)
    assert mgr.victims(seq, 1) == [2] and mgr.victims(seq, 3) == [1, 2, 3]


def test_h2o_scores_decay_per_query_token():
    """observe multiplies older mass by decay ** queries, then adds the new mass."""
    from streamchat.cache.manager import H2O

    pool, mgr = make(eviction="h2o", h2o=H2O(decay=0.5))
    seq = mgr.new_seq()
    mgr.append(seq, list(range(32)))
    mgr.observe(seq, [1.0, 2.0], num_queries=1)
    mgr.observe(seq, [0.25, 0.0], num_queries=2)
    assert seq.block_scores == [0.5, 0.5]


def test_sink_window_ignores_scores():
    """The default policy evicts the oldest block after the sinks whatever it scored."""
    pool, mgr = make(sink=4, window=32)
    seq = mgr.new_seq()
    mgr.append(seq, list(range(48)))
    mgr.observe(seq, [0.0, 9.0, 0.0], num_queries=48)
    assert seq.eviction == "sink_window" and mgr.victims(seq, 1) == [1]
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'"):
        mgr.new_seq(eviction="lru")
