"""Lines of a text stream as they arrive, for asyncio code.

A daemon thread does the blocking reads (a pipe, a terminal in cooked mode,
a file), so a read pending at exit never holds the process. Lines keep
their line break; None marks the end.
"""

from __future__ import annotations

import asyncio
import threading
from typing import IO

_NOTHING = object()


class LineSource:
    """Reads `stream` line by line on a thread; `get()` awaits the next line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._thread: threading.Thread | None = None
        self._back: object = _NOTHING  # a line handed back with unget()

    def start(self) -> "LineSource":
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._pump, args=(loop,), name="line-source",
                                        daemon=True)
        self._thread.start()
        return self

    async def get(self) -> str | None:
        """The next line, or None at the end of the stream."""
        if self._back is not _NOTHING:
            line, self._back = self._back, _NOTHING
            return line  # type: ignore[return-value]
        if self._thread is None:
            self.start()
        return await self._queue.get()

    def get_nowait(self) -> str | None:
        """A line that has already arrived (None: the end); raises asyncio.QueueEmpty if none."""
        if self._back is not _NOTHING:
            line, self._back = self._back, _NOTHING
            return line  # type: ignore[return-value]
        return self._queue.get_nowait()

    def unget(self, line: str | None) -> None:
        """Hands back one line taken with get_nowait(); the next get returns it."""
        assert self._back is _NOTHING, "one line at most"
        self._back = line

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for line in iter(self._stream.readline, ""):
                loop.call_soon_threadsafe(self._queue.put_nowait, line)
        except (OSError, ValueError):
            pass  # closed under us: same as the end
        finally:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, None)
            except RuntimeError:
                pass  # the loop is gone; nobody is waiting
