"""The engine's boundary: typed commands in, typed results and step outputs out.

Owns every message that crosses between the front (the server's event loop,
in its own process) and the engine core: one frozen dataclass per command,
plain result types, the engine's error, and the snapshot the core publishes
for health checks and metrics. Nothing but token ids, numbers and short
strings crosses: the front frames and tokenizes requests and detokenizes
replies; the core never sees request text and never sends KV. Torch-free
plain data; `engine.wire` encodes it.

    front ──Command──▶ CoreClient ══(zmq)══▶ EngineCore ──▶ Engine.handle(cmd) ──▶ result | EngineError
    front ◀──StepOutput (one per core iteration: every response's new tokens)══
    front ◀──EngineSnapshot (in the step outputs, at most every 0.2 s)══
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamchat.model.sampling_params import SamplingParams

Tokens = tuple[int, ...]


class EngineError(Exception):
    """A request the engine cannot take; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- commands: sessions ------------------------------------------------------------------


@dataclass(frozen=True)
class OpenSession:
    """A new session whose context starts with `prefix` (BOS + framed system prompt: pinned)."""

    session_id: str
    prefix: Tokens = ()


@dataclass(frozen=True)
class RestoreTranscript:
    """Open a session from its transcript: `prefix`, then `tokens` (cut to the window here)."""

    session_id: str
    prefix: Tokens
    tokens: Tokens = ()
    open_item: bool = False  # the transcript ends in an open append item
    num_items: int = 0
    admit: bool = False  # new work (a stateless request), not a rebuild: the daemon's pending limit applies


@dataclass(frozen=True)
class RestoreSaved:
    """Open a session from its saved file, read off the step loop; None when restored, else why not.

    `prefix` must be what the file's context starts with; `mark` what it was stamped with.
    """

    session_id: str
    prefix: Tokens
    mark: str
    open_item: bool = False
    num_items: int = 0


@dataclass(frozen=True)
class SetInstructions:
    """A new pinned prefix; the rest of the context is kept and rebuilt behind it."""

    session_id: str
    prefix: Tokens


@dataclass(frozen=True)
class CheckRoom:
    """Would the session and the daemon take `num_tokens` more queued tokens? Changes nothing."""

    session_id: str
    num_tokens: int


@dataclass(frozen=True)
class Queue:
    """Queue tokens the store already holds; returns the session's context after its queued work.

    kind: `item` (a whole message; `closes_item` if it first closes the open append item),
    `append` (raw text into the open user item; `opens_item` for the first), `commit` (closes it).
    `ticket` is reported in a step output once every token is in the cache.
    """

    session_id: str
    token_ids: Tokens
    kind: str = "item"
    opens_item: bool = False
    closes_item: bool = False
    ticket: int | None = None


@dataclass(frozen=True)
class StartResponse:
    """Queue a reply: `close` (closing an open append item), then `instructions` (this turn only:
    they leave the context when it ends), then the reply prompt; sample from there."""

    session_id: str
    response_id: str
    params: SamplingParams
    max_tokens: int | None = None
    instructions: Tokens = ()
    close: Tokens = ()


@dataclass(frozen=True)
class CancelResponse:
    session_id: str


@dataclass(frozen=True)
class StopResponse:
    """The front's detokenizer met a stop string at the reply's token `num_tokens`: the reply ends
    there (completed); tokens sampled after it leave the context."""

    session_id: str
    response_id: str
    num_tokens: int


@dataclass(frozen=True)
class CloseSession:
    """End the session here; `keep_saved` keeps its file on disk so it can come back."""

    session_id: str
    keep_saved: bool = False


@dataclass(frozen=True)
class Prefetch:
    """A client attached: bring its KV up now; returns the tier it came from."""

    session_id: str


@dataclass(frozen=True)
class GetStats:
    session_id: str


# -- commands: saving -------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointCandidates:
    """Ids of sessions idle for `idle_s` whose current state is not saved with a mark."""

    idle_s: float


@dataclass(frozen=True)
class Checkpoint:
    """Save an idle session to disk, stamped with its transcript mark; returns True if saved."""

    session_id: str
    mark: str


@dataclass(frozen=True)
class Release:
    """Move an idle session out of memory: saved to disk if it can be, then closed.

    Returns True if it left memory (a later resume loads its file or its transcript).
    """

    session_id: str
    mark: str | None = None


@dataclass(frozen=True)
class Persist:
    """Shutdown: finish queued prefill (until the deadline), then save sessions; returns how many."""

    marks: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0


Command = (OpenSession | RestoreTranscript | RestoreSaved | SetInstructions | CheckRoom | Queue
           | StartResponse | CancelResponse | StopResponse | CloseSession | Prefetch | GetStats
           | CheckpointCandidates | Checkpoint | Release | Persist)
COMMANDS: tuple[type, ...] = Command.__args__


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Plain numbers about one finished response; the front shapes them for the wire."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    context_tokens: int = 0
    evicted_tokens: int = 0
    ttft_ms: float | None = None
    output_tokens_per_s: float | None = None


@dataclass(frozen=True)
class SessionStats:
    context_tokens: int
    total_tokens: int
    evicted_tokens: int
    cached_tokens: int
    owned_blocks: int
    shared_blocks: int
    pool_cached_free: int
    pool_free: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    kv_bytes: int
    items: int
    queued_tokens: int
    residency: str
    on_disk: bool
    eviction: str = "sink_window"  # the session's policy: evicted_tokens are its doing


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after its last step: read by /healthz and /metrics.

    Built on the core's loop between steps and replaced whole, so a reader
    never sees a half-changed figure.
    """

    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_used: int = 0
    kv_blocks_shared: int = 0
    kv_blocks_held: int = 0  # distinct blocks in some session's table
    kv_blocks_total: int = 0
    kv_bytes_per_token: int = 0
    kv_bytes_per_block: int = 0
    sessions: int = 0
    sessions_running: int = 0
    sessions_waiting: int = 0
    sessions_idle: int = 0
    sessions_by_residency: dict[str, int] = field(default_factory=dict)
    queued_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_tokens: int = 0
    evicted_by_policy: dict[str, int] = field(default_factory=dict)  # tokens, by eviction policy
    preemptions: int = 0
    idle_drops: int = 0
    cached_block_evictions: int = 0
    steps: int = 0
    tokens: int = 0
    step_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    failed_steps: int = 0
    tiers: dict[str, Any] = field(default_factory=dict)  # host/disk figures, moves, load failures
