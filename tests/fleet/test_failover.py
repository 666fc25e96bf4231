"""A fleet on loopback with real parts: three daemons, HAProxy (deploy/haproxy.cfg), one PostgreSQL, one data folder.

Eight clients talk through the proxy; the daemon holding the most sessions is
killed (SIGKILL) mid-reply; its clients resume through the proxy on the others
within the lease plus a few seconds, nothing acknowledged is lost, and the
sessions it had checkpointed continue exactly as twins that never moved. A
paused daemon (SIGSTOP) whose session was taken over wakes to a refused
write. The daemons share one start: the tests run in file order.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from fleetparts import Chat, FleetDaemon, Proxy, wait_for
from streamchat.store import Store
from streamchat.tiers.datadir import MARKER
from streamchat.tiers.disk import file_name

LEASE_S, HEARTBEAT_S = 3.0, 1.0
FLEET_FLAGS = ["--lease-s", str(LEASE_S), "--heartbeat-s", str(HEARTBEAT_S), "--checkpoint-idle-s", "1"]
TOPICS = ["cats", "rain", "bread", "ships", "owls", "snow", "tea", "maps"]
REPLY_TOKENS = 8


class Fleet:
    def __init__(self, url: str, daemons: list[FleetDaemon], proxy: Proxy, shared) -> None:
        self.url, self.daemons, self.proxy, self.shared = url, daemons, proxy, shared
        self.store = Store(url)
        self.victim: FleetDaemon | None = None

    def held(self) -> dict[str, set[str]]:
        """daemon id -> the sessions it holds a live lease on, from the registry."""
        return {d.id: set(d.sessions) for d in self.store.daemons.fleet(stale_s=LEASE_S)}

    def alive(self) -> list[FleetDaemon]:
        return [d for d in self.daemons if d.proc.poll() is None]


@pytest.fixture(scope="module")
def fleet(pg_cluster, tmp_path_factory):
    name = pg_cluster.create_database()
    url = pg_cluster.url(name)
    shared = tmp_path_factory.mktemp("shared-kv")
    (shared / MARKER).touch()  # claimed once, as an operator would, before three daemons start on it
    daemons = [FleetDaemon("d1", url, shared, *FLEET_FLAGS), FleetDaemon("d2", url, shared, *FLEET_FLAGS),
               FleetDaemon("d3", url, shared, *FLEET_FLAGS, "--log-format", "json")]
    proxy = None
    try:
        for d in daemons:
            d.spawn()
        for d in daemons:
            d.wait()
        proxy = Proxy(daemons)
        f = Fleet(url, daemons, proxy, shared)
        yield f
        f.store.close()
    finally:
        if proxy is not None:
            proxy.stop()
        for d in daemons:
            d.stop()
        pg_cluster.drop_database(name)


def test_a_killed_daemons_sessions_resume_elsewhere_with_nothing_lost(fleet):
    """SIGKILL mid-reply: every client of the dead daemon resumes through the proxy within the lease plus a
    few seconds; the store has everything acknowledged; checkpointed sessions continue as unmoved twins."""
    asyncio.run(_failover(fleet))


async def _failover(f: Fleet) -> None:
    chats = [await Chat().open(f.proxy.url) for _ in TOPICS]
    await asyncio.gather(*(_turn(c, f"One word about {topic}?") for c, topic in zip(chats, TOPICS)))
    held = f.held()
    victim_id = max(held, key=lambda d: len(held[d]))
    f.victim = victim = next(d for d in f.daemons if d.id == victim_id)
    mine = [c for c in chats if c.session_id in held[victim_id]]
    assert len(mine) >= 2, held
    busy, idle = mine[0], mine[1:]
    for c in idle:  # checkpointed by the victim (--checkpoint-idle-s 1) into the shared folder
        wait_for(lambda c=c: (f.shared / file_name(c.session_id)).exists(), f"{c.session_id} to be checkpointed", 20)

    # A second turn everywhere; the victim dies once the busy session's long reply streams.
    killed_at: list[float] = []

    def kill_once(chat: Chat) -> None:
        if chat is busy and not killed_at:
            victim.signal(signal.SIGKILL)
            killed_at.append(time.monotonic())

    others = [c for c in chats if c not in mine]
    await busy.say("Tell me a long story about a lighthouse.")
    results = await asyncio.gather(_cut_reply(busy, kill_once),
                                   *(_turn(c, "And one more word?") for c in others))
    partial = results[0]
    assert killed_at and partial, "the victim was not killed mid-reply"

    resumed = {}
    for c in mine:
        await c.close()
        answer, _ = await c.resume_until_served(f.proxy.url, LEASE_S + 15)
        resumed[c.session_id] = (answer["restored_from"], time.monotonic() - killed_at[0])
    assert max(t for _, t in resumed.values()) <= LEASE_S + 5, resumed
    assert {c.session_id: resumed[c.session_id][0] for c in idle} == {c.session_id: "disk" for c in idle}
    assert resumed[busy.session_id][0] == "transcript"  # its file predates the second turn
    now_held = f.held()
    assert not now_held.get(victim_id) and all(any(c.session_id in s for s in now_held.values()) for c in mine)

    # Nothing acknowledged is lost; the cut reply is stored incomplete, as far as it was saved.
    for c in chats:
        stored = {(i.item_id, i.role, i.text) for i in f.store.items(c.session_id)}
        assert set(c.acked) <= stored, c.session_id
    cut = [i for i in f.store.items(busy.session_id) if i.kind == "response"][-1]
    assert cut.status == "incomplete" and partial.startswith(cut.text)

    # The checkpointed sessions continue exactly as twins that never moved (greedy).
    await asyncio.gather(*(_turn(c, "Why?") for c in idle))
    survivor = f.alive()[0]
    for c, topic in zip(chats, TOPICS):
        if c in idle:
            twin = await Chat().open(survivor.url)
            await _turn(twin, f"One word about {topic}?")
            await _turn(twin, "Why?")
            assert twin.replies == c.replies, (c.session_id, twin.replies, c.replies)
            await twin.close()
    for c in chats:
        await c.close()


async def _turn(chat: Chat, text: str) -> str:
    await chat.say(text)
    return await chat.reply(REPLY_TOKENS)


async def _cut_reply(chat: Chat, on_delta) -> str:
    """What streamed of a long reply before its daemon died."""
    try:
        await chat.reply(200, on_delta)
    except ConnectionClosed:
        pass
    else:
        raise AssertionError("the long reply finished before its daemon was killed")
    return chat.partial


def test_a_paused_daemon_wakes_to_a_refused_write(fleet):
    """SIGSTOP a daemon past its lease; another daemon takes the session over; after SIGCONT the paused one's
    write is refused (lease_lost), its socket closes 1013, the store keeps the new holder's state, and the
    paused daemon serves on."""
    asyncio.run(_fencing(fleet))


async def _fencing(f: Fleet) -> None:
    x, y = f.alive()[:2]
    cx = await Chat().open(x.url)
    await cx.say("Remember the number seven.")
    x.signal(signal.SIGSTOP)
    try:
        cy = Chat()
        cy.session_id, cy.token = cx.session_id, cx.token
        answer, waited = await cy.resume_until_served(y.url, LEASE_S + 15)
        assert waited >= LEASE_S - HEARTBEAT_S - 0.5  # refused (session_leased) while x's lease ran
        await cy.say("Now remember eight.")
        # sent while x sleeps: on waking, x reads it and its overdue heartbeat finds the lease gone, in
        # either order
        await cx.send({"type": "session.update", "event_id": "late", "session": {"instructions": "a late write"}})
    finally:
        x.signal(signal.SIGCONT)
    error = (await cx.until("error"))["error"]
    assert error["code"] == "lease_lost", error
    if error.get("event_id") == "late":  # the write reached the store first: its fence names the new holder
        assert f"leased to {y.id!r} at epoch 2" in error["message"], error
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            await cx.recv()
    assert closed.value.rcvd.code == 1013
    record = f.store.get_session(cx.session_id)
    assert record.instructions == ""
    assert [i.text for i in f.store.items(cx.session_id)] == ["Remember the number seven.", "Now remember eight."]
    assert f.store.leases.get(cx.session_id).owner == y.id
    health = wait_for(lambda: x.health(), "the paused daemon's /healthz", 10)
    assert (health["status"], health["leases_lost"] >= 1) == ("ok", True)
    await cy.close()


def test_each_daemon_says_who_it_is_and_signs_off(fleet):
    """The id in /healthz, /metrics and JSON log records; the registry lists the fleet with each one's
    sessions (the killed daemon stale); the URL's session_id is checked; a SIGTERM signs off and frees its
    leases."""
    from streamchat.store.registry import LIVE, STALE, STOPPED

    for d in fleet.alive():
        assert d.health()["daemon_id"] == d.id
        assert f'streamchat_daemon_info{{daemon_id="{d.id}"}} 1.0' in d.get("/metrics").decode().splitlines()
    records = [json.loads(line) for line in fleet.daemons[2].lines if line.startswith("{")]
    assert records and {r.get("daemon_id") for r in records} == {"d3"}

    def listed() -> dict | None:  # a daemon that was paused renews its lapsed leases at its next heartbeat
        states = {d.id: d for d in fleet.store.daemons.fleet(stale_s=LEASE_S)}
        held = {d.id: d.health()["leases"] for d in fleet.alive()}
        return states if all(len(states[i].sessions) == n for i, n in held.items()) else None

    states = wait_for(listed, "the registry to list the sessions each daemon holds", 3 * HEARTBEAT_S + 2)
    assert {i: s.state for i, s in states.items()} == {
        d.id: (STALE if d is fleet.victim else LIVE) for d in fleet.daemons}
    asyncio.run(_url_names_the_session(fleet.alive()[0]))
    leaving = fleet.alive()[0]
    assert leaving.stop() == 0
    gone = {d.id: d for d in fleet.store.daemons.fleet(stale_s=LEASE_S)}[leaving.id]
    assert (gone.state, gone.sessions) == (STOPPED, ())


async def _url_names_the_session(d: FleetDaemon) -> None:
    """?session_id= must be one valid id (else HTTP 400), and a resume on that socket must name it."""
    for query in ("session_id=", "session_id=a&session_id=b"):
        with pytest.raises(InvalidStatus) as refused:
            await Chat().open(f"{d.url}?{query}")
        assert refused.value.response.status_code == 400
    chat = await Chat().open(f"{d.url}?session_id=sess_elsewhere")
    await chat.send({"type": "streamchat.session.resume", "session_id": chat.session_id, "resume_token": chat.token})
    error = (await chat.until("error"))["error"]
    assert error["code"] == "invalid_event" and "sess_elsewhere" in error["message"]
    await chat.close()
