"""The tier policy: idle sessions move down (device -> host -> disk), active ones come back up.

Owns where each idle session's KV lives and every move between tiers: a
session the scheduler asks to give up its blocks goes to the host tier if it
has room, else straight to disk when disk already holds its current state,
else to the host tier after the host's least recently paged-out sessions go
to disk, else to disk; only when no tier takes it is it dropped to its
tokens. Bringing one back allocates device blocks (re-taking pristine
leading blocks still in the prefix cache instead of copying them) and copies
its KV in: nothing is recomputed. Counts every move and every refused file.

Runs on the engine thread, except `note_failure` and the figures.

    EngineSession.residency (only this module and the scheduler change it)
    device --page_out--> host --(host full: its oldest)--> disk   (no disk: dropped)
    device --page_out--> disk   (the host cannot take it, or disk holds it already)
    device <--page_in--- host | disk   (copied back; a bad file: dropped)
    dropped: only its tokens are kept; the next use rebuilds it by prefill
"""

from __future__ import annotations

import logging
import threading

from streamchat.cache.manager import SeqCache, chain_hash
from streamchat.engine.session import Residency
from streamchat.tiers import kvfile
from streamchat.tiers.disk import DiskTier
from streamchat.tiers.host import HostTier, copy_blocks
from streamchat.tiers.kvfile import KVFileError, SeqState, Snapshot

log = logging.getLogger(__name__)

MOVES = (("device", "host"), ("device", "disk"), ("host", "disk"), ("host", "dropped"),
         ("host", "device"), ("disk", "device"))


class Pager:
    def __init__(self, manager, device_caches, host: HostTier | None, disk: DiskTier | None) -> None:
        self.manager = manager
        self.kv = device_caches
        self.bs = manager.block_size
        self.host = host
        self.disk = disk
        self.block_bytes = sum(t[0].numel() * t.element_size() for kv in device_caches for t in kv if t is not None)
        self.moves = dict.fromkeys(MOVES, 0)
        self.load_failures = dict.fromkeys(kvfile.REASONS, 0)
        self._lock = threading.Lock()

    # -- down -----------------------------------------------------------------------

    def page_out(self, s) -> bool:
        """Move an idle resident session's blocks down a tier; False if no tier takes it."""
        seq = s.seq
        state = state_of(s)
        target = self._place(s, state, seq)
        if target is None:
            return False
        self.manager.free(seq)
        s.seq = self.manager.new_seq(s.pinned_tokens, s.seq.eviction)
        s.residency, s.dropped_tokens, s.parked = Residency(target), list(state.token_ids), state
        self.moves[("device", target)] += 1
        return True

    def _place(self, s, state: SeqState, seq: SeqCache) -> str | None:
        hashes = seq.block_hashes if seq.pristine else []
        host = self.host
        if host is not None and host.blocks_needed(state, hashes) <= host.pool.num_free:
            host.put(s, state, hashes, self.kv, seq.block_ids)
            return "host"
        if self.on_disk(s):
            return "disk"
        if host is not None and len(seq.block_ids) <= host.capacity:
            while host.blocks_needed(state, hashes) > host.pool.num_free and host.entries:
                self._evict_host(host.oldest())
            if host.blocks_needed(state, hashes) <= host.pool.num_free:
                host.put(s, state, hashes, self.kv, seq.block_ids)
                return "host"
        if self._disk_takes(len(seq.block_ids)):
            snap = Snapshot(s.session_id, state, kvfile.gather(self.kv, seq.block_ids), s.transcript_mark)
            if self.disk.save(snap, s.kv_version):
                return "disk"
        return None

    def _disk_takes(self, num_blocks: int) -> bool:
        """The disk tier is on and one file of this many blocks fits its budget."""
        return self.disk is not None and num_blocks * self.block_bytes <= self.disk.budget

    def _evict_host(self, entry) -> None:
        """The host's oldest session goes to disk (dropped to its tokens if disk cannot take it)."""
        s = entry.session
        to = "disk"
        if not self.on_disk(s):
            taken = self._disk_takes(len(entry.block_ids)) and self.disk.save(
                Snapshot(s.session_id, entry.state, self.host.gather(entry), s.transcript_mark), s.kv_version)
            to = "disk" if taken else "dropped"
        self.host.release(entry)
        s.residency = Residency(to)
        self.moves[("host", to)] += 1

    def on_disk(self, s) -> bool:
        """Disk holds the session's current state (written, or queued for writing)."""
        copy = self.disk.copy_of(s.session_id) if self.disk is not None else None
        return copy is not None and copy.version == s.kv_version

    # -- up -------------------------------------------------------------------------

    def page_in(self, s, make_free) -> bool:
        """Bring a host or disk session back to the device pool; False leaves it where it was.

        `make_free(n)` makes n device blocks free (paging idle sessions down).
        """
        if s.tier == "host":
            # out of the host's LRU while it comes up: making room may push others to the host
            entry = self.host.entries.pop(s.session_id)
            seq = self.to_device(entry.state, lambda rows, ids: copy_blocks(
                self.host.caches, [entry.block_ids[r] for r in rows], self.kv, ids, self.host.stream), make_free)
            if seq is None:
                self.host.entries[s.session_id] = entry
                self.host.entries.move_to_end(s.session_id, last=False)
                return False
            self.host.release(entry)
        elif s.tier == "disk":
            try:
                snap = self.disk.load(s.session_id)
                if snap.state.token_ids != s.dropped_tokens:
                    raise KVFileError("inconsistent", "its tokens are not the session's")
            except KVFileError as exc:
                self.note_failure(exc.reason)
                log.warning("session %s: saved KV not used (%s); rebuilding it from its tokens", s.session_id, exc)
                s.residency, s.parked = Residency.DROPPED, None
                return False
            seq = self.to_device(snap.state, lambda rows, ids: kvfile.scatter(snap.tensors, rows, self.kv, ids),
                                 make_free)
            if seq is None:
                return False
        else:
            return False
        self.moves[(s.tier, "device")] += 1
        s.seq, s.residency, s.dropped_tokens, s.parked = seq, Residency.DEVICE, [], None
        return True

    def to_device(self, state: SeqState, copy_rows, make_free) -> SeqCache | None:
        """A block table holding `state` in freshly allocated device blocks, or None if no room.

        Leading full blocks of a pristine state that the prefix cache still
        holds are re-taken instead of copied; `copy_rows(rows, block_ids)`
        copies the others in.
        """
        pool, bs = self.manager.pool, self.bs
        tokens = state.token_ids
        ids: list[int | None] = [None] * state.num_blocks(bs)
        if state.pristine and self.manager.prefix_sharing:
            parent = 0
            for idx in range(len(tokens) // bs):
                block_tokens = tuple(tokens[idx * bs:(idx + 1) * bs])
                parent = chain_hash(parent, block_tokens, self.manager.extra_key)
                ids[idx] = pool.lookup(parent, block_tokens)
                if ids[idx] is not None:
                    pool.touch(ids[idx])
        rows = [r for r, b in enumerate(ids) if b is None]
        if not make_free(len(rows)):
            for b in ids:
                if b is not None:
                    pool.free(b)
            return None
        for r in rows:
            ids[r] = pool.allocate()
        copy_rows(rows, [ids[r] for r in rows])
        seq = SeqCache(block_ids=ids, token_ids=list(tokens), num_sink_blocks=state.num_sink_blocks,
                       pristine=state.pristine, evicted_tokens=state.evicted_tokens,
                       cached_tokens=state.cached_tokens, queried_tokens=state.queried_tokens,
                       eviction=state.eviction,
                       block_scores=[float(x) for x in state.block_scores] or [0.0] * len(ids))
        self.manager.commit(seq)  # registers the copied blocks for reuse, as prefill would
        return seq

    def discard(self, s, delete_file: bool = False) -> None:
        """Forget the session's host copy (and its file); it is resident or gone now."""
        entry = self.host.entries.get(s.session_id) if self.host is not None else None
        if entry is not None:
            self.host.release(entry)
        if delete_file and self.disk is not None:
            self.disk.delete(s.session_id)
        s.parked = None

    # -- saving copies ------------------------------------------------------------------

    def checkpoint(self, s, mark: str) -> bool:
        """Save an idle session's current state to disk, stamped with its transcript `mark`."""
        if self.disk is None or s.busy:
            return False
        s.transcript_mark = mark
        copy = self.disk.copy_of(s.session_id)
        if copy is not None and copy.version == s.kv_version:
            if copy.mark == mark:
                return True
            try:  # the same KV, stamped anew
                old = self.disk.load(s.session_id)
            except KVFileError:
                return False
            snap = Snapshot(s.session_id, old.state, old.tensors, mark)
        elif s.tier == "device" and s.seq.block_ids and self._disk_takes(len(s.seq.block_ids)):
            snap = Snapshot(s.session_id, state_of(s), kvfile.gather(self.kv, s.seq.block_ids), mark)
        elif s.tier == "host" and self._disk_takes(len(self.host.entries[s.session_id].block_ids)):
            entry = self.host.entries[s.session_id]
            snap = Snapshot(s.session_id, entry.state, self.host.gather(entry), mark)
        else:
            return False
        return self.disk.save(snap, s.kv_version)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- figures --------------------------------------------------------------------

    def note_failure(self, reason: str) -> None:
        with self._lock:
            self.load_failures[reason] += 1

    def check(self, sessions) -> None:
        """Assert every session's tier agrees with where its KV is."""
        if self.host is not None:
            self.host.check()
        for s in sessions:
            assert s.resident == (s.tier == "device"), (s.session_id, s.tier)
            in_host = self.host is not None and s.session_id in self.host.entries
            assert in_host == (s.tier == "host"), (s.session_id, s.tier)
            if not s.resident:
                assert not s.seq.block_ids and s.parked is not None or s.tier == "dropped"


def state_of(s) -> SeqState:
    seq = s.seq
    return SeqState(list(seq.token_ids), seq.num_sink_blocks, s.pinned_tokens, seq.pristine,
                    seq.evicted_tokens, s.total_tokens, seq.cached_tokens, seq.queried_tokens,
                    seq.eviction, list(seq.block_scores))
