"""Where a session's KV lives: the one enum every tier figure and move is named by. Torch-free."""

from __future__ import annotations

import enum


class Residency(str, enum.Enum):
    """Where a session's KV is. Only the engine's scheduler (its placement) changes a session's."""

    DEVICE = "device"  # in the device pool: its table is live
    HOST = "host"  # copied to the host tier
    DISK = "disk"  # in its file on disk
    DROPPED = "dropped"  # tokens only: rebuilt by prefill on next use

    def __str__(self) -> str:
        return self.value


TIERS = tuple(Residency)
# the moves between tiers that are counted (from, to)
MOVES = ((Residency.DEVICE, Residency.HOST), (Residency.DEVICE, Residency.DISK), (Residency.HOST, Residency.DISK),
         (Residency.HOST, Residency.DROPPED), (Residency.HOST, Residency.DEVICE), (Residency.DISK, Residency.DEVICE))
