"""An in-process stand-in for the daemon, speaking PROTOCOL.md's event sequences.

Tests start it on 127.0.0.1, port 0, and script its answers: the reply's
deltas, `overloaded` answers, a dropped connection mid-reply, an API key.
It records every client event and handshake header for assertions.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection, serve


@dataclass
class FakeSession:
    id: str
    token: str
    instructions: str = ""
    items: list = field(default_factory=list)
    context_tokens: int = 0


class FakeDaemon:
    """Serves one websocket endpoint; `url` is valid between start() and stop()."""

    def __init__(self, *, reply: list[str] | None = None, api_key: str | None = None,
                 delta_delay_s: float = 0.0, overloaded_responses: int = 0,
                 overloaded_connects: int = 0, drop_after_deltas: int | None = None,
                 drop_at_append: int | None = None, http_503_connects: int = 0,
                 max_text_chars: int | None = None) -> None:
        self.reply = reply if reply is not None else ["Hel", "lo", ", wor", "ld"]
        self.api_key = api_key
        self.delta_delay_s = delta_delay_s
        self.overloaded_responses = overloaded_responses
        self.overloaded_connects = overloaded_connects
        self.drop_after_deltas = drop_after_deltas  # once, then cleared
        self.drop_at_append = drop_at_append  # close instead of acking the n-th append (1-based), once
        self.appends = 0
        self.http_503_connects = http_503_connects
        self.max_text_chars = max_text_chars  # a longer append gets message_too_large
        self.received: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.paths: list[str] = []  # each handshake's request path, query included
        self.sessions: dict[str, FakeSession] = {}
        self.connections = 0
        self._ids = itertools.count(1)
        self._session_ids = itertools.count(1)
        self._server = None
        self.url = ""

    async def start(self) -> str:
        self._server = await serve(self._handle, "127.0.0.1", 0, process_request=self._check_auth)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/v1/realtime"
        return self.url

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def __aenter__(self) -> "FakeDaemon":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def types(self) -> list[str]:
        """The types of the client events received, in order."""
        return [event["type"] for event in self.received]

    def add_session(self, session_id: str, token: str, instructions: str = "") -> FakeSession:
        session = FakeSession(session_id, token, instructions)
        self.sessions[session_id] = session
        return session

    def _check_auth(self, connection: ServerConnection, request):
        header = request.headers.get("Authorization")
        self.auth_headers.append(header)
        self.paths.append(request.path)
        if self.api_key and header != f"Bearer {self.api_key}":
            return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
        if self.http_503_connects > 0:
            self.http_503_connects -= 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "busy\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        if self.overloaded_connects > 0:
            self.overloaded_connects -= 1
            await self._send(ws, "error", error=_error("overloaded", "no capacity"))
            return
        n = next(self._session_ids)
        state = {"session": FakeSession(f"sess_{n}", f"tok_{n}"), "cancel": None, "task": None}
        await self._send(ws, "session.created", session={**_session(state["session"]),
                                                         "resume_token": f"tok_{n}"})
        async for frame in ws:
            event = json.loads(frame)
            self.received.append(event)
            await self._on_event(ws, state, event)
        if state["task"] is not None:
            await asyncio.gather(state["task"], return_exceptions=True)

    async def _on_event(self, ws: ServerConnection, state: dict, event: dict) -> None:
        kind, session, eid = event["type"], state["session"], event.get("event_id")
        if kind == "streamchat.session.resume":
            found = self.sessions.get(event["session_id"])
            if found is None or found.token != event["resume_token"]:
                await self._send(ws, "error", error=_error("session_not_found", "no such session", eid))
                return
            state["session"] = found
            await self._send(ws, "streamchat.session.resumed", session=_session(found),
                             restored_from="memory")
        elif kind == "session.update":
            session.instructions = event["session"].get("instructions", session.instructions)
            self.sessions.setdefault(session.id, session)
            await self._send(ws, "session.updated", session=_session(session))
        elif kind == "conversation.item.create":
            self.sessions.setdefault(session.id, session).items.append(event["item"])
            item = {"id": f"item_{len(session.items)}", **event["item"]}
            await self._send(ws, "conversation.item.added", item=item)
            await self._send(ws, "conversation.item.done", item=item)
        elif kind == "streamchat.input_text.append":
            self.appends += 1
            if self.appends == self.drop_at_append:
                self.drop_at_append = None
                await ws.close(1011, "simulated crash")
                return
            if self.max_text_chars is not None and len(event["text"]) > self.max_text_chars:
                await self._send(ws, "error", error=_error("message_too_large", "text too long", eid))
                return
            self.sessions.setdefault(session.id, session)
            tokens = len(event["text"].split())
            session.context_tokens += tokens
            await self._send(ws, "streamchat.input_text.appended", tokens=tokens,
                             context_tokens=session.context_tokens)
        elif kind == "streamchat.input_text.commit":
            await self._send(ws, "conversation.item.done", item={"id": "item_feed"})
        elif kind == "streamchat.session.stats":
            await self._send(ws, "streamchat.session.stats", context_tokens=session.context_tokens,
                             total_tokens=session.context_tokens + 100, evicted_tokens=100,
                             blocks={"owned": 7, "shared": 2}, kv_bytes=3 * 2**20,
                             items=len(session.items))
        else:
            await self._on_response_event(ws, state, event)

    async def _on_response_event(self, ws: ServerConnection, state: dict, event: dict) -> None:
        kind, eid = event["type"], event.get("event_id")
        if kind == "response.create":
            if self.overloaded_responses > 0:
                self.overloaded_responses -= 1
                await self._send(ws, "error", error=_error("overloaded", "no capacity", eid))
                return
            state["cancel"] = asyncio.Event()
            state["task"] = asyncio.ensure_future(self._respond(ws, state["cancel"]))
        elif kind == "response.cancel":
            if state["cancel"] is None or state["task"].done():
                await self._send(ws, "error", error=_error("response_cancel_not_active", "", eid))
            else:
                state["cancel"].set()

    async def _respond(self, ws: ServerConnection, cancel: asyncio.Event) -> None:
        rid = f"resp_{next(self._ids)}"
        await self._send(ws, "response.created", response={"id": rid, "status": "in_progress"})
        for kind in ("response.output_item.added", "conversation.item.added",
                     "response.content_part.added"):
            await self._send(ws, kind, response_id=rid)
        sent: list[str] = []
        for delta in self.reply:
            if cancel.is_set():
                break
            if self.drop_after_deltas is not None and len(sent) == self.drop_after_deltas:
                self.drop_after_deltas = None
                await ws.close(1011, "simulated crash")
                return
            await self._send(ws, "response.output_text.delta", response_id=rid, delta=delta)
            sent.append(delta)
            if self.delta_delay_s:
                try:
                    await asyncio.wait_for(cancel.wait(), self.delta_delay_s)
                except asyncio.TimeoutError:
                    pass
        status = "cancelled" if cancel.is_set() else "completed"
        for kind in ("response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "conversation.item.done"):
            await self._send(ws, kind, response_id=rid, text="".join(sent))
        details = {"reason": "client_cancelled"} if cancel.is_set() else None
        await self._send(ws, "response.done", response={
            "id": rid, "status": status, "status_details": details,
            "usage": {"input_tokens": 50, "output_tokens": len(sent), "total_tokens": 50 + len(sent),
                      "input_token_details": {"cached_tokens": 32},
                      "context_tokens": 60, "evicted_tokens": 0,
                      "timing": {"ttft_ms": 12.0, "output_tokens_per_s": 40.0}}})

    async def _send(self, ws: ServerConnection, kind: str, **fields: object) -> None:
        await ws.send(json.dumps({"type": kind, "event_id": f"evt_{next(self._ids)}", **fields}))


def _session(session: FakeSession) -> dict:
    return {"type": "realtime", "object": "realtime.session", "id": session.id,
            "model": "fake-model", "instructions": session.instructions,
            "output_modalities": ["text"], "max_output_tokens": "inf",
            "truncation": {"type": "streamchat.sink_window", "sink_tokens": 4,
                           "window_tokens": 2048, "block_size": 16}}


def _error(code: str, message: str, event_id: str | None = None) -> dict:
    error = {"type": "invalid_request_error", "code": code, "message": message}
    if event_id:
        error["event_id"] = event_id
    return error


class ThreadedDaemon:
    """A FakeDaemon on its own event loop thread, for tests that drive a subprocess."""

    def __init__(self, **kwargs: object) -> None:
        self.daemon = FakeDaemon(**kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> FakeDaemon:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.daemon.start(), self._loop).result(5)
        return self.daemon

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self.daemon.stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
