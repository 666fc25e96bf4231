"""This daemon's place in a fleet: its registry entry and heartbeat, and the leases of its sessions.

Owns the daemon's registration (at start; a heartbeat every --heartbeat-s;
signed off at shutdown, which ends every lease it still holds), the lease of
each session it holds (taken with a compare-and-set when a session is
created or comes back from the store, renewed with the heartbeat while the
session is in memory, released when it leaves memory), and `FencedStore`,
the view of the store the hub writes through: every write made for a
session carries the epoch of its lease, so once another daemon has taken
the session over the write is refused (`lease_lost`) and this daemon lets
the session go (`on_lost`, wired by the daemon to `drop_lost`).

On SQLite with one daemon the same code runs and always wins. Knows nothing
of the engine or of frames beyond the hooks the daemon hands it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

from streamchat.config import FleetConfig
from streamchat.store import StoreError
from streamchat.store.errors import LEASE_LOST
from streamchat.store.leases import Lease
from streamchat.store.records import ItemRecord, SessionRecord

log = logging.getLogger(__name__)


class SessionLeased(Exception):
    """Another daemon holds the session's lease (or this one is letting the session go): retry."""

    code = "session_leased"

    def __init__(self, session_id: str, lease: Lease | None) -> None:
        if lease is None:
            why = "this daemon is handing it over; resume it again"
        else:
            left = max(0.0, (lease.expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds())
            why = (f"daemon {lease.owner} serves it (lease epoch {lease.epoch}, {left:.1f} s left unless renewed); "
                   f"connect with ?session_id={session_id} so the proxy routes you there, or resume it "
                   "again once that daemon is gone")
        super().__init__(f"session {session_id} is held by another daemon: {why}")


class Fleet:
    """The daemon's id, registration and session leases (`daemon.fleet`)."""

    def __init__(self, store, cfg: FleetConfig) -> None:
        self.store = store  # the AsyncStore
        self.cfg = cfg
        self.id = cfg.daemon_id
        self.leases: dict[str, Lease] = {}  # session id -> the lease this daemon holds on it
        self.on_lost: Callable[[str, str], None] = lambda session_id, why: None
        self.in_use: Callable[[str], bool] = lambda session_id: True  # whether a held session is still wanted
        self.num_lost = 0
        self.address = ""  # host:port, once listening
        self.stopped = False
        self._task: asyncio.Task | None = None

    # -- the registry ---------------------------------------------------------------

    async def start(self, address: str) -> None:
        """Register at `address` and start the heartbeat. On SQLite this daemon is the store's only one: a
        killed predecessor's leases end now, so a restart resumes its sessions at once."""
        self.address = address
        await self.store.daemons.register(self.id, address, sole=self.store.dialect == "sqlite")
        self._task = asyncio.create_task(self._beat_loop())

    async def stop(self) -> None:
        """Stop the heartbeat and sign off: every lease still held ends now, so the sessions move at once."""
        self.stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            released = await self.store.daemons.deregister(self.id)
            log.info("daemon %s signed off from the registry; %d session leases released", self.id, released)
        except StoreError as exc:
            log.warning("could not sign off from the registry (%s); this daemon's leases expire in %g s",
                        exc, self.cfg.lease_s)
        self.leases.clear()

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)  # a period, not a wait for a condition
            try:
                await self.beat()
            except Exception:
                log.exception("heartbeat failed; retrying in %g s", self.cfg.heartbeat_s)

    async def beat(self) -> None:
        """Say this daemon lives; renew every lease it still wants, release the others."""
        if not await self.store.daemons.heartbeat(self.id):
            log.warning("daemon %s was not registered as up; registering again", self.id)
            await self.store.daemons.register(self.id, self.address)
        for session_id in list(self.leases):
            if self.in_use(session_id):
                await self.confirm(session_id)
            else:
                await self.release(session_id)

    # -- leases ---------------------------------------------------------------------

    def epoch_of(self, session_id: str) -> int | None:
        """The epoch of this daemon's lease on the session, or None if it holds none."""
        lease = self.leases.get(session_id)
        return None if lease is None else lease.epoch

    def holds(self, session_id: str) -> bool:
        return session_id in self.leases

    async def take(self, session_id: str) -> Lease:
        """Take the session's lease (compare-and-set); SessionLeased while another daemon's runs."""
        return await self._hold(session_id, await self.store.leases.acquire(session_id, self.id, self.cfg.lease_s))

    async def take_session(self, session_id: str,
                           admits: Callable[[SessionRecord], bool]) -> tuple[SessionRecord, list[ItemRecord]]:
        """Take the session's lease and read it and its items under the lease, in one store call
        (`Store.take_session`); UnknownSession if there is none or `admits(session)` is false, SessionLeased
        while another daemon's lease runs."""
        got = await self.store.take_session(session_id, self.id, self.cfg.lease_s, admits)
        lease, record, items = got if got is not None else (None, None, [])
        await self._hold(session_id, lease)
        return record, items

    async def _hold(self, session_id: str, lease: Lease | None) -> Lease:
        if lease is None:
            raise SessionLeased(session_id, await self.store.leases.get(session_id))
        self.leases[session_id] = lease
        log.info("session %s: lease taken at epoch %d", session_id, lease.epoch,
                 extra={"session_id": session_id, "epoch": lease.epoch})
        return lease

    async def confirm(self, session_id: str) -> bool:
        """Renew the session's lease; True while this daemon still holds it under the same epoch.

        A lease that lapsed unseen (the store was out of reach, the daemon paused) is taken
        again if nobody took it meanwhile; otherwise the session is lost (`on_lost`).
        """
        lease = self.leases.get(session_id)
        if lease is None:
            return False
        if await self.store.leases.renew(lease):
            return True
        again = await self.store.leases.acquire(session_id, self.id, self.cfg.lease_s)
        if again is not None and again.epoch == lease.epoch:
            self.leases[session_id] = again
            return True
        if again is not None:  # taken and let go by another daemon since: its writes are newer than our memory
            await self.store.leases.release(again)
        self.lost(session_id, f"its lease (epoch {lease.epoch}) lapsed and another daemon took the session over")
        return False

    async def release(self, session_id: str) -> None:
        """Let the session go: any daemon may take it at once."""
        lease = self.leases.pop(session_id, None)
        if lease is None:
            return
        try:
            await self.store.leases.release(lease)
        except StoreError as exc:
            log.warning("session %s: lease not released (%s); it expires in %g s", session_id, exc, self.cfg.lease_s)

    def lost(self, session_id: str, why: str) -> None:
        """Another daemon took the session over: stop serving it (the daemon's `on_lost`)."""
        if self.leases.pop(session_id, None) is None:
            return
        self.num_lost += 1
        log.warning("session %s: %s; this daemon stops serving it", session_id, why,
                    extra={"session_id": session_id})
        self.on_lost(session_id, why)


class FencedStore:
    """The store as the hub sees it: each write for a session carries this daemon's lease epoch on it.

    Reads pass through. Creating a session takes its lease (a new id: always won).
    A write for a session this daemon holds no lease on, or one a newer epoch
    has superseded, is refused with StoreError `lease_lost` and changes nothing.
    """

    def __init__(self, store, fleet: Fleet) -> None:
        self._store = store
        self._fleet = fleet

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    async def create_session(self, session_id: str, *args, **kwargs) -> None:
        await self._store.create_session(session_id, *args, **kwargs)
        await self._fleet.take(session_id)

    async def update_session(self, session_id: str, **kwargs) -> None:
        await self._fenced(self._store.update_session, session_id, **kwargs)

    async def add_item(self, session_id: str, *args, **kwargs):
        return await self._fenced(self._store.add_item, session_id, *args, **kwargs)

    async def append_text(self, session_id: str, *args, **kwargs) -> None:
        await self._fenced(self._store.append_text, session_id, *args, **kwargs)

    async def finish_item(self, session_id: str, *args, **kwargs) -> None:
        await self._fenced(self._store.finish_item, session_id, *args, **kwargs)

    async def _fenced(self, write, session_id: str, *args, **kwargs):
        epoch = self._fleet.epoch_of(session_id)
        if epoch is None:
            raise StoreError(LEASE_LOST, f"this daemon holds no lease on session {session_id}; "
                                         "reconnect and resume it")
        try:
            return await write(session_id, *args, epoch=epoch, **kwargs)
        except StoreError as exc:
            if exc.code == LEASE_LOST:
                self._fleet.lost(session_id, f"a write was refused: {exc}")
            raise


async def drop_lost(daemon, session_id: str, why: str) -> None:
    """The daemon's `on_lost`: tell the session's clients, close their sockets, forget the session here.

    The saved file on the shared disk is kept: it is the new holder's now.
    """
    from streamchat.engine import api

    hub = daemon.hub
    message = (f"session {session_id} moved to another daemon ({why}); reconnect with "
               f"?session_id={session_id} and resume it")
    for conn in list(daemon.connections):
        if conn.session is not None and conn.session.id == session_id:
            await conn.lose_session(message)
    async with hub.restore.id_lock(session_id):
        s = hub.sessions.get(session_id)
        if s is None or daemon.fleet.holds(session_id):  # gone already, or taken back since
            return
        del hub.sessions[session_id]
        if s.epoch != hub.engine.epoch:
            return
        try:
            if s.response_id is not None:
                await hub.submit(api.CancelResponse(session_id), timeout_s=5.0)
            await hub.submit(api.CloseSession(session_id, keep_saved=True))
        except Exception as exc:  # noqa: BLE001 - the session is gone from the front either way
            log.warning("session %s was not closed in the engine: %s", session_id, exc)


def wire(daemon) -> None:
    """Hook the fleet into the daemon: held sessions are those in the hub; lost ones are dropped."""
    fleet, hub = daemon.fleet, daemon.hub

    def in_use(session_id: str) -> bool:
        return session_id in hub.sessions or hub.restore.busy(session_id)

    def on_lost(session_id: str, why: str) -> None:
        task = asyncio.get_running_loop().create_task(drop_lost(daemon, session_id, why))
        daemon.tasks.append(task)
        task.add_done_callback(lambda t: daemon.tasks.remove(t) if t in daemon.tasks else None)

    fleet.in_use, fleet.on_lost = in_use, on_lost
    daemon.metrics.registry.register(_FleetCollector(fleet))


def health(fleet: Fleet) -> dict:
    """What /healthz says about this daemon's place in the fleet."""
    return {"daemon_id": fleet.id, "leases": len(fleet.leases), "leases_lost": fleet.num_lost}


class _FleetCollector:
    """`streamchat_daemon_info{daemon_id=...} 1`, the leases held and the sessions lost to other daemons."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        yield InfoMetricFamily("streamchat_daemon", "This daemon's identity in the fleet",
                               value={"daemon_id": self.fleet.id})
        yield GaugeMetricFamily("streamchat_session_leases", "Session leases this daemon holds",
                                value=len(self.fleet.leases))
        yield CounterMetricFamily("streamchat_session_leases_lost", "Sessions another daemon took over from this one",
                                  value=self.fleet.num_lost)
