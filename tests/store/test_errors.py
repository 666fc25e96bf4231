"""Tests of streamchat.store.errors: which driver errors become which StoreError code, and which stay raw."""

from __future__ import annotations

import sqlite3

import faults
import psycopg.errors as pg
import pytest
from sqlalchemy.exc import DatabaseError, DataError, IntegrityError, InternalError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from streamchat.store import StoreError
from streamchat.store.errors import classify, translate_errors


def _sqlite(cls: type[sqlite3.Error], message: str, code: int) -> sqlite3.Error:
    error = cls(message)
    error.sqlite_errorcode = code
    return error


def _wrapped(orig: BaseException, wrapper: type = OperationalError, **kwargs) -> OperationalError:
    return wrapper("INSERT INTO items ...", {}, orig, **kwargs)


@pytest.mark.parametrize(
    ("orig", "wrapper", "reason"),
    [
        (faults.driver_error("locked"), OperationalError, "database is locked"),  # SQLITE_BUSY
        (_sqlite(sqlite3.OperationalError, "database table is locked", 6), OperationalError,
         "database table is locked"),  # SQLITE_LOCKED
        (faults.driver_error("readonly"), OperationalError, "attempt to write a readonly database"),
        (faults.driver_error("full"), OperationalError, "database or disk is full"),
        (faults.driver_error("ioerr"), OperationalError, "disk I/O error"),  # extended SQLITE_IOERR_FSYNC
        (_sqlite(sqlite3.OperationalError, "unable to open database file", 14), OperationalError,
         "unable to open database file"),
        (_sqlite(sqlite3.DatabaseError, "database disk image is malformed", 11), DatabaseError,
         "database disk image is malformed"),
        (_sqlite(sqlite3.DatabaseError, "file is not a database", 26), DatabaseError, "file is not a database"),
        (RuntimeError("server closed the connection unexpectedly"), OperationalError,
         "server closed the connection unexpectedly"),  # a non-SQLite driver
    ],
)  # fmt: skip
def test_operational_failures_are_store_unavailable(orig, wrapper, reason) -> None:
    """Lock, read-only, full, I/O, open and corruption errors map to store_unavailable with the driver's words."""
    error = classify(_wrapped(orig, wrapper))
    assert (error.code, str(error)) == ("store_unavailable", f"the store is unavailable: {reason}")


@pytest.mark.parametrize(
    ("orig", "wrapper"),
    [
        (pg.DiskFull("could not extend file: No space left on device"), OperationalError),
        (pg.LockNotAvailable("canceling statement due to lock timeout"), OperationalError),
        (pg.DeadlockDetected("deadlock detected"), OperationalError),
        (pg.AdminShutdown("terminating connection due to administrator command"), OperationalError),
        (pg.CannotConnectNow("the database system is starting up"), OperationalError),
        (pg.TooManyConnections("sorry, too many clients already"), OperationalError),
        (pg.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"), InternalError),
        (pg.IdleInTransactionSessionTimeout("terminating connection due to idle-in-transaction timeout"),
         InternalError),
        (pg.DataCorrupted("invalid page in block 0 of relation base/1/2"), InternalError),
    ],
)  # fmt: skip
def test_postgresql_failures_are_store_unavailable(orig, wrapper) -> None:
    """PostgreSQL's full, locked, shut down, read-only and corrupt map to store_unavailable, whatever class psycopg gives."""
    error = classify(_wrapped(orig, wrapper))
    assert (error.code, str(error)) == ("store_unavailable", f"the store is unavailable: {orig}")


def test_lost_connection_and_pool_timeout_are_store_unavailable() -> None:
    """A connection the driver reports lost and a pool timeout both map to store_unavailable."""
    lost = _wrapped(_sqlite(sqlite3.ProgrammingError, "Cannot operate on a closed database.", 21),
                    ProgrammingError, connection_invalidated=True)  # fmt: skip
    assert classify(lost).code == "store_unavailable"
    assert classify(PoolTimeout("QueuePool limit of size 5 overflow 10 reached")).code == "store_unavailable"


@pytest.mark.parametrize(
    "message",
    [
        "UNIQUE constraint failed: items.session_id, items.item_id",  # SQLite
        'duplicate key value violates unique constraint "uq_items_session_id_item_id"',  # PostgreSQL
    ],
)
def test_item_id_constraint_is_item_id_in_use(message: str) -> None:
    """The items (session_id, item_id) constraint, as SQLite or PostgreSQL names it, maps to item_id_in_use."""
    error = classify(_wrapped(_sqlite(sqlite3.IntegrityError, message, 2067), IntegrityError))
    assert (error.code, str(error)) == ("item_id_in_use", "an item with this id already exists in this session")


@pytest.mark.parametrize(
    ("orig", "wrapper"),
    [
        (_sqlite(sqlite3.IntegrityError, "UNIQUE constraint failed: sessions.id", 1555), IntegrityError),
        (_sqlite(sqlite3.IntegrityError, "UNIQUE constraint failed: items.session_id, items.seq", 2067),
         IntegrityError),
        (_sqlite(sqlite3.IntegrityError, "FOREIGN KEY constraint failed", 787), IntegrityError),
        (_sqlite(sqlite3.OperationalError, "no such table: items", 1), OperationalError),
        (_sqlite(sqlite3.OperationalError, 'near "SELEC": syntax error', 1), OperationalError),
        (sqlite3.OperationalError("database is locked"), OperationalError),  # no result code: not the driver's
        (RuntimeError("syntax error at or near"), ProgrammingError),
        (pg.UndefinedTable('relation "items" does not exist'), ProgrammingError),
        (pg.ForeignKeyViolation('insert or update on table "items" violates foreign key constraint'),
         IntegrityError),
        (pg.UniqueViolation('duplicate key value violates unique constraint "pk_sessions"'), IntegrityError),
        (pg.StringDataRightTruncation("value too long for type character varying(128)"), DataError),
    ],
)  # fmt: skip
def test_programming_errors_stay_raw(orig, wrapper) -> None:
    """Other constraints, SQLITE_ERROR (bad SQL, missing table) and non-operational errors are not StoreErrors."""
    exc = _wrapped(orig, wrapper)
    assert classify(exc) is None
    with pytest.raises(wrapper) as info, translate_errors():
        raise exc
    assert info.value is exc


def test_translate_errors_chains_the_original() -> None:
    """translate_errors raises the StoreError from the SQLAlchemy error and leaves non-database errors alone."""
    exc = _wrapped(faults.driver_error("full"))
    with pytest.raises(StoreError) as info, translate_errors():
        raise exc
    assert info.value.__cause__ is exc and info.value.code == "store_unavailable"
    with pytest.raises(KeyError), translate_errors():
        raise KeyError("sess_x")


def test_store_error_is_not_a_value_error() -> None:
    """StoreError is a plain Exception, so `except ValueError` handlers of misuse never swallow it."""
    error = StoreError("store_unavailable", "the store is unavailable: disk I/O error")
    assert not isinstance(error, (ValueError, KeyError, sqlite3.Error))
    assert (error.code, str(error), error.args) == (
        "store_unavailable", "the store is unavailable: disk I/O error", ("the store is unavailable: disk I/O error",)
    )  # fmt: skip
