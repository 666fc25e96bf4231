"""ORM models of the durable store: sessions, transcript items, session leases, daemons.

This module owns the table layout and the column types, nothing else.
`migrations/versions/` creates exactly these tables (a test runs `alembic
check` on SQLite and on PostgreSQL to prove it), so a change here needs a new
migration. It must not know how rows are written or which engine holds them;
that is `streamchat.store.store`, `.leases` and `.registry`.

    sessions 1 ──< items            items ordered by (session_id, seq), seq = 0, 1, 2, ...
    sessions 1 ──o session_leases   at most one lease row per session, kept for good (its epoch)
    daemons                         one row per daemon id; leases name their owner by that id
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names, so later (batch) migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 128
STATUS_LENGTH = 16


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite keeps no offset, so values are normalised to UTC on the way in and
    tagged UTC on the way out; PostgreSQL stores `timestamptz` natively.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}; the store keeps aware UTC datetimes")
        return value.astimezone(dt.timezone.utc)

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


_ESC = "\x01"
_UNESCAPE = re.compile("\x01(.)", re.DOTALL)


class AnyString(TypeDecorator[str]):
    """A string that may hold any code point, NUL included, on every backend.

    SQLite keeps NUL; PostgreSQL refuses it in text. There each NUL is stored
    as ESC "0" and each ESC as ESC ESC (ESC = U+0001). The mapping is per
    character, so SQL concatenation of stored forms (`text || piece`) is the
    stored form of the concatenation, and equality and uniqueness are
    unchanged. Strings without NUL or U+0001 are stored as they are.
    """

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None or dialect.name != "postgresql":
            return value
        return value.replace(_ESC, _ESC + _ESC).replace("\x00", _ESC + "0")

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None or dialect.name != "postgresql" or _ESC not in value:
            return value
        return _UNESCAPE.sub(lambda m: "\x00" if m.group(1) == "0" else m.group(1), value)


class AnyText(AnyString):
    """`AnyString` over TEXT: no length limit on any backend."""

    impl = Text
    cache_ok = True


# A client chooses item ids (up to the protocol's own limit). SQLite never
# enforced VARCHAR(128); PostgreSQL does, so there the column is TEXT (0002).
ITEM_ID_TYPE = AnyString(ID_LENGTH).with_variant(AnyText(), "postgresql")


class Base(DeclarativeBase):
    """Declarative base holding the store's metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SessionRow(Base):
    """A conversation: its hashed resume token, system prompt, settings and counters."""

    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_last_active_at", "last_active_at"),)

    id: Mapped[str] = mapped_column(AnyString(ID_LENGTH), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64))  # hex sha256, never the token
    instructions: Mapped[str] = mapped_column(AnyText)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)
    total_tokens: Mapped[int] = mapped_column(Integer)
    evicted_tokens: Mapped[int] = mapped_column(Integer)
    num_items: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    last_active_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(STATUS_LENGTH))


class ItemRow(Base):
    """One transcript entry: a message, an append or a response, in session order."""

    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint("session_id", "seq"),
        UniqueConstraint("session_id", "item_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        AnyString(ID_LENGTH), ForeignKey("sessions.id", ondelete="CASCADE"), index=True
    )
    seq: Mapped[int] = mapped_column(Integer)
    item_id: Mapped[str] = mapped_column(ITEM_ID_TYPE)
    role: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    kind: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    text: Mapped[str] = mapped_column(AnyText)
    num_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class LeaseRow(Base):
    """Which daemon serves a session, under which epoch, until when.

    The row outlives its lease (a release only ends `expires_at`), so epochs
    only ever grow and a write fenced by an old epoch stays refused.
    """

    __tablename__ = "session_leases"
    __table_args__ = (Index("ix_session_leases_owner", "owner"),)

    session_id: Mapped[str] = mapped_column(
        AnyString(ID_LENGTH), ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    owner: Mapped[str] = mapped_column(AnyString(ID_LENGTH))  # a daemon id
    epoch: Mapped[int] = mapped_column(Integer)  # 1 for the first owner, +1 at every change of owner
    acquired_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)  # when this owner took it
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class DaemonRow(Base):
    """A daemon of the fleet: where it listens, when it started, when it last said it was alive."""

    __tablename__ = "daemons"

    id: Mapped[str] = mapped_column(AnyString(ID_LENGTH), primary_key=True)
    address: Mapped[str] = mapped_column(AnyText)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(STATUS_LENGTH))  # "up" or "stopped"
