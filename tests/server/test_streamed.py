"""StreamedText: a reply's text stored in small appends as it streams, and all of it once if a write fails."""

import asyncio
import time

import pytest

from streamchat.server.streamed import StreamedText
from streamchat.store import StoreError
from streamchat.store.errors import STORE_UNAVAILABLE


class Store:
    """Records appends; raises StoreError from the append numbered `fail_at` on (1-based)."""

    def __init__(self, fail_at=None):
        self.appends, self.calls, self.fail_at = [], 0, fail_at

    async def append_text(self, session_id, item_id, text, num_tokens):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise StoreError(STORE_UNAVAILABLE, "the database is gone")
        self.appends.append(text)


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_appends_come_every_n_deltas_and_the_tail_at_close():
    async def go():
        store = Store()
        saved = StreamedText(store, "s", "i", every_s=60, every_deltas=3)
        for piece in ("a", "b", "c"):
            saved.add(piece)
        await until(lambda: store.appends == ["abc"])
        saved.add("d")
        saved.add("e")
        await asyncio.sleep(0.05)  # two deltas, a minute to go: nothing is due, nothing may be written
        assert store.appends == ["abc"]
        tail = await saved.close()
        return store, saved, tail

    store, saved, tail = asyncio.run(go())
    assert tail == "de" and not saved.failed
    assert "".join(store.appends) + tail == saved.text == "abcde"


def test_an_unsaved_delta_is_written_within_every_s():
    async def go():
        store = Store()
        saved = StreamedText(store, "s", "i", every_s=0.1, every_deltas=1000)
        t0 = time.monotonic()
        saved.add("hello")
        await until(lambda: store.appends == ["hello"])
        waited = time.monotonic() - t0
        assert await saved.close() == ""
        return waited

    assert 0.09 <= asyncio.run(go()) < 2.0


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failed_write_stops_appending_and_close_returns_the_whole_text(fail_at):
    """After a failure nothing more is appended (a later append would leave a gap), and close() hands back
    everything, which the caller stores whole over the row."""
    async def go():
        store = Store(fail_at=fail_at)
        saved = StreamedText(store, "s", "i", every_s=60, every_deltas=2)
        for n, piece in enumerate(("ab", "cd", "ef", "gh", "ij", "kl")):
            saved.add(piece)
            if n % 2:
                await until(lambda: store.calls >= min(fail_at, (n + 1) // 2))
        return store, saved, await saved.close()

    store, saved, tail = asyncio.run(go())
    assert saved.failed and store.calls == fail_at  # no write tried after the failed one
    assert tail == saved.text == "abcdefghijkl"
    assert store.appends == ["abcd"][:fail_at - 1]
