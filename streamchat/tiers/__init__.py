"""A memory hierarchy for sessions' KV below the device pool: host memory, and one file per session on disk.

`kvfile` is the saved-session format, `host` and `disk` the two lower tiers,
`pager` the mover that copies blocks between them and the device pool (it
decides nothing: the engine's scheduler says what goes where and when),
`residency` the names of the tiers. `build_pager` wires them for an engine.
Importing this package imports nothing heavy; its modules import torch.
"""

from __future__ import annotations

from pathlib import Path


def build_pager(cfg, runner, cache_cfg, manager, data_dir: Path | str | None):
    """The engine's Pager, or None when both lower tiers are off (no host memory, no data dir)."""
    from streamchat.tiers.disk import DiskTier
    from streamchat.tiers.host import HostTier
    from streamchat.tiers.kvfile import KVLayout
    from streamchat.tiers.pager import Pager

    num_host_blocks = cfg.host_bytes // runner.bytes_per_block
    host = HostTier(runner.kv_specs, num_host_blocks, runner.model.device) if num_host_blocks else None
    disk = None
    if cfg.disk_bytes and data_dir is not None:
        disk = DiskTier(Path(data_dir), cfg.disk_bytes, KVLayout.of(runner, cache_cfg),
                        vocab_size=runner.model.shape.vocab_size)
    if host is None and disk is None:
        return None
    return Pager(manager, runner.kv_caches, host, disk)


__all__ = ["build_pager"]
