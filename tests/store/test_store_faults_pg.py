"""Tests of Store on PostgreSQL under real failures: each raises StoreError with its code and changes nothing.

The twins of test_store_faults.py's SQLite conditions, made with the server's
own means: a database that turned read-only, a row another connection holds
locked (with a lock timeout), a server that is not there, a connection the
server dropped between calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from test_store_faults import WRITES, _fails_with

from streamchat.store import Store, StoreError


@pytest.fixture
def store(pg_url: str):
    """A migrated store holding sess_a: a finished user message and an open response; lock waits end at 200 ms."""
    s = Store(pg_url + "&options=-c%20lock_timeout%3D200")
    s.migrate()
    s.create_session("sess_a", "h", "sys", {"window": 8})
    s.add_item("sess_a", "item_1", "user", "message", "hi", "completed", 1)
    s.add_item("sess_a", "item_2", "assistant", "response", "Hel", "in_progress", 1)
    yield s
    s.close()


@contextlib.contextmanager
def _database_setting(store: Store, name: str, value: str, undo: str) -> Iterator[None]:
    """ALTER DATABASE ... SET `value` for new connections while inside (the pool is emptied on entry and exit)."""
    database = make_url(store.engine.url).database
    with store.engine.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{database}" SET {name} = {value}'))
        conn.commit()
    store.engine.dispose()
    try:
        yield
    finally:
        # Autocommit: the SET must end the setting's effect before the ALTER's own transaction begins.
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"SET {name} = {undo}"))  # DEFAULT would be the database's `value`
            conn.execute(text(f'ALTER DATABASE "{database}" RESET {name}'))
        store.engine.dispose()


@pytest.mark.parametrize("method", sorted(WRITES))
def test_read_only_database(store: Store, method: str) -> None:
    """Every write to a database turned read-only is store_unavailable; reads go on; writes resume after."""
    with _database_setting(store, "default_transaction_read_only", "on", undo="off"):
        verb = "INSERT" if method == "create_session" else "UPDATE"  # add_item first bumps num_items
        reason = f"the store is unavailable: cannot execute {verb} in a read-only transaction"
        _fails_with("store_unavailable", reason, WRITES[method], store)
    WRITES[method](store)


@pytest.mark.parametrize("method", ["add_item", "append_text", "update_session"])
def test_locked_row(store: Store, method: str) -> None:
    """A write that waits past lock_timeout for a row another connection holds is store_unavailable."""
    with store.engine.connect() as other:
        other.execute(text("SELECT 1 FROM sessions WHERE id = 'sess_a' FOR UPDATE"))
        other.execute(text("SELECT 1 FROM items WHERE session_id = 'sess_a' FOR UPDATE"))
        reason = "the store is unavailable: canceling statement due to lock timeout"
        _fails_with("store_unavailable", reason, WRITES[method], store)
        other.rollback()
    WRITES[method](store)


def test_no_server(tmp_path) -> None:
    """A URL whose server is not there fails migrate() at once with store_unavailable, naming the socket."""
    with Store(f"postgresql+psycopg://postgres@/nothing?host={tmp_path}") as s, pytest.raises(StoreError) as info:
        s.migrate()
    socket = tmp_path / ".s.PGSQL.5432"
    assert info.value.code == "store_unavailable" and str(info.value).startswith("the store is unavailable: ")
    assert str(info.value).endswith(f'connection to server on socket "{socket}" failed: No such file or directory')


def test_dropped_connection_is_replaced(store: Store, pg_url: str) -> None:
    """A pooled connection the server ended between calls (a restart, an admin) is replaced; the next call works."""
    store.get_session("sess_a")  # the pool holds one idle connection
    killer = create_engine(pg_url)
    with killer.connect() as conn:
        ended = conn.execute(text(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )).scalar()  # fmt: skip
    killer.dispose()
    assert ended == 1
    store.append_text("sess_a", "item_2", "lo", 1)
    assert store.items("sess_a")[1].text == "Hello"
