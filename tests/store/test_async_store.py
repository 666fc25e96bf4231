"""Tests of streamchat.store.async_store: ordering, cancellation, flushing on close."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from streamchat.store import AsyncStore, Store


def _open(tmp_path: Path) -> tuple[str, AsyncStore]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    return url, AsyncStore(Store(url))


async def _with_open_response(astore: AsyncStore) -> None:
    await astore.migrate()
    await astore.create_session("sess_a", "h", "", {})
    await astore.add_item("sess_a", "item_1", "assistant", "response", "", "in_progress", 0)


def test_concurrent_appends_keep_order(tmp_path: Path) -> None:
    """200 appends issued concurrently are applied in the order they were issued."""
    _, astore = _open(tmp_path)

    async def main() -> str:
        await _with_open_response(astore)
        await asyncio.gather(*(astore.append_text("sess_a", "item_1", f"{i},", 1) for i in range(200)))
        (item,) = await astore.items("sess_a")
        await astore.aclose()
        return item.text, item.num_tokens

    assert asyncio.run(main()) == ("".join(f"{i}," for i in range(200)), 200)


def test_runs_off_the_event_loop_thread(tmp_path: Path) -> None:
    """Store calls run on one worker thread, never on the event loop's thread."""
    _, astore = _open(tmp_path)
    seen: list[str] = []

    async def main() -> None:
        await astore.migrate()
        for _ in range(3):
            await astore._call(lambda: seen.append(threading.current_thread().name))
        await astore.aclose()

    asyncio.run(main())
    assert len(set(seen)) == 1 and seen[0] != threading.main_thread().name
    assert seen[0].startswith("streamchat-store")


def test_cancelled_caller_still_writes(tmp_path: Path) -> None:
    """A write whose caller is cancelled while queued is still applied, in order."""
    url, astore = _open(tmp_path)

    async def main() -> None:
        await _with_open_response(astore)
        tasks = [asyncio.create_task(astore.append_text("sess_a", "item_1", c, 1)) for c in "abc"]
        await asyncio.sleep(0)  # let every task submit its call
        tasks[1].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert tasks[1].cancelled()
        await astore.aclose()

    asyncio.run(main())
    with Store(url) as s:
        assert s.items("sess_a")[0].text == "abc"


def test_aclose_flushes_queued_writes(tmp_path: Path) -> None:
    """aclose() waits for every call already issued before closing the store."""
    url, astore = _open(tmp_path)

    async def main() -> None:
        await _with_open_response(astore)
        tasks = [asyncio.create_task(astore.append_text("sess_a", "item_1", "x", 1)) for _ in range(50)]
        await asyncio.sleep(0)
        await astore.aclose()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    with Store(url) as s:
        assert s.items("sess_a")[0].text == "x" * 50
