"""Tests of streamchat.store.leases: acquire/renew/release, epochs, fencing and races, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from clocks import ManualClock, at
from sqlalchemy import event

from streamchat.store import Lease, Store, StoreError, UnknownSession


@pytest.fixture
def store(url: str, clock: ManualClock):
    """A migrated store holding session sess_a with one open response item_1."""
    s = Store(url, clock=clock)
    s.migrate()
    s.create_session("sess_a", "h", "", {})
    s.add_item("sess_a", "item_1", "assistant", "response", "He", "in_progress", 1)
    yield s
    s.close()


def _content(store: Store) -> tuple:
    return store.get_session("sess_a"), store.items("sess_a")


# -- acquire, renew, release -------------------------------------------------


def test_first_acquire_is_epoch_one(store: Store) -> None:
    """A session never leased is taken at epoch 1 until now + lease_s; get() reads the row back."""
    lease = store.leases.acquire("sess_a", "d1", 15)
    assert lease == Lease("sess_a", "d1", 1, at(15), 15)
    assert store.leases.get("sess_a") == Lease("sess_a", "d1", 1, at(15), 0.0)
    assert store.leases.get("sess_x") is None


def test_live_lease_refuses_another_owner(store: Store, clock: ManualClock) -> None:
    """While d1's lease runs, d2 gets None and the row is unchanged, up to the last instant."""
    store.leases.acquire("sess_a", "d1", 15)
    clock.advance(14.999)
    assert store.leases.acquire("sess_a", "d2", 15) is None
    assert store.leases.get("sess_a") == Lease("sess_a", "d1", 1, at(15), 0.0)


def test_owner_acquiring_again_keeps_epoch(store: Store, clock: ManualClock) -> None:
    """The holder acquiring again, live or lapsed, keeps its epoch and gets a new expiry."""
    store.leases.acquire("sess_a", "d1", 15)
    clock.advance(5)
    assert store.leases.acquire("sess_a", "d1", 15) == Lease("sess_a", "d1", 1, at(20), 15)
    clock.advance(60)
    assert store.leases.acquire("sess_a", "d1", 10) == Lease("sess_a", "d1", 1, at(75), 10)


def test_expired_lease_is_taken_over(store: Store, clock: ManualClock) -> None:
    """Once d1's lease has expired d2 takes it at epoch 2; d1 can no longer renew or release it."""
    old = store.leases.acquire("sess_a", "d1", 15)
    clock.advance(15)
    new = store.leases.acquire("sess_a", "d2", 15)
    assert new == Lease("sess_a", "d2", 2, at(30), 15)
    assert store.leases.renew(old) is False
    assert store.leases.release(old) is False
    assert store.leases.get("sess_a") == Lease("sess_a", "d2", 2, at(30), 0.0)
    clock.advance(15)
    assert store.leases.acquire("sess_a", "d1", 15) == Lease("sess_a", "d1", 3, at(45), 15)


def test_take_session_leases_then_reads_in_one_call(store: Store, clock: ManualClock) -> None:
    """A resume's take: the lease as acquire() takes it, and the session and its items as they are under it."""
    seen = []
    lease, record, items = store.take_session("sess_a", "d1", 15, lambda r: seen.append(r.token_hash) or True)
    assert lease == Lease("sess_a", "d1", 1, at(15), 15) and seen == ["h"]
    assert (record, items) == _content(store)
    assert store.leases.get("sess_a") == Lease("sess_a", "d1", 1, at(15), 0.0)
    clock.advance(5)
    assert store.take_session("sess_a", "d1", 15, lambda r: True)[0] == Lease("sess_a", "d1", 1, at(20), 15)
    clock.advance(15)  # lapsed: another owner takes it at the next epoch
    assert store.take_session("sess_a", "d2", 15, lambda r: True)[0] == Lease("sess_a", "d2", 2, at(35), 15)


def test_take_session_refused_takes_nothing_and_tells_nothing(store: Store, clock: ManualClock) -> None:
    """A session the caller may not have (a wrong token) is UnknownSession, as a missing one is, and its lease
    row stays as it was, never leased or another owner's; a running lease of another owner is None only to a
    caller the session admits."""
    with pytest.raises(UnknownSession):
        store.take_session("sess_a", "d1", 15, lambda r: False)
    assert store.leases.get("sess_a") is None
    with pytest.raises(UnknownSession):
        store.take_session("sess_x", "d1", 15, lambda r: True)
    store.leases.acquire("sess_a", "d1", 15)
    clock.advance(1)
    with pytest.raises(UnknownSession):
        store.take_session("sess_a", "d2", 15, lambda r: False)
    assert store.take_session("sess_a", "d2", 15, lambda r: True) is None
    clock.advance(14)  # lapsed, and still refused: the epoch does not move
    with pytest.raises(UnknownSession):
        store.take_session("sess_a", "d2", 15, lambda r: False)
    assert store.leases.get("sess_a") == Lease("sess_a", "d1", 1, at(15), 0.0)


def test_renew_extends_a_running_lease_only(store: Store, clock: ManualClock) -> None:
    """renew() moves a running lease's expiry to now + lease_s; a lapsed or released one stays ended (acquire again)."""
    lease = store.leases.acquire("sess_a", "d1", 15)
    clock.advance(10)
    assert store.leases.renew(lease) is True
    assert store.leases.get("sess_a").expires_at == at(25)
    clock.advance(15)
    assert store.leases.renew(lease) is False
    assert store.leases.acquire("sess_a", "d1", 15) == Lease("sess_a", "d1", 1, at(40), 15)
    store.leases.release(lease)
    assert store.leases.renew(lease) is False
    assert store.leases.get("sess_a") == Lease("sess_a", "d1", 1, at(25), 0.0)


def test_release_frees_at_once_and_keeps_the_epoch(store: Store, clock: ManualClock) -> None:
    """A released lease is taken by another owner in the same instant, at the next epoch; a second release is False."""
    lease = store.leases.acquire("sess_a", "d1", 15)
    clock.advance(1)
    assert store.leases.release(lease) is True
    assert store.leases.release(lease) is False
    assert store.leases.get("sess_a") == Lease("sess_a", "d1", 1, at(1), 0.0)
    assert store.leases.acquire("sess_a", "d2", 15) == Lease("sess_a", "d2", 2, at(16), 15)


def test_unknown_session_and_bad_duration(store: Store) -> None:
    """A lease on a missing session is UnknownSession; a duration that is not a positive number is ValueError."""
    with pytest.raises(UnknownSession, match="unknown session 'sess_x'"):
        store.leases.acquire("sess_x", "d1", 15)
    for bad in (0, -1, float("inf"), float("nan"), True, "15"):
        with pytest.raises(ValueError, match="lease_s must be a finite number > 0"):
            store.leases.acquire("sess_a", "d1", bad)
    assert store.leases.get("sess_a") is None


# -- fencing ------------------------------------------------------------------

WRITES = {
    "add_item": lambda s, e: s.add_item("sess_a", "item_2", "user", "message", "hi", "completed", 1, epoch=e),
    "append_text": lambda s, e: s.append_text("sess_a", "item_1", "llo", 1, epoch=e),
    "finish_item": lambda s, e: s.finish_item("sess_a", "item_1", text="Hello", status="completed", epoch=e),
    "update_session": lambda s, e: s.update_session("sess_a", total_tokens=9, epoch=e),
}


@pytest.mark.parametrize("method", sorted(WRITES))
def test_stale_epoch_write_is_refused(store: Store, clock: ManualClock, method: str) -> None:
    """A write carrying the epoch of a lease taken over is lease_lost and changes nothing; the new epoch writes."""
    store.leases.acquire("sess_a", "d1", 15)
    clock.advance(20)
    store.leases.acquire("sess_a", "d2", 15)
    before = _content(store)
    with pytest.raises(StoreError) as info:
        WRITES[method](store, 1)
    message = "session 'sess_a' is leased to 'd2' at epoch 2; a write carrying epoch 1 is refused"
    assert (info.value.code, str(info.value)) == ("lease_lost", message)
    assert _content(store) == before
    WRITES[method](store, 2)
    assert _content(store) != before


@pytest.mark.parametrize("method", sorted(WRITES))
def test_lapsed_but_untaken_lease_still_writes(store: Store, clock: ManualClock, method: str) -> None:
    """Fencing is by epoch alone: a holder whose lease lapsed while nobody took over still writes."""
    store.leases.acquire("sess_a", "d1", 15)
    clock.advance(60)
    before = _content(store)
    WRITES[method](store, 1)
    assert _content(store) != before


def test_write_without_a_lease_row_is_refused(store: Store) -> None:
    """An epoch for a session never leased is lease_lost; no epoch writes as a single daemon always did."""
    with pytest.raises(StoreError) as info:
        WRITES["append_text"](store, 1)
    assert (info.value.code, str(info.value)) == (
        "lease_lost", "session 'sess_a' has no lease; a write carrying epoch 1 is refused"
    )  # fmt: skip
    WRITES["append_text"](store, None)
    assert store.items("sess_a")[0].text == "Hello"


# -- races between stores (daemons) --------------------------------------------


def test_concurrent_acquire_has_one_winner(url: str, store: Store, clock: ManualClock) -> None:
    """Eight daemons (own stores, own connections) acquiring one free lease at once: exactly one gets it."""
    stores = [Store(url, clock=clock) for _ in range(8)]
    results: list[Lease | None] = [None] * 8
    start = threading.Barrier(8)

    def take(i: int) -> None:
        start.wait()
        results[i] = stores[i].leases.acquire("sess_a", f"d{i}", 15)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    winners = [lease for lease in results if lease is not None]
    assert len(winners) == 1 and winners[0].epoch == 1
    assert store.leases.get("sess_a") == Lease("sess_a", winners[0].owner, 1, at(15), 0.0)


def test_takeover_waits_for_a_write_in_flight(url: str, store: Store, clock: ManualClock) -> None:
    """A takeover that arrives while a fenced write is between its fence and its commit waits for that commit.

    So the new holder sees the write, and no write of the old holder can land after the takeover.
    """
    old = store.leases.acquire("sess_a", "d1", 15)
    clock.advance(20)
    paused, resume = threading.Event(), threading.Event()

    def pause_before_insert(conn, cursor, statement, *rest) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO ITEMS"):
            paused.set()
            resume.wait(10)

    event.listen(store.engine, "before_cursor_execute", pause_before_insert)
    writer = threading.Thread(target=WRITES["add_item"], args=(store, old.epoch))
    writer.start()
    assert paused.wait(10)
    taken: list[Lease | None] = []
    with Store(url, clock=clock) as other:
        taker = threading.Thread(target=lambda: taken.append(other.leases.acquire("sess_a", "d2", 15)))
        taker.start()
        taker.join(0.5)
        assert taker.is_alive()  # blocked on the lease row (PostgreSQL) or the write lock (SQLite)
        resume.set()
        writer.join(10)
        taker.join(10)
        assert taken == [Lease("sess_a", "d2", 2, at(35), 15)]
        assert [r.item_id for r in other.items("sess_a")] == ["item_1", "item_2"]
    event.remove(store.engine, "before_cursor_execute", pause_before_insert)
    with pytest.raises(StoreError, match="leased to 'd2' at epoch 2"):
        store.append_text("sess_a", "item_1", "x", 1, epoch=old.epoch)
