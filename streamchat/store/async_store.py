"""The store for asyncio code: every call runs on one dedicated worker thread.

One worker keeps calls in the order they were made, so appends land in the
order the live feed produced them, and database work never blocks the event
loop. A call that has been made is carried out even if its caller is
cancelled while waiting (the caller still sees CancelledError): a transcript
never loses a write from the middle of a sequence. Its failure is then logged
from the worker thread, so it is seen even if the event loop is gone by the
time the call ends. Failures reach the awaiting caller unchanged (StoreError
for the database's own, see `streamchat.store.errors`); a failed call does not
hold up or reorder the calls queued behind it.

`astore.leases` and `astore.daemons` are the async twins of `Store.leases`
and `Store.daemons`, on the same worker: a lease released after a session's
last writes is released after them.

The worker runs at `priority.BACKGROUND_NICE`: where the step's threads fill
the cores, a stream's tokens come before a resume's lease and transcript
read, which then waits longer. `python bench/pagein_itl.py`, interleaved with
the worker at nice 0 on 2 cores (2026-12-07): the stream's median gap while 3
sessions came back from disk was within 1.2x of its quiet one in 9 of 9 runs
(0.91-1.16x) against 7 of 9 (up to 1.28x); with 10 sessions (`--sessions 10
--rounds 2 --tokens 300`) 6 of 6 (0.87-1.08x) against 4 of 9 (up to 1.70x).
The stream's summed delay per resume did not fall measurably (10-61 ms
against 6-47 ms with 3 sessions, too noisy to tell): the same work is spread
thinner. A resume took longer under that load: 0.17 s against 0.12 s (the
median round after the first, per session).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from streamchat.priority import lower_priority
from streamchat.store.leases import Lease, Leases
from streamchat.store.records import ItemRecord, SessionRecord
from streamchat.store.registry import DaemonState, Registry
from streamchat.store.store import Store

logger = logging.getLogger(__name__)

T = TypeVar("T")
Call = Callable[..., Awaitable[Any]]  # AsyncStore._call: fn, *args, **kwargs -> awaitable result


class AsyncStore:
    """Async twin of `Store`, same method names; owns the wrapped store from here on."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.dialect = store.engine.dialect.name  # "sqlite": one daemon per store
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamchat-store",
                                            initializer=lower_priority)
        self.leases = AsyncLeases(store.leases, self._call)
        self.daemons = AsyncRegistry(store.daemons, self._call)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        job = self._executor.submit(functools.partial(fn, *args, **kwargs))
        try:
            # Shielded: cancelling the caller must not pull a queued write out of the sequence.
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            # On the thread's own future, not the loop's wrapper: a wrapper whose loop
            # has closed never completes, and the failure would vanish unlogged.
            job.add_done_callback(_report_orphaned_failure)
            raise

    async def migrate(self) -> None:
        """See `Store.migrate`."""
        await self._call(self._store.migrate)

    async def create_session(
        self, session_id: str, token_hash: str, instructions: str, settings: Mapping[str, Any]
    ) -> None:
        """See `Store.create_session`."""
        await self._call(self._store.create_session, session_id, token_hash, instructions, settings)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        """See `Store.get_session`."""
        return await self._call(self._store.get_session, session_id)

    async def update_session(
        self,
        session_id: str,
        *,
        instructions: str | None = None,
        settings: Mapping[str, Any] | None = None,
        status: str | None = None,
        total_tokens: int | None = None,
        evicted_tokens: int | None = None,
        epoch: int | None = None,
    ) -> None:
        """See `Store.update_session`."""
        await self._call(
            self._store.update_session,
            session_id,
            instructions=instructions,
            settings=settings,
            status=status,
            total_tokens=total_tokens,
            evicted_tokens=evicted_tokens,
            epoch=epoch,
        )

    async def list_sessions(self, limit: int = 100) -> list[SessionRecord]:
        """See `Store.list_sessions`."""
        return await self._call(self._store.list_sessions, limit)

    async def add_item(
        self, session_id: str, item_id: str, role: str, kind: str, text: str, status: str, num_tokens: int,
        *, epoch: int | None = None,
    ) -> ItemRecord:
        """See `Store.add_item`."""
        return await self._call(
            self._store.add_item, session_id, item_id, role, kind, text, status, num_tokens, epoch=epoch
        )

    async def append_text(
        self, session_id: str, item_id: str, text: str, num_tokens_added: int, *, epoch: int | None = None
    ) -> None:
        """See `Store.append_text`."""
        await self._call(self._store.append_text, session_id, item_id, text, num_tokens_added, epoch=epoch)

    async def finish_item(
        self,
        session_id: str,
        item_id: str,
        *,
        text: str | None = None,
        status: str,
        num_tokens: int | None = None,
        epoch: int | None = None,
    ) -> None:
        """See `Store.finish_item`."""
        await self._call(
            self._store.finish_item, session_id, item_id, text=text, status=status, num_tokens=num_tokens, epoch=epoch
        )

    async def items(self, session_id: str) -> list[ItemRecord]:
        """See `Store.items`."""
        return await self._call(self._store.items, session_id)

    async def session_with_items(self, session_id: str) -> tuple[SessionRecord, list[ItemRecord]]:
        """See `Store.session_with_items`."""
        return await self._call(self._store.session_with_items, session_id)

    async def take_session(self, session_id: str, owner: str, lease_s: float,
                           admits: Callable[[SessionRecord], bool]) -> tuple[Lease, SessionRecord, list[ItemRecord]] | None:
        """See `Store.take_session` (`admits` runs on the store's thread)."""
        return await self._call(self._store.take_session, session_id, owner, lease_s, admits)

    async def aclose(self) -> None:
        """Wait for every queued call, close the store, then stop the worker thread."""
        try:
            await self._call(self._store.close)
        finally:
            # The close above ran last on the only worker, so this join is immediate.
            self._executor.shutdown(wait=True)
        logger.debug("async store closed")


class AsyncLeases:
    """Async twin of `Leases` (`astore.leases`), on the store's worker."""

    def __init__(self, leases: Leases, call: Call) -> None:
        self._leases = leases
        self._call = call

    async def acquire(self, session_id: str, owner: str, lease_s: float) -> Lease | None:
        """See `Leases.acquire`."""
        return await self._call(self._leases.acquire, session_id, owner, lease_s)

    async def renew(self, lease: Lease) -> bool:
        """See `Leases.renew`."""
        return await self._call(self._leases.renew, lease)

    async def release(self, lease: Lease) -> bool:
        """See `Leases.release`."""
        return await self._call(self._leases.release, lease)

    async def get(self, session_id: str) -> Lease | None:
        """See `Leases.get`."""
        return await self._call(self._leases.get, session_id)


class AsyncRegistry:
    """Async twin of `Registry` (`astore.daemons`), on the store's worker."""

    def __init__(self, registry: Registry, call: Call) -> None:
        self._registry = registry
        self._call = call

    async def register(self, daemon_id: str, address: str, sole: bool = False) -> None:
        """See `Registry.register`."""
        await self._call(self._registry.register, daemon_id, address, sole)

    async def heartbeat(self, daemon_id: str) -> bool:
        """See `Registry.heartbeat`."""
        return await self._call(self._registry.heartbeat, daemon_id)

    async def deregister(self, daemon_id: str) -> int:
        """See `Registry.deregister`."""
        return await self._call(self._registry.deregister, daemon_id)

    async def fleet(self, stale_s: float) -> list[DaemonState]:
        """See `Registry.fleet`."""
        return await self._call(self._registry.fleet, stale_s)


def _report_orphaned_failure(job: Future[Any]) -> None:
    """Log the error of a call whose caller was cancelled, since nobody else will see it."""
    if not job.cancelled() and job.exception() is not None:
        logger.error("store call failed after its caller was cancelled", exc_info=job.exception())
