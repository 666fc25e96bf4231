"""The mover: copies a session's blocks between the device pool, the host tier and the disk tier.

Owns the copies and the figures about them (moves between tiers, files
refused by reason); decides nothing and changes no session. The engine's
scheduler (its placement) says what goes where and when, keeps each
session's `Residency`, and makes room in the device pool before it asks
for a page-in, so nothing here calls back up. Sessions are named by id;
their state travels as `SeqState`.

    device --to_host / save_device--> host | disk      (copies out; the caller frees the blocks)
    host   --save_host--> disk                          (the host's oldest, when the host needs room)
    host | snapshot --plan_in, land--> device           (copies in: a new block table)
    disk   --load_async (reader thread)--> snapshot     (read and checked off the step loop)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from streamchat.cache.manager import SeqCache, chain_hash
from streamchat.tiers import kvfile
from streamchat.tiers.disk import DiskTier
from streamchat.tiers.host import HostTier, copy_blocks
from streamchat.tiers.kvfile import SeqState, Snapshot
from streamchat.tiers.residency import MOVES, Residency

log = logging.getLogger(__name__)


@dataclass
class PlanIn:
    """A page-in under way: the device block per table row, None where a copy must land."""

    state: SeqState
    ids: list[int | None]
    hashes: list[int] = field(default_factory=list)  # the chain hash of each full block, when it can be shared

    @property
    def missing(self) -> list[int]:
        return [r for r, b in enumerate(self.ids) if b is None]


class Pager:
    def __init__(self, manager, device_caches, host: HostTier | None, disk: DiskTier | None) -> None:
        self.manager = manager
        self.kv = device_caches
        self.bs = manager.block_size
        self.host = host
        self.disk = disk
        self.block_bytes = sum(t[0].numel() * t.element_size() for kv in device_caches for t in kv if t is not None)
        self.moves: dict[tuple[Residency, Residency], int] = dict.fromkeys(MOVES, 0)
        self.load_failures = dict.fromkeys(kvfile.REASONS, 0)
        self._lock = threading.Lock()

    # -- the host tier ------------------------------------------------------------------

    def host_fits(self, state: SeqState, hashes: list[int]) -> bool:
        """The host has free blocks for this state now."""
        return self.host is not None and self.host.blocks_needed(state, hashes) <= self.host.pool.num_free

    def host_could_fit(self, num_blocks: int) -> bool:
        """The host could hold this many blocks once its other sessions leave."""
        return self.host is not None and num_blocks <= self.host.capacity

    def to_host(self, session_id: str, state: SeqState, block_ids: list[int], hashes: list[int]) -> None:
        """Copy device blocks into the host tier (the caller checked `host_fits`)."""
        self.host.put(session_id, state, hashes, self.kv, block_ids)
        self.moves[(Residency.DEVICE, Residency.HOST)] += 1

    def host_oldest(self, keep: str | None = None) -> str | None:
        """The session least recently paged out to the host (never `keep`: it is coming back up)."""
        if self.host is None:
            return None
        return next((sid for sid in self.host.entries if sid != keep), None)

    def host_state(self, session_id: str) -> SeqState:
        return self.host.entries[session_id].state

    def drop_host(self, session_id: str, to: Residency | None = None) -> None:
        """Forget the session's host copy (`to`: where it went instead, counted as a move)."""
        entry = self.host.entries.get(session_id) if self.host is not None else None
        if entry is not None:
            self.host.release(entry)
            if to is not None:
                self.moves[(Residency.HOST, to)] += 1

    # -- the disk tier ------------------------------------------------------------------

    def on_disk(self, session_id: str, version: int) -> bool:
        """Disk holds this version of the session (written, or queued for writing)."""
        copy = self.disk.copy_of(session_id) if self.disk is not None else None
        return copy is not None and copy.version == version

    def disk_mark(self, session_id: str) -> str | None:
        copy = self.disk.copy_of(session_id) if self.disk is not None else None
        return copy.mark if copy is not None else None

    def disk_takes(self, num_blocks: int) -> bool:
        """The disk tier is on and one file of this many blocks fits its budget."""
        return self.disk is not None and num_blocks * self.block_bytes <= self.disk.budget

    def save_device(self, session_id: str, state: SeqState, block_ids: list[int], version: int,
                    mark: str | None) -> bool:
        """Queue a file of the session's device blocks (copied out now, written on the writer thread)."""
        if not self.disk_takes(len(block_ids)):
            return False
        return self.disk.save(Snapshot(session_id, state, kvfile.gather(self.kv, block_ids), mark), version)

    def save_host(self, session_id: str, version: int, mark: str | None) -> bool:
        """Queue a file of the session's host copy."""
        entry = self.host.entries[session_id]
        if not self.disk_takes(len(entry.block_ids)):
            return False
        return self.disk.save(Snapshot(session_id, entry.state, self.host.gather(entry), mark), version)

    def restamp(self, session_id: str, mark: str) -> bool:
        return self.disk is not None and self.disk.restamp(session_id, mark)

    def adopt(self, session_id: str, version: int) -> None:
        """The session's state now is what its file holds (it was just loaded from it)."""
        self.disk.adopt(session_id, version)

    def delete_file(self, session_id: str) -> None:
        if self.disk is not None:
            self.disk.delete(session_id)

    def load_async(self, session_id: str, mark, done) -> None:
        """Read and check the session's file on the reader thread; `done(Snapshot | KVFileError)` there."""
        def finished(result) -> None:
            if isinstance(result, kvfile.KVFileError):
                self.note_failure(result.reason)
            done(result)

        self.disk.load_async(session_id, mark, finished)

    # -- into the device pool -------------------------------------------------------------

    def plan_in(self, state: SeqState) -> PlanIn:
        """Start a page-in: leading full blocks of a pristine state that the prefix cache still
        holds are taken (a reference each) instead of copied; the rest are `missing`."""
        pool, bs = self.manager.pool, self.bs
        tokens = state.token_ids
        ids: list[int | None] = [None] * state.num_blocks(bs)
        hashes: list[int] = []
        if state.pristine and self.manager.prefix_sharing:
            parent = 0
            for idx in range(len(tokens) // bs):
                block_tokens = tuple(tokens[idx * bs:(idx + 1) * bs])
                parent = chain_hash(parent, block_tokens, self.manager.extra_key)
                hashes.append(parent)
                ids[idx] = pool.lookup(parent, block_tokens)
                if ids[idx] is not None:
                    pool.touch(ids[idx])
        return PlanIn(state, ids, hashes)

    def abort(self, plan: PlanIn) -> None:
        """Give back the references a plan took."""
        for b in plan.ids:
            if b is not None:
                self.manager.pool.free(b)

    def land_host(self, plan: PlanIn, session_id: str) -> SeqCache:
        """Finish a page-in from the host copy (the caller made room for `plan.missing`)."""
        entry = self.host.entries[session_id]
        seq = self._land(plan, lambda rows, ids: copy_blocks(
            self.host.caches, [entry.block_ids[r] for r in rows], self.kv, ids, self.host.stream))
        self.drop_host(session_id, to=Residency.DEVICE)
        return seq

    def land_snapshot(self, plan: PlanIn, snap: Snapshot) -> SeqCache:
        """Finish a page-in from a loaded file (the caller made room for `plan.missing`)."""
        seq = self._land(plan, lambda rows, ids: kvfile.scatter(snap.tensors, rows, self.kv, ids))
        self.moves[(Residency.DISK, Residency.DEVICE)] += 1
        return seq

    def _land(self, plan: PlanIn, copy_rows) -> SeqCache:
        pool, ids, state = self.manager.pool, plan.ids, plan.state
        rows = plan.missing
        for r in rows:
            ids[r] = pool.allocate()
        copy_rows(rows, [ids[r] for r in rows])
        for r in rows:  # the copied full blocks become findable, under the hashes plan_in computed
            if r < len(plan.hashes):
                pool.register(ids[r], plan.hashes[r], tuple(state.token_ids[r * self.bs:(r + 1) * self.bs]))
        seq = SeqCache(block_ids=ids, token_ids=list(state.token_ids), num_sink_blocks=state.num_sink_blocks,
                       pristine=state.pristine, evicted_tokens=state.evicted_tokens,
                       cached_tokens=state.cached_tokens, queried_tokens=state.queried_tokens,
                       eviction=state.eviction,
                       block_scores=[float(x) for x in state.block_scores] or [0.0] * len(ids),
                       block_hashes=list(plan.hashes))
        self.manager.commit(seq)  # nothing left to register, unless the state could not be shared
        return seq

    # -- lifecycle and figures ----------------------------------------------------------

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def note_failure(self, reason: str) -> None:
        with self._lock:
            self.load_failures[reason] += 1

    def check(self, host_ids: set[str]) -> None:
        """Assert the host tier holds exactly the sessions said to be there."""
        if self.host is not None:
            self.host.check()
            assert set(self.host.entries) == host_ids, (set(self.host.entries), host_ids)
        else:
            assert not host_ids


def state_of(seq: SeqCache, pinned_tokens: int, total_tokens: int) -> SeqState:
    return SeqState(list(seq.token_ids), seq.num_sink_blocks, pinned_tokens, seq.pristine,
                    seq.evicted_tokens, total_tokens, seq.cached_tokens, seq.queried_tokens,
                    seq.eviction, list(seq.block_scores))
