"""The engine's boundary: typed commands in, typed results and events out.

Owns every message that crosses between the server (event loop) and the
engine (its own thread): one frozen dataclass per command, plain result
types, the engine's error, and the snapshot the engine publishes after each
step for health checks and metrics. Torch-free plain data; nothing here
reaches into the scheduler, the pager or the pool. The server builds the
OpenAI shapes from these numbers.

    server ──Command──▶ AsyncEngine (queue) ──▶ Engine.handle(cmd) ──▶ result | EngineError
    server ◀──EngineEvent (per response / ticket)── step()
    server ◀──EngineSnapshot (after every step, read-only)──
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class EngineError(Exception):
    """A request the engine cannot take; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- commands ------------------------------------------------------------------------

Message = tuple[str, str, bool]  # (role, text, closed) of one transcript item, oldest first


@dataclass(frozen=True)
class OpenSession:
    session_id: str
    instructions: str = ""


@dataclass(frozen=True)
class RestoreTranscript:
    """Open a session from its transcript; returns the transcript's length in tokens."""

    session_id: str
    instructions: str
    messages: tuple[Message, ...]
    admit: bool = False  # new work (a stateless request), not a rebuild: the daemon's pending limit applies


@dataclass(frozen=True)
class RestoreSaved:
    """Open a session from its saved KV (a tiers Snapshot); returns None, or why not."""

    session_id: str
    instructions: str
    messages: tuple[Message, ...]
    snapshot: Any


@dataclass(frozen=True)
class LoadSaved:
    """Read and check a session's saved file (run off the engine thread): a Snapshot.

    Raises tiers.KVFileError with its reason when the file cannot be used.
    """

    session_id: str
    mark: str


@dataclass(frozen=True)
class SetInstructions:
    session_id: str
    instructions: str


@dataclass(frozen=True)
class PrepareItem:
    """Frame a message and check the session may take it; returns a Prepared. Changes nothing."""

    session_id: str
    role: str
    text: str


@dataclass(frozen=True)
class PrepareAppend:
    """Tokenize text for the open user item (opened if none); returns a Prepared. Changes nothing."""

    session_id: str
    text: str


@dataclass(frozen=True)
class Prepared:
    """Tokens checked against the limits, ready to queue once the store has them."""

    session_id: str
    token_ids: tuple[int, ...]
    opens_item: bool = False  # an append that opens the user item
    closes_item: bool = False  # an item that closes the open append item first
    kind: str = "item"  # item | append


@dataclass(frozen=True)
class Queue:
    """Queue prepared tokens; `ticket` is reported (ItemPrefilled) once they are in the cache.

    Returns the session's context after its queued work (tokens it will attend to).
    """

    prepared: Prepared
    ticket: Any = None


@dataclass(frozen=True)
class CommitText:
    """Close the open append item; returns True, or False when none was open."""

    session_id: str
    ticket: Any = None


@dataclass(frozen=True)
class StartResponse:
    session_id: str
    response_id: str
    params: Any  # SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    instructions: str | None = None  # this turn only: never kept in the context


@dataclass(frozen=True)
class CancelResponse:
    session_id: str


@dataclass(frozen=True)
class CloseSession:
    """End the session here; `keep_saved` keeps its file on disk so it can come back."""

    session_id: str
    keep_saved: bool = False


@dataclass(frozen=True)
class Prefetch:
    """A client attached: bring its KV up now; returns the Residency it came from."""

    session_id: str


@dataclass(frozen=True)
class GetStats:
    session_id: str


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


Command = (OpenSession | RestoreTranscript | RestoreSaved | LoadSaved | SetInstructions | PrepareItem
           | PrepareAppend | Queue | CommitText | StartResponse | CancelResponse | CloseSession | Prefetch
           | GetStats | CheckpointCandidates | Checkpoint | Release | Persist)


# -- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Plain numbers about one finished response; the server shapes them for the wire."""

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

    Built on the engine thread and replaced whole, so a reader on another
    thread never sees a half-changed figure.
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
    failed_steps: int = 0
    tiers: dict[str, Any] = field(default_factory=dict)  # host/disk figures, moves, load failures
