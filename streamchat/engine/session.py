"""Engine-side state of one session: its cache, the work waiting for it, its response.

Torch-free plain data; the engine and scheduler change it, nothing else
(where its KV lives, `residency`, only the scheduler's placement).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from streamchat.cache.manager import SeqCache
from streamchat.tiers.residency import TIERS, Residency

__all__ = ["EngineSession", "Pending", "Phase", "Residency", "Response", "TIERS"]


@dataclass
class Pending:
    """Tokens waiting to enter the cache, in order; `ticket` is reported when all are in."""

    token_ids: list[int]
    ticket: object = None
    starts_response: bool = False  # sample after the last token
    done: int = 0  # tokens already placed

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.done


class Phase(enum.Enum):
    QUEUED = "queued"  # waiting for a running slot
    PREFILL = "prefill"  # its prompt is being placed
    DECODE = "decode"  # generating


@dataclass
class Response:
    response_id: str
    params: object  # SamplingParams
    max_tokens: int | None
    generator: object
    created_at: float
    phase: Phase = Phase.QUEUED
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet in the cache
    first_token_at: float | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    last_token_at: float | None = None
    instructions: list[int] = field(default_factory=list)  # its own system message: this turn only


@dataclass
class EngineSession:
    session_id: str
    seq: SeqCache
    pinned_tokens: int = 0  # the system prompt's length, kept in the sink region
    pending: deque[Pending] = field(default_factory=deque)
    deferred: list[Pending] = field(default_factory=list)  # arrived while a response runs
    response: Response | None = None
    open_item: bool = False  # a streamchat.input_text.append item is open
    last_active: float = 0.0
    progressed_at: float = 0.0  # when a token of it last entered the cache
    residency: Residency = Residency.DEVICE
    dropped_tokens: list[int] = field(default_factory=list)  # its context while not on the device
    parked: object = None  # its SeqState while in the host or disk tier
    loading: bool = False  # its file is being read (on the disk reader thread) to come back up
    kv_version: int = 0  # bumped whenever its context changes: tells current saved copies from old
    transcript_mark: str | None = None  # the stored transcript its context matches, if known
    total_tokens: int = 0
    computed_this_turn: int = 0
    num_items: int = 0

    @property
    def resident(self) -> bool:
        return self.residency is Residency.DEVICE

    @property
    def queued_tokens(self) -> int:
        """Tokens waiting to enter the cache: pending now, or after the running response."""
        return sum(p.remaining for p in self.pending) + sum(p.remaining for p in self.deferred)

    @property
    def busy(self) -> bool:
        return bool(self.pending) or self.response is not None

    @property
    def runnable(self) -> bool:
        """It has work the scheduler can take now (its KV is on the device)."""
        return self.resident and self.busy

    @property
    def decoding(self) -> bool:
        r = self.response
        return r is not None and r.phase is Phase.DECODE and r.next_token is not None and not self.pending
