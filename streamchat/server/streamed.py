"""A reply's text stored while it streams, so a kill -9 loses at most the last second of it.

Each running response of a stored session has one `StreamedText`. The text
the client was sent is appended to the response's row in small writes
(`Store.append_text`, one UPDATE adding the new characters): at most
`every_s` after the first unsaved character, sooner once `every_deltas`
deltas wait. One write at a time per response, off the path that sends the
deltas. `close()` waits for the write in flight and returns what is still
unsaved, which the caller stores with the response's final status. A write
that fails is logged and remembered (`failed`): the caller then stores the
whole text once at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamchat.store import StoreError

log = logging.getLogger(__name__)

EVERY_S = 1.0
EVERY_DELTAS = 32


class StreamedText:
    def __init__(self, store, session_id: str, item_id: str, every_s: float = EVERY_S,
                 every_deltas: int = EVERY_DELTAS) -> None:
        self.store = store
        self.session_id, self.item_id = session_id, item_id
        self.every_s, self.every_deltas = every_s, every_deltas
        self.text = ""  # everything added, saved or not
        self.saved = 0  # characters of `text` stored
        self.failed = False
        self._count = 0  # deltas waiting
        self._first_unsaved = 0.0
        self._wake = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, text: str) -> None:
        if not self._count:
            self._first_unsaved = time.monotonic()
            self._wake.set()  # the saver starts its clock
        self.text += text
        self._count += 1
        if self._count >= self.every_deltas:
            self._wake.set()

    async def close(self) -> str:
        """Stop saving; the text not yet stored (all of it if a write failed)."""
        self._closed = True
        self._wake.set()
        await self._task
        return self.text if self.failed else self.text[self.saved:]

    def discard(self) -> None:
        """Stop saving without waiting (the response ended some other way)."""
        self._closed = True
        self._task.cancel()

    def _due(self) -> bool:
        return self._count >= self.every_deltas or (
            self._count > 0 and time.monotonic() - self._first_unsaved >= self.every_s)

    async def _run(self) -> None:
        while True:
            while not self._closed and not self._due():
                self._wake.clear()
                timeout = None if not self._count else max(0.0, self._first_unsaved + self.every_s - time.monotonic())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            if self._closed:
                return
            await self._save()

    async def _save(self) -> None:
        end, self._count = len(self.text), 0
        if self.failed or end == self.saved:
            return
        try:
            await self.store.append_text(self.session_id, self.item_id, self.text[self.saved:end], 0)
            self.saved = end
        except (StoreError, OSError) as exc:
            self.failed = True
            log.warning("session %s: streamed text of %s not stored as it came (%s); stored at the end",
                        self.session_id, self.item_id, exc)
