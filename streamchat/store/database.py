"""SQLAlchemy engines for the store, with SQLite made durable and transactional.

For SQLite every connection gets `journal_mode=WAL`, `synchronous=FULL` (a
commit is fsynced before it returns, which "acknowledged means committed"
needs; NORMAL could lose the last commits on power loss) and
`foreign_keys=ON`. The driver's own transaction handling is switched off and
`BEGIN` is emitted by SQLAlchemy instead, so reads are consistent and schema
changes roll back with the migration that failed. A SQLite URI filename
(`sqlite:///file:/path/x.db?mode=ro&uri=true`) names the same file as its
plain path. A SQLite file the daemon creates is private: 0600, its -wal and
-shm files too, its folder 0700 if new.

Any other URL (PostgreSQL: `postgresql+psycopg://...`) is used as given, with
two defaults a URL may override: connections give up after
`CONNECT_TIMEOUT_S` (a server that is down fails a call, it does not hang
it), and a connection whose server says `synchronous_commit=off` is set back
to `on`, the PostgreSQL twin of `synchronous=FULL`: a commit that returned is
in the server's flushed WAL.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import urllib.parse
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.pool import ConnectionPoolEntry, StaticPool

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_S = 10
_SQLITE_PRAGMAS = ("PRAGMA synchronous=FULL", "PRAGMA foreign_keys=ON", f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


def make_engine(url: str | URL) -> Engine:
    """An engine for `url`; for SQLite, the pragmas above on every connection."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return _postgresql_engine(parsed)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    kwargs: dict[str, Any] = {}
    if is_memory_sqlite(parsed):
        # One shared connection, so every thread sees the same in-memory database.
        kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
    else:
        _create_private(parsed)
    engine = create_engine(parsed, **kwargs)
    event.listen(engine, "connect", _on_sqlite_connect)
    event.listen(engine, "begin", _on_sqlite_begin)
    return engine


def _postgresql_engine(url: URL) -> Engine:
    connect_args = {} if "connect_timeout" in url.query else {"connect_timeout": CONNECT_TIMEOUT_S}
    engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    event.listen(engine, "connect", _on_postgresql_connect)
    return engine


def _on_postgresql_connect(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    # Only `off` breaks "acknowledged means committed"; `local`, `remote_write` and
    # the rest all wait for the local flush, and a stronger setting is kept.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SHOW synchronous_commit")
        (mode,) = cursor.fetchone()
        if mode == "off":
            cursor.execute("SET synchronous_commit = on")
            logger.info("synchronous_commit is off on this server; the store sets it on for its connections")
    finally:
        cursor.close()
    # The SHOW began a transaction (psycopg is not in autocommit): commit it, which
    # keeps the SET (a rollback would undo it) and leaves the connection idle.
    dbapi_connection.commit()


def is_memory_sqlite(url: URL) -> bool:
    """Whether `url` names an in-memory SQLite database."""
    database = url.database or ""
    in_memory = "mode=memory" in database or url.query.get("mode") == "memory"
    return in_memory or _filename(url) in ("", ":memory:")


def sqlite_file(url: URL) -> Path:
    """The file a SQLite URL names, whether a plain path or a `file:` URI."""
    assert not is_memory_sqlite(url), url
    return Path(_filename(url)).expanduser()


def _create_private(url: URL) -> None:
    """The database file made 0600 (a new folder 0700) before SQLite would make it by the umask.

    SQLite gives the -wal and -shm files it creates the database file's mode,
    so they are private too. A URI that must not create the file (`mode=ro`,
    `mode=rw`) creates nothing; an existing file others may read is warned about.
    """
    path = sqlite_file(url)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if _uri_mode(url) not in (None, "rwc"):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("the database %s has mode %o: others may read the transcripts; chmod 600 %s",
                           path, mode, path)


def _uri_mode(url: URL) -> str | None:
    """The `mode` of a SQLite URI filename, None if it has none."""
    mode = url.query.get("mode")
    return mode if isinstance(mode, str) or mode is None else mode[-1]


def _filename(url: URL) -> str:
    database = url.database or ""
    if database.startswith("file:") and str(url.query.get("uri", "")).lower() in ("true", "1"):
        # `file:/a/x.db`, `file:///a/x.db` and `file:x.db`: only the path part names the file.
        return urllib.parse.unquote(urllib.parse.urlsplit(database).path)
    return database


def _on_sqlite_connect(dbapi_connection: sqlite3.Connection, record: ConnectionPoolEntry) -> None:
    # Autocommit at the driver level; `_on_sqlite_begin` opens transactions.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        (mode,) = cursor.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode.lower() not in ("wal", "memory"):
            logger.warning("SQLite refused WAL mode (journal_mode=%s)", mode)
        for pragma in _SQLITE_PRAGMAS:
            cursor.execute(pragma)
    finally:
        cursor.close()


def _on_sqlite_begin(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN")
