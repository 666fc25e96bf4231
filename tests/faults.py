"""Store failures on demand for tests: a Store that fails chosen calls, and real SQLite conditions.

Shared by every test folder (`import faults`: tests/ is on sys.path because
tests/conftest.py lives there), so server tests can build
`AsyncStore(FaultyStore(url))` and make the next `add_item` fail.

`FaultyStore` raises the sqlite3 driver's own exceptions, with the result code
SQLite sets, from inside SQLAlchemy's execute or commit. SQLAlchemy wraps them
and rolls the transaction back, and the store translates them, exactly as for
a real failure; nothing of the store's own error handling is bypassed.

The context managers make the real condition instead, on a file database:
another connection holding the write lock (`write_locked`), connections that
refuse writes (`read_only`), a database capped at its current size
(`database_full`). Each undoes itself on exit, so a test can show the store
working again once the cause is gone.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine, event

from streamchat.store import Store
from streamchat.store.database import sqlite_file

# kind: (driver exception, message, extended result code, its name) as sqlite3 reports them.
DRIVER_ERRORS: dict[str, tuple[type[sqlite3.Error], str, int, str]] = {
    "locked": (sqlite3.OperationalError, "database is locked", 5, "SQLITE_BUSY"),
    "readonly": (sqlite3.OperationalError, "attempt to write a readonly database", 8, "SQLITE_READONLY"),
    "full": (sqlite3.OperationalError, "database or disk is full", 13, "SQLITE_FULL"),
    "ioerr": (sqlite3.OperationalError, "disk I/O error", 1034, "SQLITE_IOERR_FSYNC"),
    "duplicate_item": (
        sqlite3.IntegrityError,
        "UNIQUE constraint failed: items.session_id, items.item_id",
        2067,
        "SQLITE_CONSTRAINT_UNIQUE",
    ),
}
# Where a fault fires: "" = the call's first statement after BEGIN, a verb =
# its first statement starting with it, "COMMIT" = the commit itself.
FAULT_POINTS = frozenset({"", "SELECT", "INSERT", "UPDATE", "DELETE", "COMMIT"})
STORE_CALLS = frozenset(
    {"migrate", "create_session", "get_session", "update_session", "list_sessions",
     "add_item", "append_text", "finish_item", "items"}
)  # fmt: skip


def driver_error(kind: str) -> sqlite3.Error:
    """A fresh sqlite3 exception for `kind`, carrying the codes the driver would set."""
    cls, message, code, name = DRIVER_ERRORS[kind]
    error = cls(message)
    error.sqlite_errorcode = code
    error.sqlite_errorname = name
    return error


@dataclasses.dataclass
class _Fault:
    make_error: Callable[[], BaseException]
    at: str
    times: int


def _tracked(name: str) -> Callable[..., Any]:
    """A Store method that marks its statements as belonging to call `name`."""

    def call(self: FaultyStore, *args: Any, **kwargs: Any) -> Any:
        with self._running(name):
            return getattr(Store, name)(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class FaultyStore(Store):
    """A real Store whose next calls of a chosen method fail with a chosen driver error."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._armed: dict[str, list[_Fault]] = {}
        self._lock = threading.Lock()  # fail_next runs on the test's thread, faults fire on the store's
        self._local = threading.local()
        event.listen(self.engine, "before_cursor_execute", self._on_execute)
        # The `commit` event fires outside SQLAlchemy's error handling; do_commit runs
        # inside it, so an error raised here is wrapped and rolled back like a real one.
        dialect = self.engine.dialect  # this engine's own instance, shared with no other
        real_commit = dialect.do_commit

        def do_commit(dbapi_connection: Any) -> None:
            self._fire("COMMIT")
            real_commit(dbapi_connection)

        dialect.do_commit = do_commit  # type: ignore[method-assign]

    def fail_next(self, method: str, fault: str | BaseException, *, times: int = 1, at: str = "") -> None:
        """Make the next `times` calls of `method` raise `fault` (a DRIVER_ERRORS kind or an exception) at `at`.

        Faults queue per method in the order armed; one stays armed until a call reaches its point.
        """
        if method not in STORE_CALLS:
            raise ValueError(f"method must be one of {sorted(STORE_CALLS)}, not {method!r}")
        if isinstance(fault, str) and fault not in DRIVER_ERRORS:
            raise ValueError(f"fault kind must be one of {sorted(DRIVER_ERRORS)}, not {fault!r}")
        if at not in FAULT_POINTS:
            raise ValueError(f"at must be one of {sorted(FAULT_POINTS)}, not {at!r}")
        if times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        make_error = (lambda: driver_error(fault)) if isinstance(fault, str) else (lambda: copy.copy(fault))
        with self._lock:
            self._armed.setdefault(method, []).append(_Fault(make_error, at, times))

    def faults_left(self) -> dict[str, int]:
        """How many armed failures each method still has to raise."""
        with self._lock:
            return {m: sum(f.times for f in faults) for m, faults in self._armed.items() if faults}

    @contextlib.contextmanager
    def _running(self, name: str) -> Iterator[None]:
        self._local.call = name
        try:
            yield
        finally:
            self._local.call = None

    def _on_execute(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        words = statement.split(None, 1)
        verb = words[0].upper() if words else ""
        if verb != "BEGIN":
            self._fire(verb)

    def _fire(self, point: str) -> None:
        """Raise the first armed fault of the running call if `point` is where it fires."""
        call = getattr(self._local, "call", None)
        with self._lock:
            faults = self._armed.get(call or "")
            if not faults or faults[0].at not in ("", point):
                return
            fault = faults[0]
            fault.times -= 1
            if fault.times == 0:
                faults.pop(0)
        raise fault.make_error()

    migrate = _tracked("migrate")
    create_session = _tracked("create_session")
    get_session = _tracked("get_session")
    update_session = _tracked("update_session")
    list_sessions = _tracked("list_sessions")
    add_item = _tracked("add_item")
    append_text = _tracked("append_text")
    finish_item = _tracked("finish_item")
    items = _tracked("items")


# -- real conditions on a file database ------------------------------------


@contextlib.contextmanager
def on_every_connection(engine: Engine, setup: Callable[[sqlite3.Connection], Any]) -> Iterator[None]:
    """While inside, run `setup` on each new connection of `engine`; the pool is emptied on entry and exit."""

    def listener(dbapi_connection: sqlite3.Connection, record: Any) -> None:
        setup(dbapi_connection)

    sqlite_file(engine.url)  # asserts a file: disposing an in-memory pool would drop the database
    event.listen(engine, "connect", listener)
    engine.dispose()  # pooled connections were made before the listener
    try:
        yield
    finally:
        event.remove(engine, "connect", listener)
        engine.dispose()


def read_only(engine: Engine) -> contextlib.AbstractContextManager[None]:
    """Connections that refuse every write with SQLITE_READONLY (`PRAGMA query_only`); reads still work.

    The honest stand-in for a file that became unwritable mid-run: as root,
    chmod stops nothing, and a `mode=ro` URI is fixed when the Store is built.
    """
    return on_every_connection(engine, lambda c: c.execute("PRAGMA query_only=ON"))


def database_full(engine: Engine) -> contextlib.AbstractContextManager[None]:
    """Connections capped at the database's current size, so a write that needs a new page gets SQLITE_FULL."""

    def cap(dbapi_connection: sqlite3.Connection) -> None:
        (num_pages,) = dbapi_connection.execute("PRAGMA page_count").fetchone()
        dbapi_connection.execute(f"PRAGMA max_page_count={num_pages}")

    return on_every_connection(engine, cap)


@contextlib.contextmanager
def write_locked(engine: Engine, busy_timeout_ms: int = 50) -> Iterator[None]:
    """Another connection holds the write lock while inside; the store waits `busy_timeout_ms`, then SQLITE_BUSY."""
    other = sqlite3.connect(sqlite_file(engine.url), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with on_every_connection(engine, lambda c: c.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")):
            yield
        other.execute("ROLLBACK")
    finally:
        other.close()
