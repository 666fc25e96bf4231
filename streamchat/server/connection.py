"""One websocket connection: reads client events, answers them, streams responses.

The reader always drains (a cancel or a feed append is never stuck behind a
generation); every response streams in its own task; all sends go through
the connection's Outbox. Durability: each item, append and response is
committed to the store before the event that acknowledges it is sent.
"""

from __future__ import annotations

import asyncio
import logging

from websockets.exceptions import ConnectionClosed

from streamchat.engine.engine import EngineError
from streamchat.engine.events import ResponseFinished, TextDelta
from streamchat.model.sampling import SamplingParams
from streamchat.server import events as ev
from streamchat.server import protocol as p
from streamchat.server.outbox import Outbox, SlowClient
from streamchat.server.sessions import Hub, LiveSession, SessionNotFound

log = logging.getLogger(__name__)


class Connection:
    def __init__(self, hub: Hub, websocket, limits: p.Limits, server_cfg, metrics) -> None:
        self.hub = hub
        self.ws = websocket
        self.limits = limits
        self.cfg = server_cfg
        self.metrics = metrics
        self.outbox = Outbox(server_cfg.send_queue_events)
        self.session: LiveSession | None = None
        self.tasks: set[asyncio.Task] = set()
        self.num_sessions = 0
        self.engine = hub.engine

    async def run(self) -> None:
        writer = asyncio.create_task(self.outbox.run(self.ws))
        try:
            self.session = await self.hub.create()
            self._attach(self.session)
            self.send(ev.session_created(self.hub.describe(self.session, with_token=True)))
            await self._read()
        finally:
            await self._cleanup(writer)

    def send(self, event: dict) -> None:
        try:
            self.outbox.put(event)
        except SlowClient as exc:
            log.warning("closing a slow client: %s", exc)
            asyncio.get_running_loop().create_task(self.ws.close(1008, "client too slow"))

    def error(self, code: str, message: str, event_id: str | None = None) -> None:
        self.metrics.errors(code)
        self.send(ev.error(code, message, event_id))

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                try:
                    event = p.parse_client_event(frame, limits=self.limits)
                except p.ProtocolError as exc:
                    self.error(exc.code, exc.message, exc.event_id)
                    continue
                await self._handle(event)
        except ConnectionClosed:
            pass

    async def _handle(self, event) -> None:
        handler = getattr(self, "on_" + type(event).__name__)
        try:
            async with self.session.lock:
                await handler(event)
        except EngineError as exc:
            self.error(exc.code, str(exc), event.event_id)
        except SessionNotFound:
            self.error("session_not_found", "no session with that id and token", event.event_id)
        except Exception:
            log.exception("failed handling %s", type(event).__name__)
            self.error("internal", "the server failed on this event; nothing was lost", event.event_id)

    def _attach(self, s: LiveSession) -> None:
        s.attached += 1
        self.num_sessions += 1

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- events -----------------------------------------------------------------

    async def on_SessionUpdate(self, e: p.SessionUpdate) -> None:
        if self.session.response_id is not None and e.instructions is not None:
            raise EngineError("conversation_already_has_active_response",
                              "instructions cannot change while a response runs")
        await self.hub.update(self.session, e.instructions, e.max_output_tokens)
        self.send(ev.session_updated(self.hub.describe(self.session)))

    async def on_SessionResume(self, e: p.SessionResume) -> None:
        if self.session.response_id is not None and self.session.response_owner is self:
            raise EngineError("conversation_already_has_active_response",
                              "cannot switch sessions while a response runs")
        if self.num_sessions >= self.cfg.max_sessions_per_connection:
            raise EngineError("invalid_event", "too many sessions on this connection")
        target, restored_from = await self.hub.resume(e.session_id, e.resume_token)
        old = self.session
        self.session = target
        self._attach(target)
        if old is not target:
            await self.hub.detach(old)
        self.send(ev.session_resumed(self.hub.describe(target), restored_from))
        self.metrics.resumed(restored_from)

    async def on_ItemCreate(self, e: p.ItemCreate) -> None:
        s = self.session
        await self._close_open_item(s)
        item_id = e.item_id or ev.new_id("item")
        await self.hub.ensure_stored(s)
        ticket = asyncio.get_running_loop().create_future()
        num = await self.engine.call(self.engine.engine.add_item, s.id, e.role, e.text, ticket)
        await self.hub.store.add_item(s.id, item_id, e.role, "message", e.text, "completed", num)
        item = ev.item_object(item_id, e.role, e.text)
        previous, s.last_item_id = s.last_item_id, item_id
        self.send(ev.item_added(item, previous))
        self._spawn(self._item_done_when_cached(ticket, item, previous))

    async def _item_done_when_cached(self, ticket: asyncio.Future, item: dict, previous) -> None:
        await ticket
        self.send(ev.item_done(item, previous))

    async def on_InputTextAppend(self, e: p.InputTextAppend) -> None:
        s = self.session
        await self.hub.ensure_stored(s)
        eng = self.engine.engine
        num, context = await self.engine.call(
            lambda: (eng.append_text(s.id, e.text), eng.context_tokens(s.id)))
        if s.open_item_id is None:
            s.open_item_id = ev.new_id("item")
            await self.hub.store.add_item(s.id, s.open_item_id, "user", "append", e.text, "in_progress", num)
            previous, s.last_item_id = s.last_item_id, s.open_item_id
            self.send(ev.item_added(ev.item_object(s.open_item_id, "user", None, status="in_progress"), previous))
        else:
            await self.hub.store.append_text(s.id, s.open_item_id, e.text, num)
        self.send({**ev.input_text_appended(s.open_item_id, num, context)})

    async def on_InputTextCommit(self, e: p.InputTextCommit) -> None:
        s = self.session
        if s.open_item_id is None:
            raise EngineError("invalid_event", "no open input_text item to commit")
        item_id = s.open_item_id
        ticket = await self._close_open_item(s)
        records = await self.hub.store.items(s.id)
        text = next((r.text for r in reversed(records) if r.item_id == item_id), "")
        self._spawn(self._item_done_when_cached(ticket, ev.item_object(item_id, "user", text), None))

    async def _close_open_item(self, s: LiveSession) -> asyncio.Future | None:
        if s.open_item_id is None:
            return None
        ticket = asyncio.get_running_loop().create_future()
        await self.engine.call(self.engine.engine.commit_text, s.id, ticket)
        await self.hub.store.finish_item(s.id, s.open_item_id, status="completed")
        s.open_item_id = None
        return ticket

    async def on_ResponseCreate(self, e: p.ResponseCreate) -> None:
        s = self.session
        if s.response_id is not None:
            raise EngineError("conversation_already_has_active_response",
                              "a response is already running in this session")
        await self._close_open_item(s)
        await self.hub.ensure_stored(s)
        max_tokens = e.max_output_tokens if e.max_output_tokens is not None else s.max_output_tokens
        limit = self.cfg.max_output_tokens if max_tokens == "inf" else min(max_tokens, self.cfg.max_output_tokens)
        params = SamplingParams(e.temperature or 0.0, e.top_p or 1.0, e.top_k or 0, e.seed)
        try:
            params.validate()
        except ValueError as exc:
            raise EngineError("invalid_event", str(exc)) from None
        rid, item_id = ev.new_id("resp"), ev.new_id("item")
        await self.hub.store.add_item(s.id, item_id, "assistant", "response", "", "in_progress", 0)
        stream = self.engine.open_stream(rid)
        try:
            await self.engine.call(self.engine.engine.start_response, s.id, rid, params, limit,
                                   e.stop or (), e.instructions)
        except BaseException:
            self.engine.close_stream(rid)
            await self.hub.store.finish_item(s.id, item_id, status="failed")
            raise
        s.response_id, s.response_owner = rid, self
        previous, s.last_item_id = s.last_item_id, item_id
        response = ev.response_object(rid, "in_progress", max_output_tokens=max_tokens)
        item = ev.item_object(item_id, "assistant", None, status="in_progress")
        for event in ev.response_start_events(response, item, previous):
            self.send(event)
        self._spawn(self._stream(s, rid, item_id, stream, max_tokens, previous))

    async def _stream(self, s: LiveSession, rid: str, item_id: str, stream: asyncio.Queue,
                      max_tokens, previous) -> None:
        try:
            while True:
                out = await stream.get()
                if isinstance(out, TextDelta):
                    self.send(ev.output_text_delta(rid, item_id, out.text))
                elif isinstance(out, ResponseFinished):
                    await self._finish(s, rid, item_id, out, max_tokens, previous)
                    return
        finally:
            self.engine.close_stream(rid)
            if s.response_id == rid:
                s.response_id = s.response_owner = None

    async def _finish(self, s, rid, item_id, out: ResponseFinished, max_tokens, previous) -> None:
        item_status = "completed" if out.status == "completed" else "incomplete"
        # cut short by a cancel, a disconnect or shutdown: stored as far as it went, incomplete
        store_status = out.status if out.status in ("completed", "failed") else "incomplete"
        await self.hub.store.finish_item(s.id, item_id, text=out.text, status=store_status,
                                         num_tokens=out.usage.get("output_tokens", 0))
        s.response_id = s.response_owner = None
        item = ev.item_object(item_id, "assistant", out.text, status=item_status)
        error = None
        if out.status == "failed":
            error = {"type": "server_error", "code": out.reason or "internal",
                     "message": "no capacity to start this response; retry later"
                     if out.reason == "overloaded" else "the response failed"}
            self.error(error["code"], error["message"])
        usage = _usage(out.usage) if out.usage else None
        response = ev.response_object(rid, out.status, output=[item], usage=usage,
                                      max_output_tokens=max_tokens,
                                      reason=out.reason if out.status in ("cancelled", "incomplete") else None,
                                      error=error)
        for event in ev.response_end_events(response, item, previous):
            self.send(event)
        self.metrics.response_done(out.status)
        log.info("response %s %s: %s tokens", rid, out.status, out.usage.get("output_tokens") if out.usage else 0)

    async def on_ResponseCancel(self, e: p.ResponseCancel) -> None:
        s = self.session
        if s.response_id is None or (e.response_id and e.response_id != s.response_id):
            raise EngineError("response_cancel_not_active", "no response is running")
        await self.engine.call(self.engine.engine.cancel_response, s.id)

    async def on_SessionStats(self, e: p.SessionStats) -> None:
        stats = await self.engine.call(self.engine.engine.session_stats, self.session.id)
        self.send(ev.session_stats(stats))

    # -- teardown ---------------------------------------------------------------

    async def _cleanup(self, writer: asyncio.Task) -> None:
        s = self.session
        if s is not None:
            if s.response_id is not None and s.response_owner is self:
                await self._cancel_quietly(s)
            await self.hub.detach(s)
        for task in list(self.tasks):
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
        self.outbox.close()
        await asyncio.gather(writer, return_exceptions=True)

    async def _cancel_quietly(self, s: LiveSession) -> None:
        try:
            await self.engine.call(self.engine.engine.cancel_response, s.id)
        except Exception:
            log.exception("could not stop the response of %s", s.id)


def _usage(u: dict) -> dict:
    timing = u.get("timing", {})
    return ev.usage_object(
        input_tokens=u["input_tokens"], output_tokens=u["output_tokens"],
        cached_tokens=u["input_token_details"]["cached_tokens"], context_tokens=u["context_tokens"],
        evicted_tokens=u["evicted_tokens"], ttft_ms=timing.get("ttft_ms"),
        output_tokens_per_s=timing.get("output_tokens_per_s"))
