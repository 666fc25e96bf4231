"""One transaction per store call, with the database's failures translated.

Shared by the store's parts (`store`, `leases`, `registry`), each of which
owns its tables and calls these for every call it makes. Knows nothing of
any table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import Insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from streamchat.store.errors import translate_errors

# The INSERT constructs with ON CONFLICT ... DO UPDATE ... WHERE (an atomic
# compare-and-set on one row), which both backends spell the same way.
_UPSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


@contextlib.contextmanager
def write(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction, committed on success and rolled back on any error, with errors translated."""
    # translate_errors is outermost: a failed COMMIT is translated too, and
    # only once the rollback has run, so a StoreError means "nothing changed".
    with translate_errors(), sessions.begin() as db:
        yield db


@contextlib.contextmanager
def read(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A read-only ORM session (rolled back on close), with errors translated."""
    with translate_errors(), sessions() as db:
        yield db


def upsert(dialect: str, table: type) -> Insert:
    """An INSERT into `table` that takes `.on_conflict_do_update(...)`; SQLite and PostgreSQL only."""
    insert = _UPSERTS.get(dialect)
    if insert is None:
        raise NotImplementedError(f"session leases and the daemon registry need SQLite or PostgreSQL, not {dialect}")
    return insert(table)
