"""Server half of the wire protocol: build server events and the objects they carry.

Owns ids (`new_id`), the `session`, `item` and `response` objects shaped like
the GA OpenAI Realtime API, one builder per server event (each a fresh dict
with a fresh `event_id`), the ordered events that open and close a response,
and `encode`. Pure: no I/O, no torch. It must not know sessions, the engine,
the store or sockets; callers pass in every figure an event reports.

A response streams as (output_index and content_index are always 0: one
message item with one text part per response):

    response.created
    response.output_item.added        item in_progress, content []
    conversation.item.added           same item
    response.content_part.added       part {"type": "text", "text": ""}
    response.output_text.delta  x N   deltas concatenate to the final text
    response.output_text.done         text
    response.content_part.done        part with the final text
    response.output_item.done         item with its final status and text
    conversation.item.done            same item
    response.done                     always sent, whatever happened
"""

from __future__ import annotations

import secrets
import types
from typing import Any, Iterable, Literal, Mapping, Union

import orjson

from streamchat.engine.events import TokenLogprob
from streamchat.server.protocol import SERVER_ERROR_CODES, SESSION_SAMPLING_FIELDS, ErrorCode

MaxTokens = Union[int, Literal["inf"]]
Role = Literal["user", "system", "assistant"]

RESPONSE_STATUSES: tuple[str, ...] = ("in_progress", "completed", "cancelled", "incomplete", "failed")
ITEM_STATUSES: tuple[str, ...] = ("in_progress", "completed", "incomplete")
RESTORED_FROM: tuple[str, ...] = ("memory", "disk", "transcript")
# Default status_details.reason per final status (GA Realtime reasons).
DEFAULT_REASONS: Mapping[str, str] = types.MappingProxyType(
    {"cancelled": "client_cancelled", "incomplete": "max_output_tokens"},
)
_DEFAULT_FAILURE: Mapping[str, str] = types.MappingProxyType(
    {"type": "server_error", "code": "internal", "message": "response failed"},
)
STATS_FIELDS: tuple[str, ...] = (
    "context_tokens", "total_tokens", "evicted_tokens", "blocks", "kv_bytes", "items",
)


def new_id(prefix: str) -> str:
    """`prefix` + "_" + 32 hex digits (128 random bits), e.g. new_id("evt")."""
    return f"{prefix}_{secrets.token_hex(16)}"


def encode(event: Mapping[str, Any]) -> str:
    """One server event as the JSON text of one websocket text frame."""
    return orjson.dumps(event).decode()


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("evt"), **fields}


# -- objects -------------------------------------------------------------------


def session_object(
    *,
    session_id: str,
    model: str,
    instructions: str,
    max_output_tokens: MaxTokens,
    truncation: Mapping[str, int],
    resume_token: str | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `session` object; `truncation` holds sink_tokens, window_tokens, block_size.

    `resume_token` is included only when given (only session.created shows it).
    `sampling`: the session's effective sampling defaults (temperature, top_p,
    top_k, frequency_penalty, presence_penalty, repetition_penalty, min_p),
    shown as top-level fields after `max_output_tokens` when given.
    """
    session: dict[str, Any] = {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "instructions": instructions,
        "output_modalities": ["text"],
        "max_output_tokens": max_output_tokens,
    }
    if sampling:
        assert set(sampling) <= set(SESSION_SAMPLING_FIELDS), sampling
        session.update(sampling)
    if resume_token is not None:
        session["resume_token"] = resume_token
    session["truncation"] = {
        "type": "streamchat.sink_window",
        "sink_tokens": truncation["sink_tokens"],
        "window_tokens": truncation["window_tokens"],
        "block_size": truncation["block_size"],
    }
    return session


def item_object(
    item_id: str, role: Role, text: str | None, *, status: str = "completed",
) -> dict[str, Any]:
    """A message item; `text=None` gives `content: []` (an assistant item just opened).

    The part type is `output_text` for assistant items, `input_text` otherwise.
    """
    if status not in ITEM_STATUSES:
        raise ValueError(f"item status {status!r} not in {ITEM_STATUSES}")
    part_type = "output_text" if role == "assistant" else "input_text"
    content = [] if text is None else [{"type": part_type, "text": text}]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": content,
    }


def status_details(
    status: str, *, reason: str | None = None, error: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """`response.status_details`: None while in progress or when completed.

    cancelled/incomplete carry `reason` (default client_cancelled /
    max_output_tokens); failed carries `error` ({"type", "code", "message"}).
    """
    if status not in RESPONSE_STATUSES:
        raise ValueError(f"response status {status!r} not in {RESPONSE_STATUSES}")
    if status in ("in_progress", "completed"):
        return None
    details: dict[str, Any] = {"type": status}
    if status == "failed":
        details["error"] = dict(error) if error is not None else dict(_DEFAULT_FAILURE)
    else:
        details["reason"] = reason or DEFAULT_REASONS[status]
    return details


def usage_object(
    *,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    context_tokens: int,
    evicted_tokens: int,
    ttft_ms: float | None,
    output_tokens_per_s: float | None,
) -> dict[str, Any]:
    """`response.usage`: GA fields plus streamchat's context_tokens, evicted_tokens, timing."""
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {"cached_tokens": cached_tokens},
        "context_tokens": context_tokens,
        "evicted_tokens": evicted_tokens,
        "timing": {"ttft_ms": ttft_ms, "output_tokens_per_s": output_tokens_per_s},
    }


def response_object(
    response_id: str,
    status: str,
    *,
    output: Iterable[Mapping[str, Any]] = (),
    usage: Mapping[str, Any] | None = None,
    max_output_tokens: MaxTokens = "inf",
    reason: str | None = None,
    error: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object; `reason`/`error` feed `status_details` (see there)."""
    return {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details(status, reason=reason, error=error),
        "output": [dict(item) for item in output],
        "output_modalities": ["text"],
        "max_output_tokens": max_output_tokens,
        "usage": dict(usage) if usage is not None else None,
    }


# -- session and item events -----------------------------------------------------


def _without_token(session: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in session.items() if key != "resume_token"}


def session_created(session: Mapping[str, Any]) -> dict[str, Any]:
    """The first event on a connection; the only one that shows `resume_token`."""
    return _event("session.created", session=dict(session))


def session_updated(session: Mapping[str, Any]) -> dict[str, Any]:
    """The whole effective session after `session.update` (never the token)."""
    return _event("session.updated", session=_without_token(session))


def session_resumed(session: Mapping[str, Any], restored_from: str) -> dict[str, Any]:
    """`streamchat.session.resumed`: restored_from is memory, disk or transcript."""
    if restored_from not in RESTORED_FROM:
        raise ValueError(f"restored_from {restored_from!r} not in {RESTORED_FROM}")
    return _event(
        "streamchat.session.resumed", session=_without_token(session), restored_from=restored_from,
    )


def item_added(item: Mapping[str, Any], previous_item_id: str | None = None) -> dict[str, Any]:
    return _event("conversation.item.added", previous_item_id=previous_item_id, item=dict(item))


def item_done(item: Mapping[str, Any], previous_item_id: str | None = None) -> dict[str, Any]:
    return _event("conversation.item.done", previous_item_id=previous_item_id, item=dict(item))


def input_text_appended(item_id: str, tokens: int, context_tokens: int) -> dict[str, Any]:
    """`streamchat.input_text.appended`: `tokens` added to the open item `item_id`."""
    return _event(
        "streamchat.input_text.appended",
        item_id=item_id, tokens=tokens, context_tokens=context_tokens,
    )


def session_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """`streamchat.session.stats`, the figures at top level (see STATS_FIELDS)."""
    missing = [name for name in STATS_FIELDS if name not in stats]
    if missing:
        raise ValueError(f"session stats lack {missing}")
    return _event("streamchat.session.stats", **stats)


def error(code: ErrorCode | str, message: str, event_id: str | None = None) -> dict[str, Any]:
    """The `error` event; `event_id` is the client's, echoed inside `error`."""
    code = ErrorCode(code).value
    error_type = "server_error" if code in SERVER_ERROR_CODES else "invalid_request_error"
    body = {"type": error_type, "code": code, "message": message, "event_id": event_id}
    return _event("error", error=body)


# -- response events -------------------------------------------------------------


def response_created(response: Mapping[str, Any]) -> dict[str, Any]:
    return _event("response.created", response=dict(response))


def response_done(response: Mapping[str, Any]) -> dict[str, Any]:
    return _event("response.done", response=dict(response))


def output_item_added(
    response_id: str, item: Mapping[str, Any], *, output_index: int = 0,
) -> dict[str, Any]:
    return _event(
        "response.output_item.added",
        response_id=response_id, output_index=output_index, item=dict(item),
    )


def output_item_done(
    response_id: str, item: Mapping[str, Any], *, output_index: int = 0,
) -> dict[str, Any]:
    return _event(
        "response.output_item.done",
        response_id=response_id, output_index=output_index, item=dict(item),
    )


def _part_event(
    kind: str, response_id: str, item_id: str, output_index: int, content_index: int, **fields: Any,
) -> dict[str, Any]:
    return _event(
        kind, response_id=response_id, item_id=item_id,
        output_index=output_index, content_index=content_index, **fields,
    )


def content_part_added(
    response_id: str, item_id: str, *, output_index: int = 0, content_index: int = 0,
) -> dict[str, Any]:
    """Opens the (single) text part; GA part type is "text", not "output_text"."""
    part = {"type": "text", "text": ""}
    return _part_event(
        "response.content_part.added", response_id, item_id, output_index, content_index, part=part,
    )


def content_part_done(
    response_id: str, item_id: str, text: str, *, output_index: int = 0, content_index: int = 0,
) -> dict[str, Any]:
    part = {"type": "text", "text": text}
    return _part_event(
        "response.content_part.done", response_id, item_id, output_index, content_index, part=part,
    )


def output_text_delta(
    response_id: str, item_id: str, delta: str, *, output_index: int = 0, content_index: int = 0,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`logprobs`: the delta's tokens (`logprobs_content`), only when the response asked for them."""
    extra = {} if logprobs is None else {"logprobs": logprobs}
    return _part_event(
        "response.output_text.delta", response_id, item_id, output_index, content_index, delta=delta, **extra,
    )


def logprobs_content(entries: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """Tokens as both wires report them (OpenAI's `logprobs.content`): per token its text, logprob, bytes
    and top_logprobs, the most likely first."""
    return [{**_token(e), "top_logprobs": [_token(t) for t in e.top]} for e in entries]


def _token(e: TokenLogprob) -> dict[str, Any]:
    return {"token": e.text, "logprob": e.logprob, "bytes": list(e.raw)}


def output_text_done(
    response_id: str, item_id: str, text: str, *, output_index: int = 0, content_index: int = 0,
) -> dict[str, Any]:
    return _part_event(
        "response.output_text.done", response_id, item_id, output_index, content_index, text=text,
    )


def response_start_events(
    response: Mapping[str, Any], item: Mapping[str, Any], previous_item_id: str | None = None,
) -> list[dict[str, Any]]:
    """Events before the first delta: `response` in progress, `item` just opened."""
    response_id, item_id = response["id"], item["id"]
    return [
        response_created(response),
        output_item_added(response_id, item),
        item_added(item, previous_item_id),
        content_part_added(response_id, item_id),
    ]


def response_end_events(
    response: Mapping[str, Any], item: Mapping[str, Any], previous_item_id: str | None = None,
) -> list[dict[str, Any]]:
    """Events after the last delta: `response` and `item` in their final state.

    The final text is read from the item's single content part.
    """
    response_id, item_id = response["id"], item["id"]
    text = item["content"][0]["text"] if item["content"] else ""
    return [
        output_text_done(response_id, item_id, text),
        content_part_done(response_id, item_id, text),
        output_item_done(response_id, item),
        item_done(item, previous_item_id),
        response_done(response),
    ]
