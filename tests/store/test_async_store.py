"""Tests of streamchat.store.async_store: ordering, cancellation, flushing on close, failures.

Tests taking `url` run on SQLite and on PostgreSQL; those injecting faults use SQLite's driver errors.
"""

from __future__ import annotations

import asyncio
import os
import threading
import logging
from pathlib import Path

import faults
import pytest

from streamchat.priority import BACKGROUND_NICE
from streamchat.store import AsyncStore, Store, StoreError


async def _with_open_response(astore: AsyncStore) -> None:
    await astore.migrate()
    await astore.create_session("sess_a", "h", "", {})
    await astore.add_item("sess_a", "item_1", "assistant", "response", "", "in_progress", 0)


def test_concurrent_appends_keep_order(url: str) -> None:
    """200 appends issued concurrently are applied in the order they were issued."""
    astore = AsyncStore(Store(url))

    async def main() -> str:
        await _with_open_response(astore)
        await asyncio.gather(*(astore.append_text("sess_a", "item_1", f"{i},", 1) for i in range(200)))
        (item,) = await astore.items("sess_a")
        await astore.aclose()
        return item.text, item.num_tokens

    assert asyncio.run(main()) == ("".join(f"{i}," for i in range(200)), 200)


def test_runs_off_the_event_loop_thread(url: str) -> None:
    """Store calls run on one worker thread, never on the event loop's thread."""
    astore = AsyncStore(Store(url))
    seen: list[str] = []

    async def main() -> None:
        await astore.migrate()
        for _ in range(3):
            await astore._call(lambda: seen.append(threading.current_thread().name))
        await astore.aclose()

    asyncio.run(main())
    assert len(set(seen)) == 1 and seen[0] != threading.main_thread().name
    assert seen[0].startswith("streamchat-store")


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="Linux thread priorities")
def test_the_worker_gives_way_to_the_step(tmp_path: Path) -> None:
    """The worker thread runs at BACKGROUND_NICE (or lower), the caller's thread where it was."""
    astore = AsyncStore(Store(f"sqlite:///{tmp_path / 'p.db'}"))
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main() -> int:
        nice = await astore._call(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        await astore.aclose()
        return nice

    assert asyncio.run(main()) >= max(BACKGROUND_NICE, before)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_cancelled_caller_still_writes(url: str) -> None:
    """A write whose caller is cancelled while queued is still applied, in order."""
    astore = AsyncStore(Store(url))

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


def test_aclose_flushes_queued_writes(url: str) -> None:
    """aclose() waits for every call already issued before closing the store."""
    astore = AsyncStore(Store(url))

    async def main() -> None:
        await _with_open_response(astore)
        tasks = [asyncio.create_task(astore.append_text("sess_a", "item_1", "x", 1)) for _ in range(50)]
        await asyncio.sleep(0)
        await astore.aclose()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    with Store(url) as s:
        assert s.items("sess_a")[0].text == "x" * 50


def test_store_error_reaches_the_caller(tmp_path: Path) -> None:
    """A StoreError raised on the worker reaches the awaiting caller as is, and the next call works."""
    faulty = faults.FaultyStore(f"sqlite:///{tmp_path / 'store.db'}")
    astore = AsyncStore(faulty)

    async def main() -> tuple[str, list[str]]:
        await _with_open_response(astore)
        faulty.fail_next("add_item", "locked", at="INSERT")
        with pytest.raises(StoreError) as info:
            await astore.add_item("sess_a", "item_2", "user", "message", "hi", "completed", 1)
        await astore.add_item("sess_a", "item_3", "user", "message", "hi", "completed", 1)
        ids = [item.item_id for item in await astore.items("sess_a")]
        await astore.aclose()
        return info.value.code, ids

    assert asyncio.run(main()) == ("store_unavailable", ["item_1", "item_3"])


def test_failed_call_does_not_hold_up_the_queue(tmp_path: Path) -> None:
    """Three queued appends whose first fails: the other two still apply, in order, and each caller gets its outcome."""
    faulty = faults.FaultyStore(f"sqlite:///{tmp_path / 'store.db'}")
    astore = AsyncStore(faulty)

    async def main() -> tuple[list[object], str]:
        await _with_open_response(astore)
        gate = threading.Event()
        blocker = asyncio.ensure_future(astore._call(gate.wait))
        calls = [asyncio.ensure_future(astore.append_text("sess_a", "item_1", c, 1)) for c in "abc"]
        faulty.fail_next("append_text", "full")  # armed before any append has run
        gate.set()
        await blocker
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        (item,) = await astore.items("sess_a")
        await astore.aclose()
        return [o if o is None else o.code for o in outcomes], item.text

    assert asyncio.run(main()) == (["store_unavailable", None, None], "bc")


def test_orphaned_failure_is_logged_after_the_loop_closed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A write whose caller was cancelled and whose event loop has closed still logs its StoreError when it fails."""
    faulty = faults.FaultyStore(f"sqlite:///{tmp_path / 'store.db'}")
    astore = AsyncStore(faulty)
    gate = threading.Event()

    async def main() -> None:
        await _with_open_response(astore)
        faulty.fail_next("append_text", "ioerr", at="COMMIT")
        asyncio.ensure_future(astore._call(gate.wait))  # holds the worker until the loop is gone
        orphan = asyncio.ensure_future(astore.append_text("sess_a", "item_1", "x", 1))
        await asyncio.sleep(0)
        orphan.cancel()
        # Returning ends asyncio.run: it cancels the blocker's caller and closes the loop.

    with caplog.at_level(logging.ERROR, logger="streamchat.store.async_store"):
        asyncio.run(main())
        gate.set()
        astore._executor.shutdown(wait=True)
    (record,) = caplog.records
    assert record.getMessage() == "store call failed after its caller was cancelled"
    assert isinstance(record.exc_info[1], StoreError) and record.exc_info[1].code == "store_unavailable"
    with Store(f"sqlite:///{tmp_path / 'store.db'}") as s:
        assert s.items("sess_a")[0].text == ""


def test_leases_and_registry_through_the_worker(url: str) -> None:
    """astore.leases and astore.daemons reach the store in call order: a fenced write lands before the release after it."""
    astore = AsyncStore(Store(url))

    async def main() -> tuple:
        await _with_open_response(astore)
        await astore.daemons.register("d1", "a:1")
        lease = await astore.leases.acquire("sess_a", "d1", 15)
        writes = [astore.append_text("sess_a", "item_1", c, 1, epoch=lease.epoch) for c in "ab"]
        done = await asyncio.gather(*writes, astore.leases.release(lease), astore.leases.renew(lease))
        taken = await astore.leases.acquire("sess_a", "d2", 15)
        with pytest.raises(StoreError) as info:
            await astore.finish_item("sess_a", "item_1", status="completed", epoch=lease.epoch)
        await astore.update_session("sess_a", total_tokens=2, epoch=taken.epoch)
        await astore.add_item("sess_a", "item_2", "user", "message", "", "completed", 0, epoch=taken.epoch)
        beat, fleet = await astore.daemons.heartbeat("d1"), await astore.daemons.fleet(15)
        released = await astore.daemons.deregister("d1")
        (item, _) = await astore.items("sess_a")
        await astore.aclose()
        return done, (taken.owner, taken.epoch), info.value.code, beat, [d.id for d in fleet], released, item.text

    assert asyncio.run(main()) == ([None, None, True, False], ("d2", 2), "lease_lost", True, ["d1", "d2"], 0, "ab")
