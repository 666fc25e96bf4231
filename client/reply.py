"""Streaming one assistant reply: `response.create` to `response.done`.

Feeds each `response.output_text.delta` to a renderer, sends
`response.cancel` at the first interrupt (Ctrl-C) and stops waiting at the
second, and reports a lost connection as a reply with status "lost" rather
than an exception, so that the caller keeps the partial text and reconnects.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple, Protocol

from .connection import Connection
from .errors import ConnectionLost
from .render import format_status

log = logging.getLogger(__name__)


class Renderer(Protocol):
    def start(self) -> None: ...
    def feed(self, delta: str) -> None: ...
    def finish(self, status: str) -> None: ...


class Reply(NamedTuple):
    """How a reply ended. status: completed, cancelled, incomplete, failed or lost."""

    text: str
    status: str
    response: dict


class Interrupts:
    """Counts Ctrl-C presses during one reply; a SIGINT handler calls `press`."""

    def __init__(self) -> None:
        self.presses = 0
        self._changed = asyncio.Event()

    def press(self) -> None:
        self.presses += 1
        self._changed.set()

    async def wait(self, presses: int) -> None:
        """Returns once `presses` presses have been counted."""
        while self.presses < presses:
            self._changed.clear()
            await self._changed.wait()


async def stream_reply(conn: Connection, renderer: Renderer, options: dict,
                       interrupts: Interrupts | None = None) -> Reply:
    """Asks for a reply and renders it as it streams."""
    interrupts = interrupts or Interrupts()
    created = await conn.request("response.create", "response.created",
                                 **({"response": options} if options else {}))
    response_id = (created.get("response") or {}).get("id")
    renderer.start()
    canceller = asyncio.ensure_future(_cancel_on_press(conn, interrupts))
    abandon = asyncio.ensure_future(interrupts.wait(2))
    reply = Reply("", "lost", {})
    try:
        reply = await _read_until_done(conn, renderer, abandon, response_id)
    finally:
        for task in (canceller, abandon):
            task.cancel()
        await asyncio.gather(canceller, abandon, return_exceptions=True)
        status = format_status(reply.response) if reply.response else _LABELS.get(reply.status, "")
        renderer.finish(status)
    return reply


_LABELS = {"lost": "connection lost: the reply was cut short",
           "cancelled": "cancelled (stopped waiting for the daemon)"}


async def _cancel_on_press(conn: Connection, interrupts: Interrupts) -> None:
    await interrupts.wait(1)
    try:
        await conn.send("response.cancel")
    except ConnectionLost:
        pass  # the reader sees it too


async def _read_until_done(conn: Connection, renderer: Renderer, abandon: asyncio.Future,
                           response_id: str | None) -> Reply:
    parts: list[str] = []
    while True:
        recv = asyncio.ensure_future(conn.recv())
        await asyncio.wait({recv, abandon}, return_when=asyncio.FIRST_COMPLETED)
        if not recv.done():
            recv.cancel()  # safe: websockets loses no frame
            await asyncio.gather(recv, return_exceptions=True)
            return Reply("".join(parts), "cancelled", {})
        try:
            event = recv.result()
        except ConnectionLost:
            return Reply("".join(parts), "lost", {})
        kind = event.get("type")
        if kind == "response.output_text.delta":
            parts.append(str(event.get("delta", "")))
            renderer.feed(parts[-1])
        elif kind == "response.done":
            response = event.get("response") or {}
            if response_id and response.get("id") not in (None, response_id):
                continue  # the end of an earlier, abandoned reply
            return Reply("".join(parts), str(response.get("status", "completed")), response)
        elif kind == "error":
            log.info("error during a reply: %s", event.get("error"))
