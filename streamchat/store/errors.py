"""The one error the store raises for failures that are not the caller's fault.

`StoreError.code` is a plain word a server can hand to its client:

    item_id_in_use      a client-chosen item id already exists in that session
                        (the UNIQUE (session_id, item_id) constraint of `items`)
    store_unavailable   the database cannot serve the call now; by SQLite
                        primary result code: BUSY, LOCKED (locked), READONLY,
                        FULL, IOERR, CANTOPEN, PROTOCOL, PERM, CORRUPT, NOTADB;
                        any connection the driver reports lost; a pool timeout;
                        on PostgreSQL (and other backends), any OperationalError
                        (connection lost, shut down, disk full, lock timeout,
                        deadlock, ...) and the SQLSTATEs in PG_UNAVAILABLE
                        (a read-only transaction, corrupt data), which the
                        driver files under other classes
    lease_lost          a write carried a session lease's epoch, and a newer
                        epoch exists: another daemon took the session over
                        (raised by `streamchat.store.leases`, never mapped here)

Everything else (SQL the store got wrong, a missing table, other constraint
violations) is a programming error and is left as SQLAlchemy raised it.
`translate_errors` is the only place this mapping is applied; this module
knows nothing of sessions, items or the ORM.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterator

from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

logger = logging.getLogger(__name__)

ITEM_ID_IN_USE = "item_id_in_use"
STORE_UNAVAILABLE = "store_unavailable"
LEASE_LOST = "lease_lost"
CODES = frozenset({ITEM_ID_IN_USE, STORE_UNAVAILABLE, LEASE_LOST})

# Primary SQLite result codes (the low byte of an extended code) that mean
# "the database cannot serve this now", never "the call was wrong".
SQLITE_UNAVAILABLE = {
    3: "SQLITE_PERM",
    5: "SQLITE_BUSY",
    6: "SQLITE_LOCKED",
    8: "SQLITE_READONLY",
    10: "SQLITE_IOERR",
    11: "SQLITE_CORRUPT",
    13: "SQLITE_FULL",
    14: "SQLITE_CANTOPEN",
    15: "SQLITE_PROTOCOL",
    26: "SQLITE_NOTADB",
}
# PostgreSQL SQLSTATEs that mean "cannot serve this now" but that psycopg does
# not raise as OperationalError (those all count already).
PG_UNAVAILABLE = {
    "25006": "read_only_sql_transaction",  # a hot standby, or default_transaction_read_only
    "25P03": "idle_in_transaction_session_timeout",  # the server closed the connection
    "XX001": "data_corrupted",
    "XX002": "index_corrupted",
}
# How the items (session_id, item_id) constraint names itself: SQLite, then
# PostgreSQL (the name `models.NAMING_CONVENTION` gives it).
_ITEM_ID_CONSTRAINT = ("items.session_id, items.item_id", "uq_items_session_id_item_id")


class StoreError(Exception):
    """The store could not do what was asked; `code` says why, the message says it to a person."""

    def __init__(self, code: str, message: str) -> None:
        assert code in CODES, code
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Re-raise the failures listed above as StoreError; let anything else through unchanged."""
    try:
        yield
    except (DBAPIError, PoolTimeout) as exc:
        error = classify(exc)
        if error is None:
            raise
        log = logger.info if error.code == ITEM_ID_IN_USE else logger.warning
        log("store call failed (%s): %s", error.code, _reason(exc))
        raise error from exc


def classify(exc: DBAPIError | PoolTimeout) -> StoreError | None:
    """The StoreError `exc` stands for, or None if it is a programming error."""
    if isinstance(exc, PoolTimeout) or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
        return _unavailable(exc)
    if isinstance(exc, IntegrityError):
        text = str(exc.orig)
        if any(name in text for name in _ITEM_ID_CONSTRAINT):
            return StoreError(ITEM_ID_IN_USE, "an item with this id already exists in this session")
        return None
    if isinstance(exc.orig, sqlite3.Error):
        return _unavailable(exc) if _sqlite_primary_code(exc.orig) in SQLITE_UNAVAILABLE else None
    if getattr(exc.orig, "sqlstate", None) in PG_UNAVAILABLE:
        return _unavailable(exc)
    return _unavailable(exc) if isinstance(exc, OperationalError) else None


def _sqlite_primary_code(error: sqlite3.Error) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)  # set by the driver since Python 3.11
    return None if code is None else code & 0xFF


def _unavailable(exc: Exception) -> StoreError:
    return StoreError(STORE_UNAVAILABLE, f"the store is unavailable: {_reason(exc)}")


def _reason(exc: Exception) -> str:
    """The driver's own words, first line only (SQLAlchemy appends the SQL and a link)."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
