"""The OpenAI HTTP API: `GET /v1/models` and `POST /v1/chat/completions` over the engine.

Owns the routes under /v1/ other than the Realtime websocket, the daemon's
rules applied to them (Host and Origin, API key, limits, overload), and one
chat completion as a stateless request: an ephemeral engine session built
from the messages (`Hub.ephemeral`), one response started and read like a
websocket's (`Hub.start_response`), answered whole or as server-sent events,
and the session closed. Nothing is stored: the client holds the
conversation, and the engine's prefix cache serves every full block a
request shares with earlier ones, reported as `cached_tokens`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import orjson

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.engine.events import ResponseFinished, TextDelta
from streamchat.model.sampling_params import resolve_params
from streamchat.server.asgi import BodyTimeout, BodyTooLarge, HttpRequest, Responder, duplicate_header
from streamchat.server.events import logprobs_content, new_id
from streamchat.server.openai_schema import (
    ApiError, ChatRequest, chunk_object, completion_object, invalid, models_object, parse_chat_request,
    usage_object)

if TYPE_CHECKING:
    from streamchat.server.app import Daemon

log = logging.getLogger(__name__)

API_PREFIX = "/v1/"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
JSON = {"Content-Type": "application/json"}
SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# An engine error code -> HTTP status and OpenAI error type
ENGINE_ERRORS = {"overloaded": (503, "server_error"), "engine_unavailable": (503, "server_error"),
                 "engine_restarting": (503, "server_error"),
                 "pending_limit_exceeded": (413, "invalid_request_error"), "internal": (500, "server_error")}


class OpenAIHttp:
    """The HttpApp of the daemon: its rules, then the route."""

    def __init__(self, daemon: Daemon, websocket_path: str) -> None:
        self.daemon = daemon
        self.websocket_path = websocket_path  # under /v1/ too, but the websocket's

    def claims(self, path: str) -> bool:
        return path.startswith(API_PREFIX) and path != self.websocket_path

    async def __call__(self, request: HttpRequest, read_body, out: Responder) -> None:
        try:
            self._admit(request)
            if request.path == MODELS_PATH or request.path.startswith(MODELS_PATH + "/"):
                await self._models(request, out)
            elif request.path == CHAT_PATH:
                _only(request, "POST")
                try:
                    body = await read_body(self.daemon.config.server.max_frame_bytes)
                except BodyTooLarge:
                    raise ApiError(413, f"the request body is over {self.daemon.config.server.max_frame_bytes} "
                                        "bytes", code="request_too_large") from None
                await self._chat(parse_chat_request(body, self.daemon.limits), out)
            else:
                raise ApiError(404, f"Invalid URL ({request.method} {request.path})", code="unknown_url")
        except ApiError as exc:
            await _answer_error(out, exc)
        except (ConnectionError, BodyTimeout):
            raise  # the client left (nobody to answer), or its body is late (the front answers 408)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            await _answer_error(out, ApiError(500, "the server failed on this request", "server_error",
                                              code="internal"))

    def _admit(self, request: HttpRequest) -> None:
        """The websocket's rules: each single header once, Host and Origin, then the API key."""
        d = self.daemon
        duplicate = duplicate_header(request.headers)
        if duplicate is not None:
            raise ApiError(400, f"the {duplicate} header appears more than once", code="duplicate_header")
        refused = d._refuse_foreign(request.headers, request.path, request.port)
        if refused is not None:
            raise ApiError(403, refused.body.decode().strip(), code="forbidden")
        if not d._authorized(request.headers):
            offered = request.headers.get("Authorization", "")
            raise ApiError(401, "Incorrect API key provided." if offered else
                           "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _models(self, request: HttpRequest, out: Responder) -> None:
        _only(request, "GET")
        d = self.daemon
        listing = models_object(d.served_models(), int(d.started_at))
        if request.path == MODELS_PATH:
            return await _answer(out, 200, listing)
        name = request.path[len(MODELS_PATH) + 1:]
        model = next((m for m in listing["data"] if m["id"] == name), None)
        if model is None:
            raise _model_not_found(name)
        await _answer(out, 200, model)

    async def _chat(self, chat: ChatRequest, out: Responder) -> None:
        d = self.daemon
        if not d.serves_model(chat.model):
            raise _model_not_found(chat.model)
        try:
            params = resolve_params(d.hub.model_defaults, {}, chat.sampling).validate(d.hub.vocab_size)
        except ValueError as exc:  # a logit_bias id past the vocabulary
            raise invalid(str(exc), getattr(exc, "field", None), "invalid_value") from None
        if d.over_capacity():
            raise ApiError(503, "overloaded: too many requests; retry later", "server_error", code="overloaded",
                           headers={"Retry-After": "1"})
        max_tokens = chat.max_tokens or d.config.server.max_output_tokens
        try:
            async with d.hub.ephemeral(chat.instructions, chat.messages) as session_id:
                rid = new_id("chatcmpl").replace("_", "-")
                stream = d.hub.engine.open_stream(rid, session_id, tuple(chat.stop or ()))
                try:
                    await d.hub.submit(api.StartResponse(session_id, rid, params, max_tokens))
                except BaseException:
                    d.hub.engine.close_stream(rid)
                    raise
                try:
                    await _Reply(chat, rid, stream, out).run()
                finally:
                    d.hub.engine.close_stream(rid)
        except EngineError as exc:
            raise _engine_error(exc.code, str(exc)) from None


class _Reply:
    """One response's events to the client: a whole completion, or chunks as they come."""

    def __init__(self, chat: ChatRequest, rid: str, stream, out: Responder) -> None:
        self.chat, self.rid, self.stream, self.out = chat, rid, stream, out
        self.created = int(time.time())

    async def run(self) -> None:
        first = await self.stream.get()
        if isinstance(first, ResponseFinished) and first.status == "failed" and not first.text:
            raise _engine_error(first.reason or "internal", f"the response failed ({first.reason})")
        if self.chat.stream:
            await self._stream(first)
        else:
            await self._whole(first)

    async def _next(self):
        """The next event, or None when the client left (the session's close ends the reply)."""
        return None if self.out.gone else await self.stream.get()

    async def _whole(self, out) -> None:
        tokens = []
        while isinstance(out, TextDelta):
            tokens += out.logprobs
            out = await self._next()
        if out is None:
            return
        if out.status == "failed":
            raise _engine_error(out.reason or "internal", f"the response failed ({out.reason})")
        _log(self.rid, out)
        await _answer(self.out, 200, completion_object(self.rid, self.created, self.chat.model, out.text,
                                                       _finish_reason(out), _usage(out), self._logprobs(tokens)))

    async def _stream(self, out) -> None:
        await self.out.start(200, SSE)
        await self._event(self._chunk({"role": "assistant", "content": ""}))
        while isinstance(out, TextDelta):
            await self._event(self._chunk({"content": out.text}, logprobs=self._logprobs(out.logprobs)))
            out = await self._next()
        if out is None:
            return
        _log(self.rid, out)
        if out.status == "failed":
            await self._event(_engine_error(out.reason or "internal", "the response failed").body())
        else:
            await self._event(self._chunk({}, _finish_reason(out)))
            if self.chat.include_usage:
                await self._event(self._chunk(None, usage=_usage(out)))
        await self.out.chunk(b"data: [DONE]\n\n")
        await self.out.end()

    def _chunk(self, delta, finish_reason=None, usage=None, logprobs=None) -> dict:
        return chunk_object(self.rid, self.created, self.chat.model, delta, finish_reason, usage=usage,
                            with_usage=self.chat.include_usage, logprobs=logprobs)

    def _logprobs(self, tokens) -> list[dict] | None:
        """OpenAI's logprobs.content of these tokens when the request asked, else None."""
        return None if self.chat.logprobs is None else logprobs_content(tokens)

    async def _event(self, doc: dict) -> None:
        await self.out.chunk(b"data: " + orjson.dumps(doc) + b"\n\n")


def _finish_reason(out: ResponseFinished) -> str:
    return "length" if out.status == "incomplete" and out.reason == "max_output_tokens" else "stop"


def _usage(out: ResponseFinished) -> dict:
    u = out.usage or api.Usage()
    return usage_object(u.input_tokens, u.output_tokens, u.cached_tokens)


def _log(rid: str, out: ResponseFinished) -> None:
    u = out.usage or api.Usage()
    log.info("chat completion %s %s: %d input (%d cached), %d output tokens, ttft %s ms", rid, out.status,
             u.input_tokens, u.cached_tokens, u.output_tokens, u.ttft_ms)


def _only(request: HttpRequest, method: str) -> None:
    if request.method != method:
        raise ApiError(405, f"{request.path} takes {method}, not {request.method}", code="method_not_allowed",
                       headers={"Allow": method})


def _model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist or you do not have access to it.", param="model",
                    code="model_not_found")


def _engine_error(code: str, message: str) -> ApiError:
    status, kind = ENGINE_ERRORS.get(code, (400, "invalid_request_error"))
    return ApiError(status, message, kind, code=code, headers={"Retry-After": "1"} if status == 503 else None)


async def _answer(out: Responder, status: int, doc: dict, headers: dict | None = None) -> None:
    await out.send(status, orjson.dumps(doc), {**JSON, **(headers or {})})


async def _answer_error(out: Responder, exc: ApiError) -> None:
    if out.started:  # a stream already under way: the error is its last event
        await out.chunk(b"data: " + orjson.dumps(exc.body()) + b"\n\n")
        await out.end()
        return
    await _answer(out, exc.status, exc.body(), exc.headers)
