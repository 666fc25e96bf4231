"""What the engine reports after a step. Torch-free plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ItemPrefilled:
    """All tokens of a submitted piece of work are in the cache."""

    session_id: str
    ticket: object
    context_tokens: int


@dataclass(frozen=True)
class TextDelta:
    session_id: str
    response_id: str
    text: str


@dataclass(frozen=True)
class ResponseFinished:
    session_id: str
    response_id: str
    status: str  # completed | cancelled | incomplete | failed
    reason: str | None  # client_cancelled | max_output_tokens | overloaded | ...
    text: str
    usage: dict = field(default_factory=dict)
    token_ids: tuple[int, ...] = ()


EngineEvent = ItemPrefilled | TextDelta | ResponseFinished
