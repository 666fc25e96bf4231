"""The engine's published figures: one EngineSnapshot built on the engine's thread.

Owns reading live engine state into plain numbers. Called only on the
engine's thread (or by a test holding the engine), so nothing changes under
the read; the front reads the snapshot the core sends, never the engine.
"""

from __future__ import annotations

from streamchat.engine.api import EngineSnapshot
from streamchat.engine.session import TIERS, Phase


def take_snapshot(eng) -> EngineSnapshot:
    pool, mgr, sched = eng.pool, eng.manager, eng.scheduler.stats
    sessions = list(eng.sessions.values())
    running = sum(1 for s in sessions if s.response is not None and s.response.phase is not Phase.QUEUED)
    waiting = sum(1 for s in sessions if s.response is not None and s.response.phase is Phase.QUEUED)
    residency = [s.residency.value for s in sessions]
    return EngineSnapshot(
        kv_blocks_free=pool.num_free - pool.num_cached_free, kv_blocks_cached=pool.num_cached_free,
        kv_blocks_used=pool.num_used, kv_blocks_shared=pool.num_shared,
        kv_blocks_held=len(set().union(*(s.seq.block_ids for s in sessions))),
        kv_blocks_total=pool.num_usable, kv_bytes_per_token=eng.runner.bytes_per_token,
        kv_bytes_per_block=eng.runner.bytes_per_block,
        sessions=len(sessions), sessions_running=running, sessions_waiting=waiting,
        sessions_idle=sum(1 for s in sessions if s.response is None),
        sessions_by_residency={t.value: residency.count(t.value) for t in TIERS},
        queued_tokens=sum(s.queued_tokens for s in sessions),
        prefix_queried_tokens=mgr.num_prefix_queried_tokens, prefix_hit_tokens=mgr.num_prefix_hit_tokens,
        evicted_tokens=mgr.num_evicted_tokens, evicted_by_policy=dict(mgr.evicted_by_policy), preemptions=sched.preemptions, idle_drops=sched.idle_drops,
        cached_block_evictions=pool.num_cache_evictions, steps=eng.metrics.steps, tokens=eng.metrics.tokens,
        step_seconds=eng.metrics.step_seconds, decode_steps=eng.metrics.decode_steps,
        decode_step_seconds=eng.metrics.decode_step_seconds, failed_steps=eng.metrics.failed_steps,
        tiers=_tier_figures(eng.pager, eng.runner.bytes_per_block))


def _tier_figures(pager, per_block: int) -> dict:
    if pager is None:
        return {"host": None, "disk": None}
    host, disk = pager.host, pager.disk
    return {
        "host": {"blocks_used": host.pool.num_used, "blocks_total": host.capacity,
                 "bytes": host.pool.num_used * per_block, "capacity_bytes": host.capacity * per_block}
        if host else None,
        "disk": {"files": disk.num_files, "bytes": disk.num_bytes, "budget_bytes": disk.budget,
                 "root": str(disk.root), "writes": disk.num_writes, "written_bytes": disk.num_written_bytes,
                 "write_failures": disk.num_write_failures, "deletions": disk.num_deletions}
        if disk else None,
        "moves": {(a.value, b.value): n for (a, b), n in pager.moves.items()},
        "load_failures": dict(pager.load_failures),
    }
