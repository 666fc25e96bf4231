"""The OpenAI HTTP API's shapes: chat completion requests in, completions, chunks and errors out.

Owns validating a `POST /v1/chat/completions` body into a `ChatRequest`
(every refusal an `ApiError` naming the field), and building the objects the
API answers with: `chat.completion`, `chat.completion.chunk`, `usage`, the
model list and the error object `{"error": {"message", "type", "param",
"code"}}`. Pure: no I/O, no engine, no sockets; callers pass in every figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from streamchat.model.sampling_params import PENALTY_MAX, REPETITION_PENALTY_MAX
from streamchat.server.protocol import Limits

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields a client may send that change nothing here while they hold their default.
DEFAULTS_ONLY = {"n": 1, "logprobs": False, "tools": [], "functions": [], "tool_choice": "none",
                 "parallel_tool_calls": None}


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
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # extensions, as vLLM and llama.cpp's server take them
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling numbers the request set (SamplingParams names); the rest take the daemon's defaults."""
        names = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "min_p")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


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
    _defaults_only(doc)
    stream = _typed(doc, "stream", bool, False)
    options = _typed(doc, "stream_options", dict, None)
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    return ChatRequest(
        model=model, instructions=instructions, messages=messages, stream=stream,
        include_usage=_typed(options or {}, "include_usage", bool, False, "stream_options."),
        max_tokens=_max_tokens(doc, limits), stop=_stop(doc.get("stop"), limits),
        temperature=_number(doc, "temperature", 0.0, 2.0), top_p=_number(doc, "top_p", 0.0, 1.0, low_open=True),
        seed=_seed(doc.get("seed")),
        frequency_penalty=_number(doc, "frequency_penalty", -PENALTY_MAX, PENALTY_MAX),
        presence_penalty=_number(doc, "presence_penalty", -PENALTY_MAX, PENALTY_MAX),
        top_k=_top_k(doc.get("top_k")),
        repetition_penalty=_number(doc, "repetition_penalty", 0.0, REPETITION_PENALTY_MAX, low_open=True),
        min_p=_number(doc, "min_p", 0.0, 1.0))


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


def _defaults_only(doc: dict) -> None:
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


def _number(doc: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = doc.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise invalid(f"{name} must be a number in {span}, got {value!r}", name, "invalid_value")
    return float(value)


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


def _top_k(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < 2**63:
        raise invalid(f"top_k must be an integer in [0, 2^63-1] (0: no limit), got {value!r}", "top_k",
                      "invalid_value")
    return value


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise invalid(f"seed must be an integer in [-2^63, 2^63-1], got {value!r}", "seed", "invalid_value")
    return value


# -- answers ---------------------------------------------------------------------------------


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def completion_object(cid: str, created: int, model: str, text: str, finish_reason: str,
                      usage: dict[str, Any] | None) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
              "logprobs": None, "finish_reason": finish_reason}
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage, "system_fingerprint": None}


def chunk_object(cid: str, created: int, model: str, delta: dict[str, Any] | None,
                 finish_reason: str | None = None, *, usage: dict[str, Any] | None = None,
                 with_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk; `delta=None` is the usage-only chunk (no choices) that ends a stream."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = usage
    return chunk


def models_object(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "streamchat"}
                     for name in names]}
