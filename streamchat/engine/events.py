"""What the engine reports: step events (core side) and the front's text events. Torch-free plain data.

The core reports token ids only; the front turns them into text
(`TextDelta`, and `ResponseFinished.text`) with its detokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamchat.engine.api import Usage


@dataclass(frozen=True)
class ItemPrefilled:
    """All tokens of a queued piece of work are in the cache."""

    session_id: str
    ticket: int | None
    context_tokens: int


@dataclass(frozen=True)
class NewTokens:
    """Tokens a response sampled in one step, in order (never the end-of-sequence token)."""

    session_id: str
    response_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ResponseFinished:
    session_id: str
    response_id: str
    status: str  # completed | cancelled | incomplete | failed
    reason: str | None  # client_cancelled | max_output_tokens | overloaded | engine_restarting | ...
    usage: Usage | None = None
    token_ids: tuple[int, ...] = ()  # the reply's tokens as they stay in the context
    text: str = ""  # filled by the front's detokenizer


@dataclass(frozen=True)
class TextDelta:
    """New text of a response (front side): the deltas concatenated are its final text."""

    session_id: str
    response_id: str
    text: str


EngineEvent = ItemPrefilled | NewTokens | ResponseFinished
