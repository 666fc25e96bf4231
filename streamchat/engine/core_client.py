"""The front's face of the engine core: commands and their answers, response streams, tickets.

Owns the front's half of the crossing: a future per command (answered once,
by the core), the per-response streams (token ids from the core become text
here, `engine.outputs`; a met stop string is sent back as `StopResponse`),
the tickets of queued work, the latest `EngineSnapshot`, and metric samples.
Its supervisor half (`engine.supervisor`) starts the core, watches it and
restarts it; when a core dies, every command, ticket and response in flight
fails (`engine_restarting`). Runs on the event loop; imports no torch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from streamchat.engine import api, wire
from streamchat.engine.api import EngineError
from streamchat.engine.events import ResponseFinished
from streamchat.engine.outputs import OutputProcessor
from streamchat.engine.supervisor import CoreSupervisor, Supervision

log = logging.getLogger(__name__)

__all__ = ["CoreClient", "Supervision"]


class CoreClient(CoreSupervisor):
    def __init__(self, config, call_timeout_s: float = 30.0, supervision: Supervision = Supervision(),
                 log_level: str = "INFO", log_format: str = "text", engine=None) -> None:
        super().__init__(config, supervision, log_level, log_format, engine)
        self.call_timeout_s = call_timeout_s
        self.tokenizer = None  # the front's (FrontTokenizer), from the first core's ready
        self.outputs: OutputProcessor | None = None
        self._observers: list[Callable[[str, float], None]] = []
        self._ids = itertools.count(1)
        self._calls: dict[int, tuple[asyncio.Future, type]] = {}
        self._tickets: dict[int, asyncio.Future] = {}
        self._streams: dict[str, tuple[asyncio.Queue, str]] = {}  # response id -> (events, session id)

    def on_ready(self, info: wire.CoreInfo) -> None:
        if self.tokenizer is None:
            from streamchat.text.tokenizer import FrontTokenizer

            self.tokenizer = FrontTokenizer(info.tokenizer_json, info.frames)
            self.outputs = OutputProcessor(self.tokenizer)

    # -- commands -----------------------------------------------------------------------

    async def submit(self, cmd: api.Command, timeout_s: float | None = None):
        """Run one command in the core; its result, or its EngineError.

        Waits for a restarting core within the deadline; a command the core does not take
        by then is refused `engine_unavailable` there and never runs.
        """
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        await self.wait_ready(timeout_s)
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[req_id] = (fut, type(cmd))
        if not await self.send(wire.call(req_id, deadline, cmd)):
            self._calls.pop(req_id, None)
            if not fut.done():  # else the core's death has failed it already: that error is the answer
                raise EngineError("engine_restarting", "the engine core is not taking commands; retry")
        return await fut

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until a core serves (a restart within `timeout_s`); EngineError if none will."""
        if not await super().wait_ready(self.call_timeout_s if timeout_s is None else timeout_s):
            raise EngineError("engine_restarting", "the engine is restarting; retry")
        if self.fatal is not None:
            raise EngineError("engine_unavailable", f"the engine has stopped: {self.fatal}")

    def new_ticket(self) -> tuple[int, asyncio.Future]:
        """A ticket for queued work: its future gets the context length once the work is in the cache."""
        ticket = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._tickets[ticket] = fut
        return ticket, fut

    def forget_ticket(self, ticket: int) -> None:
        self._tickets.pop(ticket, None)

    def open_stream(self, response_id: str, session_id: str, stop: tuple[str, ...] = ()) -> asyncio.Queue:
        """A queue that receives the response's TextDelta events and its ResponseFinished."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[response_id] = (q, session_id)
        self.outputs.start(response_id, stop)
        return q

    def close_stream(self, response_id: str) -> None:
        """The caller is done with the response's stream (its detokenizer goes too: a StartResponse the
        core refused never finishes, and left one behind for every refusal)."""
        self._streams.pop(response_id, None)
        self.outputs.forget(response_id)

    def observe(self, fn: Callable[[str, float], None]) -> None:
        """Call `fn(kind, value)` for each ttft, itl and step_tokens sample the core reports."""
        self._observers.append(fn)

    def fail_in_flight(self, code: str, message: str) -> None:
        calls, self._calls = self._calls, {}
        for fut, _ in calls.values():
            if not fut.done():
                fut.set_exception(EngineError(code, message))
        tickets, self._tickets = self._tickets, {}
        for fut in tickets.values():
            if not fut.done():
                fut.set_exception(EngineError(code, message))
        for rid, (q, sid) in list(self._streams.items()):
            self._finished(ResponseFinished(sid, rid, "failed", code), q)

    # -- outputs ------------------------------------------------------------------------

    def take(self, kind: bytes, body: bytes) -> None:
        if kind == wire.OUT:
            self._dispatch(wire.decode_out(body))

    def _dispatch(self, out: wire.StepOutput) -> None:
        for r in out.replies:
            fut, cmd_type = self._calls.pop(r.req_id, (None, None))
            if fut is None or fut.done():
                continue
            if r.error is not None:
                fut.set_exception(EngineError(*r.error))
            else:
                fut.set_result(wire.reply_value(r, cmd_type))
        for ev in out.prefilled:
            fut = self._tickets.pop(ev.ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(ev.context_tokens)
        for ev in out.tokens:
            entry = self._streams.get(ev.response_id)
            delta, stop = self.outputs.tokens(ev)
            if entry is not None and delta is not None:
                entry[0].put_nowait(delta)
            if stop is not None:
                self._own(self._stop(stop))
        for ev in out.finished:
            entry = self._streams.get(ev.response_id)
            if entry is not None:
                self._finished(ev, entry[0])
            elif ev.response_id in self.outputs:
                self.outputs.finished(ev)
        for kind, value in out.samples:
            for fn in self._observers:
                fn(kind, value)
        if out.snapshot is not None:
            self.snapshot = out.snapshot

    def _finished(self, ev: ResponseFinished, q: asyncio.Queue) -> None:
        delta, ev = self.outputs.finished(ev)
        if delta is not None:
            q.put_nowait(delta)
        q.put_nowait(ev)

    async def _stop(self, stop) -> None:
        try:
            await self.submit(api.StopResponse(stop.session_id, stop.response_id, stop.num_tokens))
        except EngineError as exc:
            log.debug("stop of %s not delivered: %s", stop.response_id, exc)
