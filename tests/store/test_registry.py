"""Tests of streamchat.store.registry: register, heartbeat, deregister and the fleet view, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from clocks import ManualClock, at

from streamchat.store import DaemonState, Lease, Store


@pytest.fixture
def store(url: str, clock: ManualClock):
    """A migrated store with sessions sess_a, sess_b, sess_c."""
    s = Store(url, clock=clock)
    s.migrate()
    for name in ("sess_a", "sess_b", "sess_c"):
        s.create_session(name, "h", "", {})
    yield s
    s.close()


def test_register_and_heartbeat(store: Store, clock: ManualClock) -> None:
    """A registered daemon is live with its address and times; a heartbeat moves heartbeat_at only."""
    store.daemons.register("d1", "10.0.0.1:8765")
    clock.advance(5)
    assert store.daemons.heartbeat("d1") is True
    assert store.daemons.fleet(stale_s=15) == [DaemonState("d1", "10.0.0.1:8765", "live", at(0), at(5), ())]


def test_silent_daemon_goes_stale(store: Store, clock: ManualClock) -> None:
    """With no heartbeat for more than stale_s a daemon is stale; exactly stale_s is still live."""
    store.daemons.register("d1", "a:1")
    clock.advance(15)
    assert [d.state for d in store.daemons.fleet(stale_s=15)] == ["live"]
    clock.advance(0.001)
    assert [d.state for d in store.daemons.fleet(stale_s=15)] == ["stale"]
    store.daemons.heartbeat("d1")
    assert [d.state for d in store.daemons.fleet(stale_s=15)] == ["live"]


def test_fleet_lists_held_sessions(store: Store, clock: ManualClock) -> None:
    """Each daemon lists the sessions it holds an unexpired lease on, sorted; owners never registered are listed too."""
    store.daemons.register("d2", "b:2")
    store.daemons.register("d1", "a:1")
    store.leases.acquire("sess_c", "d1", 15)
    store.leases.acquire("sess_a", "d1", 15)
    store.leases.acquire("sess_b", "ghost", 5)
    assert store.daemons.fleet(stale_s=15) == [
        DaemonState("d1", "a:1", "live", at(0), at(0), ("sess_a", "sess_c")),
        DaemonState("d2", "b:2", "live", at(0), at(0), ()),
        DaemonState("ghost", None, "unregistered", None, None, ("sess_b",)),
    ]
    clock.advance(5)  # ghost's lease has expired: it holds nothing, so it is gone from the view
    assert [(d.id, d.sessions) for d in store.daemons.fleet(stale_s=15)] == [("d1", ("sess_a", "sess_c")), ("d2", ())]


def test_deregister_releases_every_lease(store: Store, clock: ManualClock) -> None:
    """deregister() marks the daemon stopped and frees its leases at once; its heartbeat is refused until it registers."""
    store.daemons.register("d1", "a:1")
    store.leases.acquire("sess_a", "d1", 15)
    store.leases.acquire("sess_b", "d1", 15)
    clock.advance(2)
    assert store.daemons.deregister("d1") == 2
    assert store.daemons.fleet(stale_s=15) == [DaemonState("d1", "a:1", "stopped", at(0), at(2), ())]
    assert store.leases.acquire("sess_a", "d2", 15) == Lease("sess_a", "d2", 2, at(17), 15)
    assert store.daemons.heartbeat("d1") is False
    assert store.daemons.heartbeat("never") is False
    clock.advance(1)
    store.daemons.register("d1", "a:9")
    assert store.daemons.fleet(stale_s=15)[0] == DaemonState("d1", "a:9", "live", at(3), at(3), ())


def test_state_to_json() -> None:
    """to_json gives plain types: ISO 8601 times, a list of sessions."""
    state = DaemonState("d1", "a:1", "live", at(0), at(1.5), ("sess_a",))
    assert state.to_json() == {
        "id": "d1", "address": "a:1", "state": "live", "started_at": "2025-01-01T00:00:00+00:00",
        "heartbeat_at": "2025-01-01T00:00:01.500000+00:00", "sessions": ["sess_a"],
    }  # fmt: skip
    ghost = DaemonState("g", None, "unregistered", None, None, ())
    assert ghost.to_json() == {"id": "g", "address": None, "state": "unregistered", "started_at": None,
                               "heartbeat_at": None, "sessions": []}  # fmt: skip


def test_a_sole_daemon_ends_its_killed_predecessors_leases(store: Store, clock: ManualClock) -> None:
    """register(sole=True), as a daemon on SQLite does: the earlier daemon (killed, never signed off) is
    marked stopped and its leases end now, so the sessions are taken at once, at the next epoch; its own
    earlier leases and a stopped daemon's rows are left as they were."""
    store.daemons.register("old", "a:1")
    store.leases.acquire("sess_a", "old", 15)
    store.leases.acquire("sess_b", "new", 15)
    clock.advance(1)
    store.daemons.register("new", "a:2", sole=True)
    assert [(d.id, d.state, d.sessions) for d in store.daemons.fleet(stale_s=15)] == [
        ("new", "live", ("sess_b",)), ("old", "stopped", ())]
    assert store.leases.acquire("sess_a", "new", 15) == Lease("sess_a", "new", 2, at(16), 15)
    assert store.leases.get("sess_b").owner == "new"
