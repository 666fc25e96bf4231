"""A connection's bounded send queue: merges pending deltas so a slow client never stalls the engine.

Owns ordering and back-pressure of outgoing events for one websocket. While
the client keeps up, every event goes out as queued; when it falls behind,
consecutive `response.output_text.delta` events of the same item merge into
one (their concatenation is unchanged). A client so slow that even merged
events pile past the limit is disconnected (1008), never waited for.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from streamchat.server.events import encode

log = logging.getLogger(__name__)

DELTA = "response.output_text.delta"


class SlowClient(Exception):
    """The client let more events pile up than the limit."""


class Outbox:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queue: deque[dict] = deque()
        self._ready = asyncio.Event()
        self._closed = False
        self.num_merged = 0

    def put(self, event: dict) -> None:
        if self._closed:
            return
        last = self._queue[-1] if self._queue else None
        if (event["type"] == DELTA and last is not None and last["type"] == DELTA
                and last["item_id"] == event["item_id"] and len(self._queue) > 1):
            last["delta"] += event["delta"]  # the head may be mid-send; merge behind it only
            self.num_merged += 1
        else:
            self._queue.append(event)
            if len(self._queue) > self.limit:
                self._closed = True
                self._ready.set()
                raise SlowClient(f"{len(self._queue)} events waiting")
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def run(self, websocket) -> None:
        """Send queued events until closed (and drained)."""
        while True:
            await self._ready.wait()
            while self._queue:
                event = self._queue[0]
                if self._closed and len(self._queue) > self.limit:
                    return
                await websocket.send(encode(event), text=True)
                self._queue.popleft()
            self._ready.clear()
            if self._closed:
                return
