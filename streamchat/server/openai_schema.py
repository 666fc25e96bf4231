"""The OpenAI HTTP API's shapes: chat completion requests in, completions, chunks and errors out.

Owns validating a `POST /v1/chat/completions` body into a `ChatRequest`
(every refusal an `ApiError` naming the field; a field this daemon does not
know or support is refused too, never ignored; the sampling fields are read
by `streamchat.model.sampling_params.read_fields`, as the websocket's are),
and building the objects the
API answers with: `chat.completion`, `chat.completion.chunk`, `usage`, the
model list and the error object `{"error": {"message", "type", "param",
"code"}}`. Pure: no I/O, no engine, no sockets; callers pass in every figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from streamchat.model.sampling_params import WIRE_FIELDS, FieldError, read_fields
from streamchat.server.protocol import Limits

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields a client may send that change nothing here while they hold their default.
DEFAULTS_ONLY = {"n": 1, "tools": [], "functions": [], "tool_choice": "none", "parallel_tool_calls": None}
# Every field a request may carry; any other is refused by name. `user` (an end user's id) changes nothing.
# The sampling ones include OpenAI's logprobs, top_logprobs and logit_bias, and the extensions top_k,
# repetition_penalty and min_p (as vLLM and llama.cpp's server take them).
KNOWN_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                          "stop", "user", "response_format", *DEFAULTS_ONLY, *WIRE_FIELDS})


class ApiError(Exception):
    """An error the API answers with: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    """A chat completion request, checked; `messages` as the engine takes them: (role, text, closed)."""

    model: str
    instructions: str
    messages: tuple[tuple[str, str, bool], ...]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    # the sampling fields the request set, by SamplingParams name; the rest take the daemon's defaults
    sampling: Mapping[str, Any] = field(default_factory=dict)

    @property
    def logprobs(self) -> int | None:
        """None: no log-probabilities; k: each token's, with k alternatives."""
        return self.sampling.get("logprobs")


def parse_chat_request(body: bytes, limits: Limits) -> ChatRequest:
    """The request in `body`, or ApiError 400 naming the first field at fault."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise invalid("We could not parse the JSON body of your request: it is not valid JSON.") from None
    if not isinstance(doc, dict):
        raise invalid("The request body must be a JSON object.")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", "model", "missing_required_parameter")
    instructions, messages = _messages(doc.get("messages"), limits)
    _supported(doc)
    stream = _typed(doc, "stream", bool, False)
    options = _typed(doc, "stream_options", dict, None)
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    try:
        sampling = read_fields(doc, WIRE_FIELDS)
    except FieldError as exc:
        raise invalid(str(exc), exc.field, "invalid_value") from None
    return ChatRequest(
        model=model, instructions=instructions, messages=messages, stream=stream,
        include_usage=_typed(options or {}, "include_usage", bool, False, "stream_options."),
        max_tokens=_max_tokens(doc, limits), stop=_stop(doc.get("stop"), limits), sampling=sampling)


def _messages(value: Any, limits: Limits) -> tuple[str, tuple[tuple[str, str, bool], ...]]:
    """(instructions, transcript): leading system/developer messages become the system prompt."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array of messages", "messages",
                      "missing_required_parameter" if value is None else "invalid_type")
    system: list[str] = []
    out: list[tuple[str, str, bool]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"{where} must be an object", where, "invalid_type")
        role = ROLES.get(msg.get("role"))
        if role is None:
            raise invalid(f"{where}.role must be one of system, developer, user, assistant; "
                          f"got {msg.get('role')!r}", f"{where}.role", "invalid_value")
        text = _content(msg.get("content"), f"{where}.content")
        if len(text) > limits.max_text_chars:
            raise invalid(f"{where}.content is longer than {limits.max_text_chars} characters",
                          f"{where}.content", "string_above_max_length")
        if role == "system" and not out:
            system.append(text)
        else:
            out.append((role, text, True))
    return "\n\n".join(system), tuple(out)


def _content(value: Any, where: str) -> str:
    """A string, or an array of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"{where}[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                              "this daemon serves text only", f"{where}[{j}]", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{where} must be a string or an array of text parts", where, "invalid_type")


def _supported(doc: dict) -> None:
    """Fields this daemon does not know, and known ones it cannot serve unless at their default: 400."""
    for name in doc:
        if name not in KNOWN_FIELDS:
            raise invalid(f"{name} is not supported by this daemon", name, "unsupported_parameter")
    for name, default in DEFAULTS_ONLY.items():
        value = doc.get(name)
        if value is not None and value != default:
            raise invalid(f"{name}={value!r} is not supported by this daemon", name, "unsupported_value")
    fmt = doc.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("response_format: only {\"type\": \"text\"} is supported", "response_format",
                      "unsupported_value")


def _typed(doc: dict, name: str, kind: type, default: Any, where: str = "") -> Any:
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise invalid(f"{where}{name} must be a {kind.__name__.replace('dict', 'object')}", where + name,
                      "invalid_type")
    return value


def _max_tokens(doc: dict, limits: Limits) -> int | None:
    name = "max_completion_tokens" if doc.get("max_completion_tokens") is not None else "max_tokens"
    value = doc.get(name)
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= limits.max_output_tokens:
        raise invalid(f"{name} must be an integer in [1, {limits.max_output_tokens}], got {value!r}", name,
                      "invalid_value")
    return value


def _stop(value: Any, limits: Limits) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > limits.max_stop_strings:
        raise invalid(f"stop must be a string or an array of at most {limits.max_stop_strings} strings",
                      "stop", "invalid_type")
    for item in items:
        if not isinstance(item, str) or not 1 <= len(item) <= limits.max_stop_chars:
            raise invalid(f"each stop string must have 1 to {limits.max_stop_chars} characters", "stop",
                          "invalid_value")
    return tuple(items)


# -- answers ---------------------------------------------------------------------------------


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def completion_object(cid: str, created: int, model: str, text: str, finish_reason: str,
                      usage: dict[str, Any] | None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`logprobs`: the reply's tokens as `logprobs_content` gives them, when the request asked."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
              "logprobs": _choice_logprobs(logprobs), "finish_reason": finish_reason}
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage, "system_fingerprint": None}


def chunk_object(cid: str, created: int, model: str, delta: dict[str, Any] | None,
                 finish_reason: str | None = None, *, usage: dict[str, Any] | None = None,
                 with_usage: bool = False, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk; `delta=None` is the usage-only chunk (no choices) that ends a stream."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": _choice_logprobs(logprobs),
                                         "finish_reason": finish_reason}]
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = usage
    return chunk


def _choice_logprobs(content: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    return None if content is None else {"content": content, "refusal": None}


def models_object(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "streamchat"}
                     for name in names]}
