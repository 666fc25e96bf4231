"""Per-sequence block tables over the pool: appends, sink + window or H2O eviction, prefix reuse.

Owns each sequence's block table and the tokens its cache holds. Knows the
pool and the cache settings; knows nothing about sessions, requests, models
or tensors. Torch-free.

A sequence's table, with S sink blocks and a window of W blocks:

    table idx:  0 .. S-1 | S ........................ S+W-1 | (S+W: the block being filled)
                sinks     the most recent tokens, oldest first
    cache pos:  idx * block_size + offset   (contiguous: evicting shifts positions left)

When an append would leave more than `window_cap` tokens after the sinks,
whole blocks after the sinks leave the table and their reference is dropped;
nothing is copied. Eviction happens only when a token needs a new block, so
feeding block-aligned chunks of one block gives exactly what token-by-token
feeding gives. Which blocks leave is the sequence's policy (`eviction`):

    sink_window  the oldest blocks after the sinks (StreamingLLM)
    h2o          the blocks with the least score (`block_scores`: attention mass,
                 fed by `observe`) among those after the sinks and before the
                 protected recent blocks; if those are too few, the oldest
                 protected ones next

    table idx:  0 .. S-1 | S ............ | ......... n-R-1 | n-R .. n-1 (+ partial)
                sinks      h2o: the least-scored of these go    recent: protected

Either way the table stays a list of whole blocks in cache order: an h2o
eviction leaves a hole in the conversation, not in the table, and the blocks
after it take the next cache positions (they are position-free).

Prefix reuse: while a sequence's KV equals a cold prefill of its tokens
("pristine": no eviction since it was built), every full block is registered
under a hash chained over all tokens before it plus `extra_key` (model, KV
dtype). Only full blocks are shared, so the partially filled last block is
always the sequence's own and a shared block is never written.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from streamchat.cache.block_pool import BlockPool, NoFreeBlocks


class Placement(NamedTuple):
    """Where an append's tokens go: physical slots and cache positions."""

    slots: list[int]
    positions: list[int]
    num_evicted: int  # tokens evicted to make room


@dataclass
class SeqCache:
    """One sequence's block table and the tokens its cache holds, in cache order."""

    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_sink_blocks: int = 1
    eviction: str = "sink_window"  # config.EVICTIONS
    block_scores: list[float] = field(default_factory=list)  # per table idx: attention mass drawn (h2o)
    pristine: bool = True
    block_hashes: list[int] = field(default_factory=list)  # of the first full blocks
    evicted_tokens: int = 0
    cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed
    queried_tokens: int = 0  # tokens looked up in the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SeqStats(NamedTuple):
    context_tokens: int
    evicted_tokens: int
    owned_blocks: int
    shared_blocks: int
    cached_tokens: int


def chain_hash(parent: int, token_ids: tuple[int, ...], extra_key: bytes) -> int:
    """Hash of a full block: its parent's hash, its tokens, and what else its KV depends on."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(extra_key)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))  # each id as 4 little-endian bytes
    return int.from_bytes(h.digest(), "little")


class H2O(NamedTuple):
    """The h2o policy's settings: protected recent tokens, decay of older mass per query token."""

    recent_tokens: int = 256
    decay: float = 1.0


class KVCacheManager:
    """Block tables for many sequences over one pool."""

    def __init__(self, pool: BlockPool, block_size: int, sink_tokens: int,
                 window_tokens: int, extra_key: bytes = b"", prefix_sharing: bool = True,
                 eviction: str = "sink_window", h2o: H2O = H2O()) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sink_tokens = sink_tokens
        self.window_cap = -(-window_tokens // block_size) * block_size
        self.extra_key = extra_key
        self.prefix_sharing = prefix_sharing
        self.eviction = eviction  # the default of new sequences
        self.recent_blocks = -(-h2o.recent_tokens // block_size)
        self.decay = h2o.decay
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evicted_tokens = 0
        self.evicted_by_policy = {"sink_window": 0, "h2o": 0}  # tokens

    @property
    def max_chunk(self) -> int:
        """The largest append that never evicts a block it is writing."""
        return self.window_cap - self.block_size

    def new_seq(self, pinned_tokens: int = 0, eviction: str | None = None) -> SeqCache:
        """A sequence whose sink region covers `sink_tokens` and `pinned_tokens`."""
        sink = max(self.sink_tokens, pinned_tokens)
        eviction = eviction or self.eviction
        if eviction not in self.evicted_by_policy:
            raise ValueError(f"unknown eviction policy {eviction!r}; choose from {', '.join(self.evicted_by_policy)}")
        return SeqCache(num_sink_blocks=-(-sink // self.block_size), eviction=eviction)

    def match_prefix(self, seq: SeqCache, token_ids: list[int]) -> int:
        """Take cached full blocks for the head of `token_ids`; return tokens taken.

        Only a pristine sequence at a block boundary can take blocks. The
        caller appends the remaining `token_ids[taken:]` itself.
        """
        bs = self.block_size
        if not (self.prefix_sharing and seq.pristine) or seq.num_tokens % bs:
            return 0
        self.num_prefix_queried_tokens += len(token_ids) // bs * bs
        seq.queried_tokens += len(token_ids) // bs * bs
        taken = 0
        while taken + bs <= len(token_ids):
            block_tokens = tuple(token_ids[taken:taken + bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else 0
            block_hash = chain_hash(parent, block_tokens, self.extra_key)
            block_id = self.pool.lookup(block_hash, block_tokens)
            if block_id is None:
                break
            self.pool.touch(block_id)
            seq.block_ids.append(block_id)
            seq.block_scores.append(0.0)
            seq.block_hashes.append(block_hash)
            seq.token_ids.extend(block_tokens)
            taken += bs
        self.num_prefix_hit_tokens += taken
        seq.cached_tokens += taken
        return taken

    def plan(self, seq: SeqCache, num_new: int) -> tuple[int, int]:
        """(blocks to evict, blocks to allocate) for appending `num_new` tokens."""
        bs = self.block_size
        sink_region = seq.num_sink_blocks * bs
        after_sinks = max(0, seq.num_tokens + num_new - sink_region)
        num_evict = max(0, -(-(after_sinks - self.window_cap) // bs))
        remaining = seq.num_tokens - num_evict * bs
        num_alloc = -(-(remaining + num_new) // bs) - (len(seq.block_ids) - num_evict)
        return num_evict, max(0, num_alloc)

    def can_append(self, seq: SeqCache, num_new: int) -> bool:
        num_evict, num_alloc = self.plan(seq, num_new)
        return num_alloc <= self.pool.num_free + self._freed_by_evicting(seq, num_evict)

    def _freed_by_evicting(self, seq: SeqCache, num_evict: int) -> int:
        """Blocks an eviction returns to the pool: those no other table references."""
        return sum(1 for i in self.victims(seq, num_evict) if self.pool.ref_counts[seq.block_ids[i]] == 1)

    def victims(self, seq: SeqCache, num_evict: int) -> list[int]:
        """Table indices of the `num_evict` blocks the sequence's policy evicts next, ascending."""
        first, full = seq.num_sink_blocks, seq.num_tokens // self.block_size
        if seq.eviction == "sink_window":
            return list(range(first, first + num_evict))
        protected = max(first, full - self.recent_blocks)
        scores = seq.block_scores
        ranked = sorted(range(first, protected), key=lambda i: (scores[i], i)) + list(range(protected, full))
        return sorted(ranked[:num_evict])

    def observe(self, seq: SeqCache, block_mass: list[float], num_queries: int) -> None:
        """Add a step's attention mass per table idx (summed over its `num_queries` queries) to the
        scores; older mass decays by `decay` per query token."""
        assert len(block_mass) == len(seq.block_scores), "mass for another table"
        keep = self.decay ** num_queries
        seq.block_scores[:] = [s * keep + m for s, m in zip(seq.block_scores, block_mass)]

    def append(self, seq: SeqCache, token_ids: list[int]) -> Placement:
        """Evict as the policy says, allocate blocks, and place `token_ids`.

        Raises NoFreeBlocks, changing nothing, when the pool cannot hold them.
        """
        num_new = len(token_ids)
        num_evict, num_alloc = self.plan(seq, num_new)
        full_after_sinks = max(0, seq.num_tokens // self.block_size - seq.num_sink_blocks)
        if num_evict > full_after_sinks:
            raise ValueError(f"an append of {num_new} tokens would evict its own tokens; "
                             f"split it into chunks of at most {self.max_chunk}")
        if num_alloc > self.pool.num_free + self._freed_by_evicting(seq, num_evict):
            raise NoFreeBlocks(f"need {num_alloc} blocks, {self.pool.num_free} free")
        if num_evict:
            self._evict(seq, num_evict)
        for _ in range(num_alloc):
            seq.block_ids.append(self.pool.allocate())
            seq.block_scores.append(0.0)
        bs = self.block_size
        start = seq.num_tokens
        positions = list(range(start, start + num_new))
        slots = [seq.block_ids[p // bs] * bs + p % bs for p in positions]
        seq.token_ids.extend(token_ids)
        return Placement(slots, positions, num_evict * bs)

    def _evict(self, seq: SeqCache, num_blocks: int) -> None:
        bs = self.block_size
        victims = self.victims(seq, num_blocks)
        for idx in reversed(victims):
            self.pool.free(seq.block_ids[idx])
            del seq.block_ids[idx]
            del seq.block_scores[idx]
            del seq.token_ids[idx * bs:(idx + 1) * bs]
        del seq.block_hashes[min(victims[0], len(seq.block_hashes)):]
        seq.pristine = False
        seq.evicted_tokens += num_blocks * bs
        self.num_evicted_tokens += num_blocks * bs
        self.evicted_by_policy[seq.eviction] += num_blocks * bs

    def commit(self, seq: SeqCache) -> None:
        """Register the sequence's newly full blocks for reuse (after their KV is written)."""
        if not (self.prefix_sharing and seq.pristine):
            return
        bs = self.block_size
        for idx in range(len(seq.block_hashes), seq.num_tokens // bs):
            block_tokens = tuple(seq.token_ids[idx * bs:(idx + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else 0
            block_hash = chain_hash(parent, block_tokens, self.extra_key)
            self.pool.register(seq.block_ids[idx], block_hash, block_tokens)
            seq.block_hashes.append(block_hash)

    def truncate(self, seq: SeqCache, num_tokens: int) -> None:
        """Keep the first `num_tokens` (a block boundary); drop the later blocks' references, tail first.

        What stays is unchanged, so a pristine sequence stays pristine.
        """
        bs = self.block_size
        if num_tokens % bs or num_tokens > seq.num_tokens:
            raise ValueError(f"cannot cut {seq.num_tokens} tokens back to {num_tokens}")
        keep = num_tokens // bs
        for block_id in reversed(seq.block_ids[keep:]):
            self.pool.free(block_id)
        del seq.block_ids[keep:]
        del seq.block_scores[keep:]
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[keep:]

    def free(self, seq: SeqCache) -> None:
        """Drop every reference of the sequence, tail first, and empty it."""
        for block_id in reversed(seq.block_ids):
            self.pool.free(block_id)
        seq.block_ids.clear()
        seq.block_scores.clear()
        seq.token_ids.clear()
        seq.block_hashes.clear()
        seq.pristine = True

    def stats(self, seq: SeqCache) -> SeqStats:
        shared = sum(1 for b in seq.block_ids if self.pool.ref_counts[b] > 1)
        return SeqStats(seq.num_tokens, seq.evicted_tokens, len(seq.block_ids) - shared,
                        shared, seq.cached_tokens)

    def check(self, seqs: list[SeqCache]) -> None:
        """Assert the tables agree with the pool: every reference accounted for."""
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        for seq in seqs:
            assert len(seq.block_ids) == -(-seq.num_tokens // self.block_size)
            assert len(seq.block_hashes) <= len(seq.block_ids) == len(seq.block_scores)
            for block_id in seq.block_ids:
                refs[block_id] += 1
        assert refs == self.pool.ref_counts, "block tables and ref counts disagree"


__all__ = ["KVCacheManager", "H2O", "SeqCache", "Placement", "SeqStats", "NoFreeBlocks", "chain_hash"]
