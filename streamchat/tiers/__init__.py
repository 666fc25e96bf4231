"""A memory hierarchy for sessions: the device pool, host memory, and one file per session on disk.

`kvfile` is the saved-session format, `host` and `disk` the two lower tiers,
`pager` the policy that moves idle sessions down and active ones back up.
`build_pager` wires them for an engine from its `TierConfig`.
"""

from __future__ import annotations

from pathlib import Path

from streamchat.tiers.kvfile import REASONS, KVFileError, KVLayout, SeqState, Snapshot


def build_pager(cfg, runner, cache_cfg, manager, data_dir: Path | str | None):
    """The engine's Pager, or None when both lower tiers are off (no host memory, no data dir)."""
    from streamchat.tiers.disk import DiskTier
    from streamchat.tiers.host import HostTier
    from streamchat.tiers.pager import Pager

    num_host_blocks = cfg.host_bytes // runner.bytes_per_block
    host = HostTier(runner.kv_specs, num_host_blocks, runner.model.device) if num_host_blocks else None
    disk = None
    if cfg.disk_bytes and data_dir is not None:
        disk = DiskTier(Path(data_dir), cfg.disk_bytes, KVLayout.of(runner, cache_cfg))
    if host is None and disk is None:
        return None
    return Pager(manager, runner.kv_caches, host, disk)


__all__ = ["build_pager", "KVFileError", "KVLayout", "REASONS", "SeqState", "Snapshot"]
