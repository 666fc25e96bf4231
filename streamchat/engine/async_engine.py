"""The engine's asyncio face: one supervised thread steps the engine; asyncio talks to it in typed messages.

Owns the engine thread and the crossing between it and the event loop.
Commands (`engine.api`) go in through a thread-safe queue, each with a
deadline, and run on the engine thread between steps (so exactly one thread
mutates engine state); results come back through futures and events with
`loop.call_soon_threadsafe`, once per step. The event loop never runs the
model and never reads live engine state: it reads the `EngineSnapshot` the
thread publishes. Idle, the thread blocks on the queue, burning no CPU.

Supervision: a failing step fails its own responses (the engine recovers
itself); `max_failed_steps` failures in a row, or any exception escaping the
engine, make the engine *fatal*: every waiter gets `engine_unavailable` or a
failed response, and `on_fatal(reason)` tells the daemon to save what it can
and exit non-zero.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable

from streamchat.engine import api
from streamchat.engine.api import EngineError, EngineSnapshot
from streamchat.engine.events import EngineEvent, ItemPrefilled, ResponseFinished, TextDelta
from streamchat.engine.figures import take_snapshot

log = logging.getLogger(__name__)

_STOP = object()
SNAPSHOT_EVERY_S = 0.2  # the published figures are at most this old while the engine works


class AsyncEngine:
    def __init__(self, engine, num_threads: int = 0, call_timeout_s: float = 30.0,
                 max_failed_steps: int = 5) -> None:
        self._engine = engine
        self.num_threads = num_threads
        self.call_timeout_s = call_timeout_s
        self.max_failed_steps = max_failed_steps
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # response_id -> its events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.snapshot: EngineSnapshot = take_snapshot(engine)
        self._snapshot_at = 0.0
        self.fatal: str | None = None  # why the engine cannot go on; None while healthy
        self.on_fatal: Callable[[str], None] | None = None  # called on the event loop

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="streamchat-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 10.0) -> bool:
        """Ask the thread to end after its current step; False if it did not within `timeout_s`."""
        if self._thread is None:
            return True
        self._commands.put(_STOP)
        thread = self._thread
        await asyncio.to_thread(thread.join, timeout_s)
        self._thread = None
        return not thread.is_alive()

    def observe(self, fn: Callable[[str, float], None]) -> None:
        """Call `fn(kind, value)` on the engine thread for each ttft, itl and step_tokens sample."""
        self._engine.metrics.observers.append(fn)

    async def close_tiers(self) -> None:
        """After `stop`: finish the disk tier's writes and close it."""
        pager = self._engine.pager
        if pager is not None and not self.alive:
            await asyncio.to_thread(pager.close)

    async def submit(self, cmd: api.Command, timeout_s: float | None = None):
        """Run one command on the engine thread; its result, or its EngineError.

        Not taken within the deadline: `engine_unavailable`, and it never runs.
        Once taken it runs to the end, and its result is awaited.
        """
        if self.fatal is not None:
            raise EngineError("engine_unavailable", f"the engine has stopped: {self.fatal}")
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        if isinstance(cmd, api.LoadSaved):  # file reads and checks stay off the engine thread
            return await asyncio.wait_for(
                asyncio.to_thread(self._engine.tiering.load_saved, cmd.session_id, cmd.mark), timeout_s)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fut, cmd))
        waiter = asyncio.wrap_future(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            if fut.cancel():
                raise EngineError("engine_unavailable",
                                  f"the engine did not take this request within {timeout_s:g} s; retry") from None
            return await waiter  # already running: it finishes soon

    def open_stream(self, response_id: str) -> asyncio.Queue:
        """A queue that receives the response's TextDelta and ResponseFinished events."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[response_id] = q
        return q

    def close_stream(self, response_id: str) -> None:
        self._streams.pop(response_id, None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        if self.num_threads:
            import torch

            torch.set_num_threads(self.num_threads)
        eng = self._engine
        try:
            while True:
                if not self._drain_commands(block=not eng.has_work()):
                    break
                if eng.has_work():
                    self._publish(eng.step())
                    if eng.failed_steps >= self.max_failed_steps:
                        self._give_up(f"{eng.failed_steps} engine steps failed in a row")
                        return
                self._refresh_snapshot(force=not eng.has_work())
        except BaseException as exc:  # noqa: BLE001 - a bug outside any one step
            log.exception("engine thread failed")
            self._give_up(f"engine thread failed: {exc!r}")
            return
        self._refresh_snapshot(force=True)

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
            fut, cmd = item
            if fut.set_running_or_notify_cancel():
                events += self._run_command(fut, cmd)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish(events)
        return True

    def _run_command(self, fut: concurrent.futures.Future, cmd) -> list[EngineEvent]:
        try:
            result = self._engine.handle(cmd)
        except EngineError as exc:
            fut.set_exception(exc)
            return []
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the thread
            log.exception("engine command %s failed", type(cmd).__name__)
            fut.set_exception(EngineError("internal", f"the engine failed on {type(cmd).__name__}: {exc!r}"))
            return []
        fut.set_result(result)
        if isinstance(result, list) and result and isinstance(result[0], EngineEvent.__args__):
            return result
        return []

    def _publish(self, events: list[EngineEvent]) -> None:
        if events:
            self._loop.call_soon_threadsafe(self._dispatch, events)

    def _refresh_snapshot(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self.snapshot = take_snapshot(self._engine)  # replaced whole: readers never see it half-built
            self._snapshot_at = now

    def _give_up(self, reason: str) -> None:
        log.critical("the engine cannot go on: %s", reason)
        self.fatal = reason
        while True:  # nobody will run what is queued: fail it now
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and item[0].set_running_or_notify_cancel():
                item[0].set_exception(EngineError("engine_unavailable", f"the engine has stopped: {reason}"))
        self._loop.call_soon_threadsafe(self._fail_all, reason)

    # -- event loop --------------------------------------------------------------------

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

    def _fail_all(self, reason: str) -> None:
        for rid, q in list(self._streams.items()):
            q.put_nowait(ResponseFinished("", rid, "failed", "engine_unavailable", ""))
        if self.on_fatal is not None:
            self.on_fatal(reason)
