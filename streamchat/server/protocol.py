"""Client half of the wire protocol: parse and validate one client event.

Owns the error codes, `ProtocolError`, `Limits`, one frozen dataclass per
client event and `parse_client_event`, which turns one websocket frame into
one of those dataclasses or raises `ProtocolError`. Pure: no I/O, no torch.
It must not know sessions, the engine, the store or sockets, nor what the
server does with an event; server events are built in
`streamchat.server.events`.

Leniency rules (see docs/protocol.md): unknown fields are ignored, a JSON
`null` in an optional field means "absent", and every field we use is
type- and range-checked. Numbers are refused unless finite, even if a
decoder more lenient than orjson let NaN or an infinity through. The
sampling fields are read by `streamchat.model.sampling_params.read_fields`,
the table the HTTP API reads them with too.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Union

import orjson

from streamchat.model.sampling_params import FieldError, read_fields


class ErrorCode(str, enum.Enum):
    """`error.code` values of the `error` server event."""

    INVALID_JSON = "invalid_json"
    INVALID_EVENT = "invalid_event"
    UNKNOWN_EVENT = "unknown_event"
    CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE = "conversation_already_has_active_response"
    RESPONSE_CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    SESSION_NOT_FOUND = "session_not_found"
    MESSAGE_TOO_LARGE = "message_too_large"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"
    STORE_UNAVAILABLE = "store_unavailable"
    ITEM_ID_IN_USE = "item_id_in_use"
    PENDING_LIMIT_EXCEEDED = "pending_limit_exceeded"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    ENGINE_RESTARTING = "engine_restarting"
    INSTRUCTIONS_TOO_LONG = "instructions_too_long"
    SESSION_LEASED = "session_leased"
    LEASE_LOST = "lease_lost"


ERROR_CODES: tuple[str, ...] = tuple(code.value for code in ErrorCode)
# Codes reported with error.type "server_error"; all others are
# "invalid_request_error".
SERVER_ERROR_CODES: frozenset[str] = frozenset(
    {"overloaded", "internal", "store_unavailable", "engine_unavailable", "engine_restarting", "session_leased",
     "lease_lost"},
)

# Sampling fields a session keeps as its defaults (session.update); a
# response.create may set these, `seed`, `logit_bias` and `logprobs`. Names of
# SamplingParams fields.
SESSION_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty",
                           "repetition_penalty", "min_p")
RESPONSE_SAMPLING_FIELDS = SESSION_SAMPLING_FIELDS + ("seed", "logit_bias", "logprobs")
# The JSON fields response.create reads them from (`top_logprobs` sets `logprobs`' count)
_RESPONSE_WIRE_FIELDS = SESSION_SAMPLING_FIELDS + ("seed", "logit_bias", "logprobs", "top_logprobs")

_INVALID = ErrorCode.INVALID_EVENT


class ProtocolError(Exception):
    """A client event was refused; becomes one `error` server event.

    `code` is a plain str from ERROR_CODES; `event_id` is the client's
    `event_id` when it could be read, else None.
    """

    def __init__(self, code: ErrorCode | str, message: str, event_id: str | None = None) -> None:
        self.code: str = ErrorCode(code).value  # ValueError: a code outside the spec
        self.message = message
        self.event_id = event_id
        super().__init__(f"{self.code}: {message}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds applied while parsing (the server fills them from its config)."""

    max_text_chars: int = 1_000_000  # item / append / instructions text -> message_too_large
    max_output_tokens: int = 32_768  # upper bound of every max_output_tokens field
    max_stop_strings: int = 16  # entries in response.stop
    max_event_id_chars: int = 256  # event_id and every client-supplied id or token
    max_stop_chars: int = 256  # code points in each response.stop entry

    def __post_init__(self) -> None:
        for name in ("max_text_chars", "max_output_tokens", "max_stop_strings", "max_event_id_chars",
                     "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")


MaxTokens = Union[int, Literal["inf"]]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionUpdate:
    """Every field None: leave unchanged. The sampling fields are the session's defaults
    for later responses (streamchat extensions)."""

    TYPE: ClassVar[str] = "session.update"
    event_id: str | None = None
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields this update sets, by SamplingParams name."""
        return _set_fields(self, SESSION_SAMPLING_FIELDS)


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemCreate:
    TYPE: ClassVar[str] = "conversation.item.create"
    event_id: str | None = None
    role: Literal["user", "system", "assistant"]
    text: str  # the texts of all content parts, concatenated
    item_id: str | None = None  # `item.id` chosen by the client


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseCreate:
    TYPE: ClassVar[str] = "response.create"
    event_id: str | None = None
    max_output_tokens: MaxTokens | None = None
    instructions: str | None = None  # this turn only
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias), ids increasing
    logprobs: int | None = None  # report log-probabilities with this many alternatives (top_logprobs)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields this response sets, by SamplingParams name (None: unset)."""
        return _set_fields(self, RESPONSE_SAMPLING_FIELDS)


def _set_fields(event: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(event, name) for name in names if getattr(event, name) is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseCancel:
    TYPE: ClassVar[str] = "response.cancel"
    event_id: str | None = None
    response_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class InputTextAppend:
    TYPE: ClassVar[str] = "streamchat.input_text.append"
    event_id: str | None = None
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InputTextCommit:
    TYPE: ClassVar[str] = "streamchat.input_text.commit"
    event_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionResume:
    TYPE: ClassVar[str] = "streamchat.session.resume"
    event_id: str | None = None
    session_id: str
    resume_token: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionStats:
    TYPE: ClassVar[str] = "streamchat.session.stats"
    event_id: str | None = None


ClientEvent = Union[
    SessionUpdate, ItemCreate, ResponseCreate, ResponseCancel,
    InputTextAppend, InputTextCommit, SessionResume, SessionStats,
]
CLIENT_EVENT_TYPES: tuple[str, ...] = (
    SessionUpdate.TYPE, ItemCreate.TYPE, ResponseCreate.TYPE, ResponseCancel.TYPE,
    InputTextAppend.TYPE, InputTextCommit.TYPE, SessionResume.TYPE, SessionStats.TYPE,
)


def parse_client_event(data: str | bytes, *, limits: Limits) -> ClientEvent:
    """Parse one websocket frame; raise ProtocolError for anything wrong.

    A `bytes` frame is a binary frame and is refused (`invalid_event`).
    """
    obj = _load_object(data)
    event_id = _read_event_id(obj, limits)
    try:
        kind = obj.get("type")
        if not isinstance(kind, str):
            raise ProtocolError(_INVALID, "event has no string 'type'")
        parser = _PARSERS.get(kind)
        if parser is None:
            raise ProtocolError(ErrorCode.UNKNOWN_EVENT, f"unknown event type {kind[:64]!r}")
        return parser(obj, event_id, limits)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, event_id) from None


def _load_object(data: str | bytes) -> dict[str, Any]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(_INVALID, "binary frames are not accepted; send JSON in a text frame")
    if not isinstance(data, str):
        raise TypeError(f"frame must be str or bytes, not {type(data).__name__}")
    try:
        # orjson refuses lone surrogates, NaN, +-Infinity and nesting over
        # 1024 levels with JSONDecodeError: all of them are invalid_json.
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(_INVALID, "event must be a JSON object")
    return obj


def _read_event_id(obj: dict[str, Any], limits: Limits) -> str | None:
    event_id = obj.get("event_id")
    if event_id is None:
        return None
    if not isinstance(event_id, str):
        raise ProtocolError(_INVALID, "event_id must be a string")
    if len(event_id) > limits.max_event_id_chars:
        limit = limits.max_event_id_chars
        raise ProtocolError(_INVALID, f"event_id is longer than {limit} characters")
    return event_id


# -- field readers: `where` is the dotted path used in error messages -------


def _object(
    obj: dict[str, Any], key: str, where: str, *, required: bool,
) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(_INVALID, f"{where}{key} must be an object")
    return value


def _text(
    obj: dict[str, Any], key: str, where: str, limits: Limits, *, required: bool,
) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ProtocolError(_INVALID, f"{where}{key} must be a string")
    if len(value) > limits.max_text_chars:
        raise ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"{where}{key} is longer than {limits.max_text_chars} characters",
        )
    return value


def _ident(
    obj: dict[str, Any], key: str, where: str, limits: Limits, *, required: bool,
) -> str | None:
    """An id or token: a non-empty string of at most max_event_id_chars."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= limits.max_event_id_chars:
        limit = limits.max_event_id_chars
        raise ProtocolError(_INVALID, f"{where}{key} must be a string of 1 to {limit} characters")
    return value


def url_session_id(query: str, limits: Limits) -> str | None:
    """The session a websocket URL names (`?session_id=...`, for a proxy to route on), or None.

    ProtocolError (invalid_event) if it is given twice, empty or too long; a
    `streamchat.session.resume` on that socket must then name the same session.
    """
    from urllib.parse import parse_qs

    values = parse_qs(query, keep_blank_values=True).get("session_id")
    if values is None:
        return None
    if len(values) != 1:
        raise ProtocolError(_INVALID, "the URL names session_id more than once")
    return _ident({"session_id": values[0]}, "session_id", "the URL's ", limits, required=True)


def _max_tokens(obj: dict[str, Any], where: str, limits: Limits) -> MaxTokens | None:
    value = obj.get("max_output_tokens")
    if value is None or value == "inf":
        return value
    if type(value) is not int or not 1 <= value <= limits.max_output_tokens:
        limit = limits.max_output_tokens
        raise ProtocolError(
            _INVALID, f"{where}max_output_tokens must be 'inf' or an integer in [1, {limit}]",
        )
    return value


def _sampling(obj: dict[str, Any], where: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The sampling fields among `names` that `obj` sets, by SamplingParams name (see "Sampling numbers")."""
    try:
        return read_fields(obj, names)
    except FieldError as exc:
        raise ProtocolError(_INVALID, f"{where}{exc}") from None


def _stop(obj: dict[str, Any], where: str, limits: Limits) -> tuple[str, ...] | None:
    value = obj.get("stop")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > limits.max_stop_strings:
        limit = limits.max_stop_strings
        raise ProtocolError(_INVALID, f"{where}stop must be a list of at most {limit} strings")
    limit = limits.max_stop_chars
    if not all(isinstance(s, str) and 0 < len(s) <= limit for s in value):
        raise ProtocolError(_INVALID, f"{where}stop entries must be strings of 1 to {limit} characters")
    return tuple(value)


# -- one parser per event type -------------------------------------------------


def _parse_session_update(obj: dict[str, Any], event_id: str | None, limits: Limits) -> SessionUpdate:
    session = _object(obj, "session", "", required=True)
    # The GA SDK sends session.type "realtime"; a transcription session
    # ("transcription") is something else we cannot serve.
    if session.get("type") not in (None, "realtime"):
        raise ProtocolError(_INVALID, "session.type must be 'realtime'")
    return SessionUpdate(
        event_id=event_id,
        instructions=_text(session, "instructions", "session.", limits, required=False),
        max_output_tokens=_max_tokens(session, "session.", limits),
        **_sampling(session, "session.", SESSION_SAMPLING_FIELDS),
    )


_PART_TYPES = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "assistant")


def _parse_item_create(obj: dict[str, Any], event_id: str | None, limits: Limits) -> ItemCreate:
    _ident(obj, "previous_item_id", "", limits, required=False)  # checked, then ignored
    item = _object(obj, "item", "", required=True)
    if item.get("type", "message") != "message":
        raise ProtocolError(_INVALID, "item.type must be 'message'")
    role = item.get("role")
    if role not in _ROLES:
        raise ProtocolError(_INVALID, "item.role must be 'user', 'system' or 'assistant'")
    return ItemCreate(
        event_id=event_id,
        role=role,
        text=_content_text(item.get("content"), limits),
        item_id=_ident(item, "id", "item.", limits, required=False),
    )


def _content_text(content: Any, limits: Limits) -> str:
    if not isinstance(content, list):
        raise ProtocolError(_INVALID, "item.content must be a list of content parts")
    texts: list[str] = []
    num_chars = 0
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _PART_TYPES:
            raise ProtocolError(
                _INVALID,
                "item.content parts must be objects of type 'input_text', 'output_text' or 'text'",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ProtocolError(_INVALID, "item.content[].text must be a string")
        num_chars += len(text)
        if num_chars > limits.max_text_chars:
            raise ProtocolError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"item text is longer than {limits.max_text_chars} characters",
            )
        texts.append(text)
    return "".join(texts)


def _parse_response_create(obj: dict[str, Any], event_id: str | None, limits: Limits) -> ResponseCreate:
    response = _object(obj, "response", "", required=False) or {}
    where = "response."
    return ResponseCreate(
        event_id=event_id,
        max_output_tokens=_max_tokens(response, where, limits),
        instructions=_text(response, "instructions", where, limits, required=False),
        stop=_stop(response, where, limits),
        **_sampling(response, where, _RESPONSE_WIRE_FIELDS),
    )


def _parse_response_cancel(obj: dict[str, Any], event_id: str | None, limits: Limits) -> ResponseCancel:
    response_id = _ident(obj, "response_id", "", limits, required=False)
    return ResponseCancel(event_id=event_id, response_id=response_id)


def _parse_append(obj: dict[str, Any], event_id: str | None, limits: Limits) -> InputTextAppend:
    return InputTextAppend(event_id=event_id, text=_text(obj, "text", "", limits, required=True))


def _parse_commit(obj: dict[str, Any], event_id: str | None, limits: Limits) -> InputTextCommit:
    return InputTextCommit(event_id=event_id)


def _parse_resume(obj: dict[str, Any], event_id: str | None, limits: Limits) -> SessionResume:
    return SessionResume(
        event_id=event_id,
        session_id=_ident(obj, "session_id", "", limits, required=True),
        resume_token=_ident(obj, "resume_token", "", limits, required=True),
    )


def _parse_stats(obj: dict[str, Any], event_id: str | None, limits: Limits) -> SessionStats:
    return SessionStats(event_id=event_id)


_Parser = Callable[[dict[str, Any], Union[str, None], Limits], ClientEvent]
_PARSERS: types.MappingProxyType[str, _Parser] = types.MappingProxyType({
    SessionUpdate.TYPE: _parse_session_update,
    ItemCreate.TYPE: _parse_item_create,
    ResponseCreate.TYPE: _parse_response_create,
    ResponseCancel.TYPE: _parse_response_cancel,
    InputTextAppend.TYPE: _parse_append,
    InputTextCommit.TYPE: _parse_commit,
    SessionResume.TYPE: _parse_resume,
    SessionStats.TYPE: _parse_stats,
})
