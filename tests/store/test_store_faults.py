"""Tests of Store under failure: each failure raises StoreError with its code, changes nothing, and passes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import faults
import pytest
from sqlalchemy.exc import OperationalError

from streamchat.store import Store, StoreError, UnknownSession

WRITES = {
    "create_session": lambda s: s.create_session("sess_b", "h", "", {}),
    "update_session": lambda s: s.update_session("sess_a", status="closed", total_tokens=9),
    "add_item": lambda s: s.add_item("sess_a", "item_3", "user", "message", "more", "completed", 1),
    "append_text": lambda s: s.append_text("sess_a", "item_2", "lo", 1),
    "finish_item": lambda s: s.finish_item("sess_a", "item_2", text="Hello", status="completed", num_tokens=2),
}
READS = {
    "get_session": lambda s: s.get_session("sess_a"),
    "list_sessions": lambda s: s.list_sessions(),
    "items": lambda s: s.items("sess_a"),
}


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def store(url: str):
    """A migrated FaultyStore holding sess_a: a finished user message and an open response."""
    s = faults.FaultyStore(url)
    s.migrate()
    s.create_session("sess_a", "h", "sys", {"window": 8})
    s.add_item("sess_a", "item_1", "user", "message", "hi", "completed", 1)
    s.add_item("sess_a", "item_2", "assistant", "response", "Hel", "in_progress", 1)
    yield s
    s.close()


def _content(store: Store) -> tuple:
    """Everything the store holds, timestamps included."""
    return store.list_sessions(), {r.id: store.items(r.id) for r in store.list_sessions()}


def _fails_with(code: str, reason: str, call, store: Store) -> None:
    """`call(store)` raises exactly StoreError(code) with `reason`, and the store's content is unchanged."""
    before = _content(store)
    with pytest.raises(StoreError) as info:
        call(store)
    assert (info.value.code, str(info.value)) == (code, reason)
    assert _content(store) == before


# -- duplicate item id (a real constraint violation) ----------------------


def test_duplicate_item_id(store: Store) -> None:
    """Reusing an item id in a session is item_id_in_use, leaves seq and num_items alone, and the next add works."""
    call = WRITES["add_item"]
    call(store)
    _fails_with("item_id_in_use", "an item with this id already exists in this session", call, store)
    record = store.add_item("sess_a", "item_4", "user", "message", "", "completed", 0)
    assert (record.seq, store.get_session("sess_a").num_items) == (3, 4)


# -- locked (another connection holds the write lock) ---------------------


@pytest.mark.parametrize("method", sorted(WRITES))
def test_locked(store: Store, method: str) -> None:
    """A write while another connection holds the lock is store_unavailable; it succeeds once the lock is gone."""
    with faults.write_locked(store.engine):
        _fails_with("store_unavailable", "the store is unavailable: database is locked", WRITES[method], store)
        assert store.get_session("sess_a").num_items == 2  # WAL: readers are not blocked by the writer
    before = _content(store)
    WRITES[method](store)
    assert _content(store) != before


# -- read-only --------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(WRITES))
def test_read_only_mid_run(store: Store, method: str) -> None:
    """Every write to a database that stopped taking writes is store_unavailable; reads go on; writes resume after."""
    with faults.read_only(store.engine):
        reason = "the store is unavailable: attempt to write a readonly database"
        _fails_with("store_unavailable", reason, WRITES[method], store)
        assert [r.item_id for r in store.items("sess_a")] == ["item_1", "item_2"]
    WRITES[method](store)


def test_read_only_uri_store(store: Store, url: str) -> None:
    """A Store opened with mode=ro reads what the writer committed and refuses every write with store_unavailable."""
    path = url.removeprefix("sqlite:///")
    with Store(f"sqlite:///file:{path}?mode=ro&uri=true") as reader:
        assert _content(reader) == _content(store)
        for method in sorted(WRITES):
            reason = "the store is unavailable: attempt to write a readonly database"
            _fails_with("store_unavailable", reason, WRITES[method], reader)
        assert _content(reader) == _content(store)


def test_read_only_at_start_up(store: Store, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """migrate() on a read-only or missing file fails at once with store_unavailable, creating nothing."""
    monkeypatch.chdir(tmp_path)
    path = url.removeprefix("sqlite:///")
    store.close()
    with Store(f"sqlite:///file:{path}?mode=ro&uri=true") as ro:
        reason = "the store is unavailable: attempt to write a readonly database"
        _fails_with("store_unavailable", reason, lambda s: s.migrate(), ro)
    missing = tmp_path / "missing.db"
    with Store(f"sqlite:///file:{missing}?mode=ro&uri=true") as ro, pytest.raises(StoreError) as info:
        ro.migrate()
    reason = "the store is unavailable: unable to open database file"
    assert (info.value.code, str(info.value)) == ("store_unavailable", reason)
    assert not missing.exists() and not (tmp_path / "file:").exists()


# -- full -------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.add_item("sess_a", "item_3", "user", "message", "x" * 100_000, "completed", 1),
        lambda s: s.append_text("sess_a", "item_2", "x" * 100_000, 1),
        lambda s: s.finish_item("sess_a", "item_2", text="x" * 100_000, status="completed"),
        lambda s: s.create_session("sess_b", "h", "x" * 100_000, {}),
    ],
    ids=["add_item", "append_text", "finish_item", "create_session"],
)
def test_full(store: Store, call) -> None:
    """A write that needs a page beyond max_page_count is store_unavailable; reads work; it succeeds once uncapped."""
    with faults.database_full(store.engine):
        _fails_with("store_unavailable", "the store is unavailable: database or disk is full", call, store)
        store.update_session("sess_a", total_tokens=5)  # rewrites a page the file already has
        assert store.get_session("sess_a").total_tokens == 5
    call(store)


# -- I/O error (injected: real disks do not fail on cue) -------------------


@pytest.mark.parametrize("method", sorted(WRITES))
def test_io_error_at_commit(store: faults.FaultyStore, method: str) -> None:
    """A disk I/O error at COMMIT is store_unavailable, rolls back the whole transaction, and the retry commits."""
    store.fail_next(method, "ioerr", at="COMMIT")
    _fails_with("store_unavailable", "the store is unavailable: disk I/O error", WRITES[method], store)
    before = _content(store)
    WRITES[method](store)
    assert _content(store) != before and store.faults_left() == {}


@pytest.mark.parametrize("at", ["", "UPDATE", "SELECT", "INSERT", "COMMIT"])
def test_add_item_rolls_back_at_every_statement(store: faults.FaultyStore, at: str) -> None:
    """add_item failing at any of its statements leaves num_items, seq and items as they were."""
    store.fail_next("add_item", "full", at=at)
    _fails_with("store_unavailable", "the store is unavailable: database or disk is full", WRITES["add_item"], store)
    assert WRITES["add_item"](store).seq == 2


@pytest.mark.parametrize("method", sorted(READS))
def test_reads_map_too(store: faults.FaultyStore, method: str) -> None:
    """A read that hits a locked database raises store_unavailable, not a raw SQLAlchemy error."""
    expected = READS[method](store)
    store.fail_next(method, "locked")
    with pytest.raises(StoreError) as info:
        READS[method](store)
    assert (info.value.code, str(info.value)) == ("store_unavailable", "the store is unavailable: database is locked")
    assert READS[method](store) == expected


def test_migrate_maps_too(store: faults.FaultyStore) -> None:
    """migrate() failing at its write probe is store_unavailable, and the schema is untouched."""
    store.fail_next("migrate", "readonly", at="UPDATE")
    reason = "the store is unavailable: attempt to write a readonly database"
    _fails_with("store_unavailable", reason, lambda s: s.migrate(), store)
    store.migrate()


# -- what is not a StoreError ---------------------------------------------


def test_misuse_keeps_its_own_errors(store: faults.FaultyStore) -> None:
    """Unknown sessions, a driver SQLITE_ERROR and non-database exceptions pass through untranslated."""
    with pytest.raises(UnknownSession):
        store.append_text("sess_x", "item_1", "a", 1)
    no_table = sqlite3.OperationalError("no such table: items")
    no_table.sqlite_errorcode = 1  # SQLITE_ERROR: the SQL or the schema is wrong, not the database's state
    store.fail_next("items", no_table)
    with pytest.raises(OperationalError, match="no such table: items"):
        store.items("sess_a")
    store.fail_next("get_session", RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        store.get_session("sess_a")
    with Store(f"sqlite:///{store.engine.url.database}-unmigrated") as bare:
        with pytest.raises(OperationalError, match="no such table"):
            bare.items("sess_a")


# -- the FaultyStore itself -----------------------------------------------


def test_fail_next_counts_and_queues(store: faults.FaultyStore) -> None:
    """times=2 fails two calls, faults queue per method in order, and other methods are untouched."""
    store.fail_next("append_text", "locked", times=2)
    store.fail_next("append_text", "full")
    assert store.faults_left() == {"append_text": 3}
    reasons = []
    for _ in range(3):
        with pytest.raises(StoreError) as info:
            store.append_text("sess_a", "item_2", "lo", 1)
        reasons.append(str(info.value).removeprefix("the store is unavailable: "))
    assert reasons == ["database is locked", "database is locked", "database or disk is full"]
    store.get_session("sess_a")
    store.append_text("sess_a", "item_2", "lo", 1)
    assert store.items("sess_a")[1].text == "Hello" and store.faults_left() == {}


def test_fault_waits_for_its_statement(store: faults.FaultyStore) -> None:
    """A fault at INSERT stays armed through calls that never insert."""
    store.fail_next("append_text", "full", at="INSERT")
    store.append_text("sess_a", "item_2", "lo", 1)
    assert store.faults_left() == {"append_text": 1}


def test_driver_errors_match_sqlite(store: faults.FaultyStore, url: str) -> None:
    """The injected 'locked' error has the class, message and code SQLite itself raises."""
    other = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as info:
        sqlite3.connect(url.removeprefix("sqlite:///"), timeout=0).execute("BEGIN IMMEDIATE")
    other.execute("ROLLBACK")
    made = faults.driver_error("locked")
    assert (type(made), str(made), made.sqlite_errorcode, made.sqlite_errorname) == (
        type(info.value), str(info.value), info.value.sqlite_errorcode, info.value.sqlite_errorname
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "close", "fault": "locked"}, "method must be one of"),
        ({"method": "items", "fault": "melted"}, "fault kind must be one of"),
        ({"method": "items", "fault": "locked", "at": "VACUUM"}, "at must be one of"),
        ({"method": "items", "fault": "locked", "times": 0}, "times must be at least 1"),
    ],
)
def test_fail_next_rejects_nonsense(store: faults.FaultyStore, kwargs: dict, message: str) -> None:
    """fail_next refuses unknown methods, kinds, points and counts with ValueError."""
    with pytest.raises(ValueError, match=message):
        store.fail_next(**kwargs)
