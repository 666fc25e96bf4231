"""The daemon registry: which daemons make up the fleet, whether they are alive, what they hold.

A daemon registers at start (`register`: its id and the address it serves
on), says it is alive every heartbeat interval (`heartbeat`) and signs off
at shutdown (`deregister`, which also ends every lease it still holds, so
its sessions move at once rather than after `--lease-s`). `fleet()` is the
operator's view: every daemon with its state and the sessions it holds a
live lease on. Owns the `daemons` table; reads `session_leases`, never
writes a lease except to end a deregistered daemon's leases.

Time is the store's clock, as for leases (see `streamchat.store.leases`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Callable

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from streamchat.store import transaction
from streamchat.store.models import DaemonRow, LeaseRow

logger = logging.getLogger(__name__)

Clock = Callable[[], dt.datetime]
UP, STOPPED = "up", "stopped"  # DaemonRow.status
# DaemonState.state: heartbeats on time; none for more than stale_s; signed off;
# or a lease owner with no registry row (a daemon that never registered).
LIVE, STALE, UNREGISTERED = "live", "stale", "unregistered"
_NO_SYNC = {"synchronize_session": False}


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonState:
    """One daemon as `fleet()` sees it; `sessions` are those it holds an unexpired lease on, sorted."""

    id: str
    address: str | None  # None for UNREGISTERED
    state: str  # LIVE, STALE, STOPPED or UNREGISTERED
    started_at: dt.datetime | None
    heartbeat_at: dt.datetime | None
    sessions: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict, times as ISO 8601 strings."""
        data = dataclasses.asdict(self)
        for name in ("started_at", "heartbeat_at"):
            data[name] = None if data[name] is None else data[name].isoformat()
        data["sessions"] = list(self.sessions)
        return data


class Registry:
    """register, heartbeat, deregister and list daemons; `store.daemons` of a `Store`."""

    def __init__(self, sessions: sessionmaker[Session], dialect: str, clock: Clock) -> None:
        self._sessions = sessions
        self._dialect = dialect
        self._clock = clock

    def register(self, daemon_id: str, address: str, sole: bool = False) -> None:
        """Record `daemon_id` as up at `address`, started and heard from now (again, if it ran before).

        `sole`: this daemon is the store's only one (SQLite: one daemon per file), so any other daemon
        still marked up is a killed predecessor: it is marked stopped and its leases end at once, and the
        sessions it held resume here without waiting out --lease-s.
        """
        now = self._clock()
        statement = transaction.upsert(self._dialect, DaemonRow).values(
            id=daemon_id, address=address, started_at=now, heartbeat_at=now, status=UP
        )
        fresh = statement.excluded
        statement = statement.on_conflict_do_update(
            index_elements=[DaemonRow.id],
            set_={"address": fresh.address, "started_at": fresh.started_at,
                  "heartbeat_at": fresh.heartbeat_at, "status": fresh.status},
        )
        with transaction.write(self._sessions) as db:
            db.execute(statement)
            if sole:
                others = DaemonRow.id != daemon_id
                db.execute(update(DaemonRow).where(others, DaemonRow.status == UP).values(status=STOPPED),
                           execution_options=_NO_SYNC)
                taken = db.execute(update(LeaseRow).where(LeaseRow.owner != daemon_id, LeaseRow.expires_at > now)
                                   .values(expires_at=now), execution_options=_NO_SYNC).rowcount
                if taken:
                    logger.info("daemon %s is this store's only one: %d leases of earlier daemons ended",
                                daemon_id, taken)
        logger.info("daemon %s registered at %s", daemon_id, address)

    def heartbeat(self, daemon_id: str) -> bool:
        """Mark `daemon_id` alive now; False if it is not registered or has deregistered (register again)."""
        statement = (
            update(DaemonRow)
            .where(DaemonRow.id == daemon_id, DaemonRow.status == UP)
            .values(heartbeat_at=self._clock())
        )
        with transaction.write(self._sessions) as db:
            return db.execute(statement, execution_options=_NO_SYNC).rowcount == 1

    def deregister(self, daemon_id: str) -> int:
        """Mark `daemon_id` stopped and end every lease it still holds, in one transaction; how many it held."""
        now = self._clock()
        stop = update(DaemonRow).where(DaemonRow.id == daemon_id).values(status=STOPPED, heartbeat_at=now)
        free = (
            update(LeaseRow)
            .where(LeaseRow.owner == daemon_id, LeaseRow.expires_at > now)
            .values(expires_at=now)
        )
        with transaction.write(self._sessions) as db:
            db.execute(stop, execution_options=_NO_SYNC)
            released = db.execute(free, execution_options=_NO_SYNC).rowcount
        logger.info("daemon %s deregistered; %d leases released", daemon_id, released)
        return released

    def fleet(self, stale_s: float) -> list[DaemonState]:
        """Every daemon, sorted by id, LIVE if heard from in the last `stale_s` seconds.

        Owners of unexpired leases that never registered are listed too, as UNREGISTERED.
        """
        now = self._clock()
        held = (
            select(LeaseRow.owner, LeaseRow.session_id)
            .where(LeaseRow.expires_at > now)
            .order_by(LeaseRow.owner, LeaseRow.session_id)
        )
        with transaction.read(self._sessions) as db:
            rows = {row.id: _Daemon.from_row(row) for row in db.scalars(select(DaemonRow))}
            sessions: dict[str, list[str]] = {}
            for owner, session_id in db.execute(held):
                sessions.setdefault(owner, []).append(session_id)
        fleet = [rows[d].state(now, stale_s, sessions.get(d, [])) for d in rows]
        fleet += [DaemonState(owner, None, UNREGISTERED, None, None, tuple(ids))
                  for owner, ids in sessions.items() if owner not in rows]
        return sorted(fleet, key=lambda d: d.id)


@dataclasses.dataclass(frozen=True, slots=True)
class _Daemon:
    """A registry row copied out of its transaction."""

    id: str
    address: str
    status: str
    started_at: dt.datetime
    heartbeat_at: dt.datetime

    @classmethod
    def from_row(cls, row: DaemonRow) -> _Daemon:
        return cls(row.id, row.address, row.status, row.started_at, row.heartbeat_at)

    def state(self, now: dt.datetime, stale_s: float, sessions: list[str]) -> DaemonState:
        if self.status != UP:
            state = STOPPED
        else:
            state = LIVE if now - self.heartbeat_at <= dt.timedelta(seconds=stale_s) else STALE
        return DaemonState(self.id, self.address, state, self.started_at, self.heartbeat_at, tuple(sessions))
