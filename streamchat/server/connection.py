"""One websocket connection: reads client events, answers them, streams responses.

The reader always drains (a cancel or a feed append is never stuck behind a
generation); every response streams in its own task; all sends go through
the connection's Outbox. Speaks to the engine only in `engine.api` commands,
through the Hub.

Durable before visible: each item, append and response is committed to the
store before the engine queues it or the client hears of it. A store
failure answers `store_unavailable` (or `item_id_in_use`) and changes
nothing else; a response always ends with `response.done`, `failed` with
its reason if storing it failed.
"""

from __future__ import annotations

import asyncio
import logging

from websockets.exceptions import ConnectionClosed

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.engine.events import ResponseFinished, TextDelta
from streamchat.server import events as ev
from streamchat.server import protocol as p
from streamchat.server.fleet import SessionLeased
from streamchat.server.outbox import Outbox, SlowClient
from streamchat.server.sessions import Hub, LiveSession, SessionNotFound
from streamchat.server.streamed import StreamedText
from streamchat.store import StoreError
from streamchat.store.errors import LEASE_LOST

log = logging.getLogger(__name__)

ORPHAN_WAIT_S = 10.0  # response.create waits this long for the reply of a client that left to wind down

FAILURE_MESSAGES = {
    "overloaded": "no capacity to start this response; retry later",
    "store_unavailable": "the reply could not be stored; it is lost",
    "engine_unavailable": "the engine stopped; reconnect and resume the session",
    "engine_restarting": "the engine restarted mid-reply; the session is intact: ask again",
    "lease_lost": "another daemon took this session over; reconnect with ?session_id= and resume it there",
}


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
        self.closing = False  # the client has gone: what it started is being wound down
        self.submit = hub.submit
        # the session the URL names (?session_id=, checked at the handshake): a resume must name it too
        self.url_session = p.url_session_id(getattr(websocket, "query_string", ""), limits)

    async def run(self) -> None:
        writer = self.writer = asyncio.create_task(self.outbox.run(self.ws))
        try:
            try:
                self.session = await self.hub.create()
            except EngineError as exc:  # the engine is restarting (or stopped): try again later
                await self.ws.close(1013, f"{exc.code}: retry")
                return
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
        except (EngineError, StoreError) as exc:
            self.error(exc.code, str(exc), event.event_id)
        except SessionNotFound:
            self.error("session_not_found", "no session with that id and token", event.event_id)
        except SessionLeased as exc:
            self.error(exc.code, str(exc), event.event_id)
        except Exception:
            log.exception("failed handling %s", type(event).__name__)
            self.error("internal", "the server failed on this event; nothing acknowledged was lost",
                       event.event_id)

    def _attach(self, s: LiveSession) -> None:
        s.attached += 1
        self.num_sessions += 1

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- events -----------------------------------------------------------------------

    async def on_SessionUpdate(self, e: p.SessionUpdate) -> None:
        if self.session.response_id is not None and e.instructions is not None:
            raise EngineError("conversation_already_has_active_response",
                              "instructions cannot change while a response runs")
        await self.hub.update(self.session, e.instructions, e.max_output_tokens, e.sampling())
        self.send(ev.session_updated(self.hub.describe(self.session)))

    async def on_SessionResume(self, e: p.SessionResume) -> None:
        if self.session.response_id is not None and self.session.response_owner is self:
            raise EngineError("conversation_already_has_active_response",
                              "cannot switch sessions while a response runs")
        if self.num_sessions >= self.cfg.max_sessions_per_connection:
            raise EngineError("invalid_event", "too many sessions on this connection")
        if self.url_session is not None and e.session_id != self.url_session:
            raise EngineError("invalid_event", f"session_id {e.session_id!r} is not the session the URL names "
                                               f"({self.url_session!r})")
        target, restored_from = await self.hub.restore.resume(e.session_id, e.resume_token)
        old = self.session
        if old is not target:  # resuming the session it already holds attaches nothing more
            self.session = target
            self._attach(target)
            await self.hub.detach(old)
        self.send(ev.session_resumed(self.hub.describe(target), restored_from))
        self.metrics.resumed(restored_from)

    async def on_ItemCreate(self, e: p.ItemCreate) -> None:
        s = self.session
        await self._close_open_item(s)
        tokens = await self.hub.item_tokens(s, e.role, e.text)
        await self.hub.check_room(s, len(tokens))
        item_id = e.item_id or ev.new_id("item")
        await self.hub.ensure_stored(s)
        await self.hub.store.add_item(s.id, item_id, e.role, "message", e.text, "completed", len(tokens))
        _, ticket = await self.hub.queue(s, tokens, "item", want_ticket=True)
        item = ev.item_object(item_id, e.role, e.text)
        previous, s.last_item_id = s.last_item_id, item_id
        self.send(ev.item_added(item, previous))
        self._spawn(self._item_done_when_cached(ticket, item, previous))

    async def _item_done_when_cached(self, ticket: asyncio.Future, item: dict, previous) -> None:
        try:
            await ticket
        except EngineError as exc:  # the engine restarted first: the item is stored, and comes back with it
            self.error(exc.code, f"item {item['id']} is stored but the engine restarted before it entered "
                                 "the cache; it joins the context when the session comes back")
            return
        self.send(ev.item_done(item, previous))

    async def on_InputTextAppend(self, e: p.InputTextAppend) -> None:
        s = self.session
        if s.open_item_chars + len(e.text) > self.cfg.max_append_item_chars:
            raise EngineError("message_too_large",
                              f"the open item would hold more than {self.cfg.max_append_item_chars} characters; "
                              "commit it and start another")
        opens = s.open_item_id is None
        tokens = await self.hub.append_tokens(s, e.text, opens)
        await self.hub.check_room(s, len(tokens))
        await self.hub.ensure_stored(s)
        num = len(tokens)
        item_id = s.open_item_id or ev.new_id("item")
        if opens:
            await self.hub.store.add_item(s.id, item_id, "user", "append", e.text, "in_progress", num)
            s.open_item_id, s.open_item_chars = item_id, 0  # stored: a rebuild must see it open
        else:
            await self.hub.store.append_text(s.id, item_id, e.text, num)
        s.open_item_chars += len(e.text)
        context, _ = await self.hub.queue(s, tokens, "append", opens=opens)
        if opens:
            previous, s.last_item_id = s.last_item_id, item_id
            self.send(ev.item_added(ev.item_object(item_id, "user", None, status="in_progress"), previous))
        self.send(ev.input_text_appended(item_id, num, context))

    async def on_InputTextCommit(self, e: p.InputTextCommit) -> None:
        if self.session.open_item_id is None:
            raise EngineError("invalid_event", "no open input_text item to commit")
        await self._close_open_item(self.session)

    async def _close_open_item(self, s: LiveSession) -> None:
        """Close the open append item (stored first), then tell the engine; its item.done follows."""
        if s.open_item_id is None:
            return
        # into the running core before the store changes: brought back after, it would find the item
        # closed already and refuse the commit (as check_room does for items and appends)
        await self.hub.restore.ensure(s)
        item_id = s.open_item_id
        await self.hub.store.finish_item(s.id, item_id, status="completed")
        s.open_item_id, s.open_item_chars = None, 0
        _, ticket = await self.hub.queue(s, tuple(self.hub.chat.close_message("user")), "commit", want_ticket=True)
        records = await self.hub.store.items(s.id)
        text = next((r.text for r in reversed(records) if r.item_id == item_id), "")
        self._spawn(self._item_done_when_cached(ticket, ev.item_object(item_id, "user", text), None))

    async def on_ResponseCreate(self, e: p.ResponseCreate) -> None:
        s = self.session
        if s.response_id is not None and getattr(s.response_owner, "closing", False):
            try:  # a reply whose client left is being cancelled and stored: it ends in moments
                await asyncio.wait_for(s.response_over.wait(), ORPHAN_WAIT_S)
            except asyncio.TimeoutError:
                pass
        if s.response_id is not None:
            raise EngineError("conversation_already_has_active_response",
                              "a response is already running in this session")
        params = self.hub.response_params(s, e.sampling())
        await self._close_open_item(s)
        await self.hub.ensure_stored(s)
        max_tokens = e.max_output_tokens if e.max_output_tokens is not None else s.max_output_tokens
        limit = self.cfg.max_output_tokens if max_tokens == "inf" else min(max_tokens, self.cfg.max_output_tokens)
        rid, item_id = ev.new_id("resp"), ev.new_id("item")
        await self.hub.store.add_item(s.id, item_id, "assistant", "response", "", "in_progress", 0)
        try:
            turn, close = await self.hub.turn_tokens(s, e.instructions)
            stream = await self.hub.start_response(
                s, api.StartResponse(s.id, rid, params, limit, turn, close), tuple(e.stop or ()))
        except BaseException:
            await self._forget_item(s, item_id)
            raise
        s.running(rid, self)
        previous, s.last_item_id = s.last_item_id, item_id
        response = ev.response_object(rid, "in_progress", max_output_tokens=max_tokens)
        item = ev.item_object(item_id, "assistant", None, status="in_progress")
        for event in ev.response_start_events(response, item, previous):
            self.send(event)
        self._spawn(self._stream(s, rid, item_id, stream, max_tokens, previous, params.logprobs is not None))

    async def _forget_item(self, s: LiveSession, item_id: str) -> None:
        try:
            await self.hub.store.finish_item(s.id, item_id, status="failed")
        except StoreError:
            log.warning("session %s: response item %s stays in_progress in the store; "
                        "a resume stores it incomplete", s.id, item_id)

    async def _stream(self, s: LiveSession, rid: str, item_id: str, stream: asyncio.Queue,
                      max_tokens, previous, logprobs: bool) -> None:
        saved = StreamedText(self.hub.store, s.id, item_id)  # what the client saw is stored as it streams
        try:
            while True:
                out = await stream.get()
                if isinstance(out, TextDelta):
                    entries = ev.logprobs_content(out.logprobs) if logprobs else None
                    self.send(ev.output_text_delta(rid, item_id, out.text, logprobs=entries))
                    saved.add(out.text)
                elif isinstance(out, ResponseFinished):
                    await self._finish(s, rid, item_id, out, max_tokens, previous, saved)
                    return
        finally:
            saved.discard()
            self.hub.engine.close_stream(rid)
            if s.response_id == rid:
                s.ended()

    async def _finish(self, s, rid, item_id, out: ResponseFinished, max_tokens, previous,
                      saved: StreamedText) -> None:
        status, reason = out.status, out.reason
        # cut short by a cancel, a disconnect or shutdown: stored as far as it went, incomplete
        store_status = status if status in ("completed", "failed") else "incomplete"
        try:
            tail = await saved.close()
            whole = saved.failed or saved.text != out.text  # else the row holds all but the tail
            if tail and not whole:
                await self.hub.store.append_text(s.id, item_id, tail, 0)
            await self.hub.store.finish_item(s.id, item_id, text=out.text if whole else None, status=store_status,
                                             num_tokens=out.usage.output_tokens if out.usage else 0)
        except StoreError as exc:
            log.error("session %s: response %s could not be stored: %s", s.id, rid, exc)
            status, reason = "failed", exc.code
            if exc.code != LEASE_LOST:  # (a lost session is dropped here: its new holder has the transcript)
                await self.hub.restore.rebuild(s)  # the engine heard a reply the transcript lacks
        s.ended()
        item_status = "completed" if status == "completed" else "incomplete"
        item = ev.item_object(item_id, "assistant", out.text, status=item_status)
        error = None
        if status == "failed":
            code = reason or "internal"
            error = {"type": "server_error", "code": code,
                     "message": FAILURE_MESSAGES.get(code, "the response failed")}
            self.error(error["code"], error["message"])
        usage = _usage(out.usage) if out.usage else None
        response = ev.response_object(rid, status, output=[item], usage=usage, max_output_tokens=max_tokens,
                                      reason=reason if status in ("cancelled", "incomplete") else None,
                                      error=error)
        for event in ev.response_end_events(response, item, previous):
            self.send(event)
        self.metrics.response_done(status)
        _log_response(s.id, rid, status, reason, out.usage)

    async def on_ResponseCancel(self, e: p.ResponseCancel) -> None:
        s = self.session
        if s.response_id is None or (e.response_id and e.response_id != s.response_id):
            raise EngineError("response_cancel_not_active", "no response is running")
        await self.hub.call(s, api.CancelResponse(s.id))

    async def on_SessionStats(self, e: p.SessionStats) -> None:
        stats = await self.hub.call(self.session, api.GetStats(self.session.id))
        self.send(ev.session_stats(_stats(stats)))

    # -- teardown -------------------------------------------------------------------------

    async def _cleanup(self, writer: asyncio.Task) -> None:
        self.closing = True
        s = self.session
        if s is not None:
            if s.response_id is not None and s.response_owner is self:
                await self.cancel_quietly(s)
            await self.hub.detach(s)
        for task in list(self.tasks):
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
        self.outbox.close()
        await asyncio.gather(writer, return_exceptions=True)

    async def lose_session(self, message: str) -> None:
        """Another daemon took this connection's session over: say so, then close (the client resumes there)."""
        self.error(LEASE_LOST, message)
        self.outbox.close()  # the writer sends what is queued, this error last, then ends
        await asyncio.wait([self.writer], timeout=2.0)
        await self.ws.close(1013, "session moved to another daemon: reconnect and resume")

    async def cancel_quietly(self, s: LiveSession | None = None) -> None:
        s = s or self.session
        if s is None or s.response_id is None or s.epoch != self.hub.engine.epoch:
            return
        try:
            await self.submit(api.CancelResponse(s.id), timeout_s=5.0)
        except Exception:
            log.exception("could not stop the response of %s", s.id)


def _log_response(session_id: str, rid: str, status: str, reason: str | None, u: api.Usage | None) -> None:
    """One INFO line per finished response; its figures are also fields of the record (--log-format json)."""
    fields = {"session_id": session_id, "response_id": rid, "status": status, "reason": reason,
              "input_tokens": u.input_tokens if u else 0, "cached_tokens": u.cached_tokens if u else 0,
              "output_tokens": u.output_tokens if u else 0, "ttft_ms": u.ttft_ms if u else None,
              "tokens_per_s": u.output_tokens_per_s if u else None}
    log.info("response %s %s%s: session %s, %d input (%d cached), %d output tokens, ttft %s ms, %s tok/s",
             rid, status, f" ({reason})" if reason else "", session_id, fields["input_tokens"],
             fields["cached_tokens"], fields["output_tokens"], fields["ttft_ms"], fields["tokens_per_s"],
             extra=fields)


def _usage(u: api.Usage) -> dict:
    return ev.usage_object(
        input_tokens=u.input_tokens, output_tokens=u.output_tokens, cached_tokens=u.cached_tokens,
        context_tokens=u.context_tokens, evicted_tokens=u.evicted_tokens, ttft_ms=u.ttft_ms,
        output_tokens_per_s=u.output_tokens_per_s)


def _stats(st: api.SessionStats) -> dict:
    """`streamchat.session.stats` as the wire has it (docs/protocol.md)."""
    return {
        "context_tokens": st.context_tokens, "total_tokens": st.total_tokens,
        "evicted_tokens": st.evicted_tokens, "eviction": st.eviction, "cached_tokens": st.cached_tokens,
        "blocks": {"owned": st.owned_blocks, "shared": st.shared_blocks,
                   "pool_cached_free": st.pool_cached_free, "pool_free": st.pool_free},
        "prefix": {"queried_tokens": st.prefix_queried_tokens, "hit_tokens": st.prefix_hit_tokens},
        "kv_bytes": st.kv_bytes, "items": st.items, "queued_tokens": st.queued_tokens,
        "resident": st.residency == "device", "tier": st.residency, "on_disk": st.on_disk,
    }
