"""The engine's asyncio face: one thread steps the engine; asyncio talks to it through queues.

Owns the engine thread and the crossing between it and the event loop.
Commands go in through a thread-safe queue and run on the engine thread
between steps (so exactly one thread mutates engine state); results and
events come back with `loop.call_soon_threadsafe`, once per step. The event
loop never runs the model. Idle, the thread blocks on the queue, burning no
CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable

from streamchat.engine.engine import Engine
from streamchat.engine.events import EngineEvent, ItemPrefilled, ResponseFinished, TextDelta

log = logging.getLogger(__name__)

_STOP = object()


class AsyncEngine:
    def __init__(self, engine: Engine, num_threads: int = 0) -> None:
        self.engine = engine
        self.num_threads = num_threads
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # response_id -> its events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="streamchat-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run `fn(*args)` on the engine thread between steps; its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fut, fn, args, kwargs))
        return await asyncio.wrap_future(fut)

    def open_stream(self, response_id: str) -> asyncio.Queue:
        """A queue that receives the response's TextDelta and ResponseFinished events."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[response_id] = q
        return q

    def close_stream(self, response_id: str) -> None:
        self._streams.pop(response_id, None)

    # -- engine thread ----------------------------------------------------------

    def _run(self) -> None:
        if self.num_threads:
            import torch

            torch.set_num_threads(self.num_threads)
        try:
            while True:
                if not self._drain_commands(block=not self.engine.has_work()):
                    return
                if self.engine.has_work():
                    self._publish(self.engine.step())
        except BaseException as exc:  # the engine is broken: say so to every waiter
            log.exception("engine thread failed")
            self.failed = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands; False when asked to stop."""
        try:
            item = self._commands.get(block=block)
        except queue.Empty:
            return True
        events: list[EngineEvent] = []
        while True:
            if item is _STOP:
                self._publish(events)
                return False
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except Exception as exc:
                    fut.set_exception(exc)
                else:
                    if isinstance(result, list) and result and isinstance(result[0], EngineEvent.__args__):
                        events += result
                    fut.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish(events)
        return True

    def _publish(self, events: list[EngineEvent]) -> None:
        if events:
            self._loop.call_soon_threadsafe(self._dispatch, events)

    # -- event loop -------------------------------------------------------------

    def _dispatch(self, events: list[EngineEvent]) -> None:
        for ev in events:
            if isinstance(ev, ItemPrefilled):
                fut = ev.ticket
                if isinstance(fut, asyncio.Future) and not fut.done():
                    fut.set_result(ev.context_tokens)
            elif isinstance(ev, (TextDelta, ResponseFinished)):
                q = self._streams.get(ev.response_id)
                if q is not None:
                    q.put_nowait(ev)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, q in list(self._streams.items()):
            q.put_nowait(ResponseFinished("", rid, "failed", "internal", "", {}))
