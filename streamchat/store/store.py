"""The durable store: sessions and their transcripts, one short transaction per call.

A `Store` also carries the fleet's parts, on the same engine and clock:
`store.leases` (`streamchat.store.leases.Leases`) and `store.daemons`
(`streamchat.store.registry.Registry`). Every write made on behalf of a
session (`update_session`, `add_item`, `append_text`, `finish_item`) takes an
optional `epoch`: given, the write is fenced by the session's lease and
refused with StoreError `lease_lost`, changing nothing, once a newer epoch
exists; None (one daemon, no leases) writes unconditionally.

Every method commits before it returns, so a caller that acknowledges a write
after the call has acknowledged a committed (and, on SQLite, fsynced) row.
Methods are synchronous and blocking; the event loop reaches them only
through `streamchat.store.async_store.AsyncStore`. The store knows nothing of
the protocol beyond the ids and words it is handed, nor of the engine or the
KV cache. The schema comes only from `migrate()`.

Failures: a database that cannot serve a call (locked, read-only, full, I/O
error) and a client item id already in use raise `StoreError` with a code,
after the call's transaction has been rolled back, so the content is exactly
as before. Misuse (unknown ids, bad words, a duplicate session id) keeps its
own exceptions from `records`. Every call runs in `_write()` or `_read()`,
which is where the translation is applied.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from streamchat.store import transaction
from streamchat.store.database import make_engine
from streamchat.store.errors import translate_errors
from streamchat.store.leases import Lease, Leases, fence
from streamchat.store.migrate import check_writable, upgrade_to_head
from streamchat.store.models import ItemRow, SessionRow
from streamchat.store.records import (
    FINAL_STATUSES,
    ITEM_STATUSES,
    KINDS,
    OPEN_STATUS,
    ROLES,
    SESSION_STATUSES,
    DuplicateId,
    ItemNotOpen,
    ItemRecord,
    SessionRecord,
    UnknownItem,
    UnknownSession,
    check_count,
    check_word,
)
from streamchat.store.registry import Registry

logger = logging.getLogger(__name__)

Clock = Callable[[], dt.datetime]
_NO_SYNC = {"synchronize_session": False}  # bulk UPDATEs; no ORM objects to refresh


def utc_now() -> dt.datetime:
    """The current time as an aware UTC datetime."""
    return dt.datetime.now(dt.timezone.utc)


class Store:
    """Sessions and transcript items in any SQLAlchemy database (SQLite by default)."""

    def __init__(self, url: str, *, clock: Clock = utc_now) -> None:
        self._engine = make_engine(url)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._clock = clock
        dialect = self._engine.dialect.name
        self.leases = Leases(self._sessions, dialect, clock)
        self.daemons = Registry(self._sessions, dialect, clock)

    @property
    def engine(self) -> Engine:
        """The underlying engine (for migrations and tests)."""
        return self._engine

    def migrate(self) -> None:
        """Bring the schema to the newest revision (`alembic upgrade head`), then prove it takes writes.

        StoreError (store_unavailable) for a database that cannot be opened,
        migrated or written, so a read-only file fails at start-up, not at the first write.
        """
        with translate_errors():
            upgrade_to_head(self._engine)
            check_writable(self._engine)

    def close(self) -> None:
        """Close every pooled connection; the store is unusable afterwards."""
        self._engine.dispose()
        logger.debug("store closed: %s", self._engine.url)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _write(self, session_id: str | None = None, epoch: int | None = None) -> Iterator[Session]:
        """`transaction.write`, fenced first by `epoch` when one is given for `session_id`."""
        with transaction.write(self._sessions) as db:
            if epoch is not None:
                assert session_id is not None
                fence(db, session_id, epoch)
            yield db

    def _read(self) -> contextlib.AbstractContextManager[Session]:
        """`transaction.read`."""
        return transaction.read(self._sessions)

    # -- sessions ---------------------------------------------------------

    def create_session(
        self, session_id: str, token_hash: str, instructions: str, settings: Mapping[str, Any]
    ) -> None:
        """Insert an active session with zeroed counters; DuplicateId if the id is taken."""
        now = self._clock()
        row = SessionRow(
            id=session_id,
            token_hash=token_hash,
            instructions=instructions,
            settings=dict(settings),
            total_tokens=0,
            evicted_tokens=0,
            num_items=0,
            created_at=now,
            last_active_at=now,
            status="active",
        )
        try:
            with self._write() as db:
                db.add(row)
        except IntegrityError as exc:
            raise DuplicateId(f"session {session_id!r} already exists") from exc
        logger.info("session %s created", session_id)

    def get_session(self, session_id: str) -> SessionRecord | None:
        """The committed session, or None if there is none with this id."""
        with self._read() as db:
            row = db.get(SessionRow, session_id)
            return None if row is None else SessionRecord.from_row(row)

    def update_session(
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
        """Replace the given fields (None leaves one as is) and bump last_active_at; fenced by `epoch`."""
        values: dict[str, Any] = {"last_active_at": self._clock()}
        if instructions is not None:
            values["instructions"] = instructions
        if settings is not None:
            values["settings"] = dict(settings)
        if status is not None:
            check_word("status", status, SESSION_STATUSES)
            values["status"] = status
        for name, count in (("total_tokens", total_tokens), ("evicted_tokens", evicted_tokens)):
            if count is not None:
                check_count(name, count)
                values[name] = count
        statement = update(SessionRow).where(SessionRow.id == session_id).values(**values)
        with self._write(session_id, epoch) as db:
            if db.execute(statement, execution_options=_NO_SYNC).rowcount == 0:
                raise UnknownSession(session_id)

    def list_sessions(self, limit: int = 100) -> list[SessionRecord]:
        """Up to `limit` sessions, most recently active first."""
        check_count("limit", limit)
        query = select(SessionRow).order_by(SessionRow.last_active_at.desc(), SessionRow.id).limit(limit)
        with self._read() as db:
            return [SessionRecord.from_row(row) for row in db.scalars(query)]

    # -- items ------------------------------------------------------------

    def add_item(
        self, session_id: str, item_id: str, role: str, kind: str, text: str, status: str, num_tokens: int,
        *, epoch: int | None = None,
    ) -> ItemRecord:
        """Append an item at the next seq; bumps the session's num_items and last_active_at.

        StoreError (item_id_in_use) if the session already has an item with this id;
        fenced by `epoch`.
        """
        check_word("role", role, ROLES)
        check_word("kind", kind, KINDS)
        check_word("status", status, ITEM_STATUSES)
        check_count("num_tokens", num_tokens)
        now = self._clock()
        with self._write(session_id, epoch) as db:
            row = ItemRow(
                session_id=session_id,
                seq=_take_seq(db, session_id, now),
                item_id=item_id,
                role=role,
                kind=kind,
                text=text,
                num_tokens=num_tokens,
                status=status,
                created_at=now,
                updated_at=now,
            )
            db.add(row)
            db.flush()
            return ItemRecord.from_row(row)

    def append_text(
        self, session_id: str, item_id: str, text: str, num_tokens_added: int, *, epoch: int | None = None
    ) -> None:
        """Append `text` to an in-progress item in one UPDATE; ItemNotOpen once it is finished; fenced by `epoch`."""
        check_count("num_tokens_added", num_tokens_added)
        statement = (
            update(ItemRow)
            .where(ItemRow.session_id == session_id, ItemRow.item_id == item_id, ItemRow.status == OPEN_STATUS)
            .values(
                text=ItemRow.text + text,
                num_tokens=ItemRow.num_tokens + num_tokens_added,
                updated_at=self._clock(),
            )
        )
        with self._write(session_id, epoch) as db:
            if db.execute(statement, execution_options=_NO_SYNC).rowcount == 0:
                _explain_miss(db, session_id, item_id)

    def finish_item(
        self,
        session_id: str,
        item_id: str,
        *,
        text: str | None = None,
        status: str,
        num_tokens: int | None = None,
        epoch: int | None = None,
    ) -> None:
        """Give an in-progress item its final status, and optionally its final text and count; fenced by `epoch`."""
        check_word("status", status, FINAL_STATUSES)
        values: dict[str, Any] = {"status": status, "updated_at": self._clock()}
        if text is not None:
            values["text"] = text
        if num_tokens is not None:
            check_count("num_tokens", num_tokens)
            values["num_tokens"] = num_tokens
        statement = (
            update(ItemRow)
            .where(ItemRow.session_id == session_id, ItemRow.item_id == item_id, ItemRow.status == OPEN_STATUS)
            .values(**values)
        )
        with self._write(session_id, epoch) as db:
            if db.execute(statement, execution_options=_NO_SYNC).rowcount == 0:
                _explain_miss(db, session_id, item_id)

    def items(self, session_id: str) -> list[ItemRecord]:
        """Every item of the session in seq order."""
        with self._read() as db:
            records = _item_records(db, session_id)
            if not records and db.get(SessionRow, session_id) is None:
                raise UnknownSession(session_id)
            return records

    def session_with_items(self, session_id: str) -> tuple[SessionRecord, list[ItemRecord]]:
        """The committed session and its items in seq order, as one transaction saw them (a save's mark
        reads both: one read instead of two); UnknownSession if there is no such session."""
        with self._read() as db:
            row = db.get(SessionRow, session_id)
            if row is None:
                raise UnknownSession(session_id)
            return SessionRecord.from_row(row), _item_records(db, session_id)

    def take_session(self, session_id: str, owner: str, lease_s: float,
                     admits: Callable[[SessionRecord], bool]) -> tuple[Lease, SessionRecord, list[ItemRecord]] | None:
        """A resume's store work in one write transaction: take the session's lease for `owner` (as
        `leases.acquire`), then read the session and its items under it, so no earlier holder's write
        can land between them. UnknownSession, with nothing changed, if there is no such session or
        `admits(session)` is false (a wrong resume token takes no lease and learns nothing); None
        while another owner's lease runs. One commit and one trip to the store's thread, where a
        read, the lease and a second read took three."""
        try:
            with self._write() as db:
                lease = self.leases.acquire_in(db, session_id, owner, lease_s)
                row = db.get(SessionRow, session_id)
                record = None if row is None else SessionRecord.from_row(row)
                if record is None or not admits(record):
                    raise _NotAdmitted  # rolled back: the lease is not taken
                return None if lease is None else (lease, record, _item_records(db, session_id))
        except (IntegrityError, _NotAdmitted):  # IntegrityError: the lease row's foreign key
            raise UnknownSession(session_id) from None


class _NotAdmitted(Exception):
    """take_session: the session may not be taken; its transaction rolls back."""


def _item_records(db: Session, session_id: str) -> list[ItemRecord]:
    query = select(ItemRow).where(ItemRow.session_id == session_id).order_by(ItemRow.seq)
    return [ItemRecord.from_row(row) for row in db.scalars(query)]


def _take_seq(db: Session, session_id: str, now: dt.datetime) -> int:
    """Bump the session's num_items and last_active_at; return the seq for its new item."""
    # Write first: the UPDATE takes the write lock (SQLite) or the row lock
    # (PostgreSQL) before num_items is read, so two writers never share a seq.
    bump = (
        update(SessionRow)
        .where(SessionRow.id == session_id)
        .values(num_items=SessionRow.num_items + 1, last_active_at=now)
    )
    if db.execute(bump, execution_options=_NO_SYNC).rowcount == 0:
        raise UnknownSession(session_id)
    num_items = db.scalar(select(SessionRow.num_items).where(SessionRow.id == session_id))
    assert num_items is not None
    return num_items - 1


def _explain_miss(db: Session, session_id: str, item_id: str) -> NoReturn:
    """Raise the reason an item UPDATE matched no row (runs only on that path)."""
    status = db.scalar(select(ItemRow.status).where(ItemRow.session_id == session_id, ItemRow.item_id == item_id))
    if status is not None:
        raise ItemNotOpen(f"item {item_id!r} of session {session_id!r} is {status}, not {OPEN_STATUS}")
    if db.scalar(select(SessionRow.id).where(SessionRow.id == session_id)) is None:
        raise UnknownSession(session_id)
    raise UnknownItem(session_id, item_id)
