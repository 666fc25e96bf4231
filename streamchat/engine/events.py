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
class TokenLogprobs:
    """A sampled token's log-probability (natural log, <= 0) and the most likely tokens' (id, logprob), most
    likely first (ties: lower id first). See `streamchat.model.sampling_logprobs` for the distribution."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class NewTokens:
    """Tokens a response sampled in one step, in order (never the end-of-sequence token).

    `logprobs`: one per token when the response asked for them, else empty.
    """

    session_id: str
    response_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()


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
class TokenLogprob:
    """A token as the front reports it (front side): its text, its bytes, its log-probability, and for a
    sampled token the most likely alternatives. `text` is `raw` as UTF-8, a partial character replaced."""

    token_id: int
    text: str
    raw: bytes
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text of a response (front side): the deltas concatenated are its final text.

    `logprobs`: the tokens this delta's text came from, when the response
    asked for them (a token holding part of a character brings its entry
    with empty text; the text follows with a later token).
    """

    session_id: str
    response_id: str
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


EngineEvent = ItemPrefilled | NewTokens | ResponseFinished
