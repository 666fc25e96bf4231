"""ORM models of the durable store: one row per session, one per transcript item.

This module owns the table layout and nothing else. `migrations/versions/`
creates exactly these tables (a test runs `alembic check` to prove it), so a
change here needs a new migration. It must not know how rows are written or
which engine holds them; that is `streamchat.store.store`.

    sessions 1 ──< items      items ordered by (session_id, seq), seq = 0, 1, 2, ...
"""

from __future__ import annotations

import datetime as dt
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


class Base(DeclarativeBase):
    """Declarative base holding the store's metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SessionRow(Base):
    """A conversation: its hashed resume token, system prompt, settings and counters."""

    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_last_active_at", "last_active_at"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64))  # hex sha256, never the token
    instructions: Mapped[str] = mapped_column(Text)
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
        String(ID_LENGTH), ForeignKey("sessions.id", ondelete="CASCADE"), index=True
    )
    seq: Mapped[int] = mapped_column(Integer)
    item_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    role: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    kind: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    text: Mapped[str] = mapped_column(Text)
    num_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(STATUS_LENGTH))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
