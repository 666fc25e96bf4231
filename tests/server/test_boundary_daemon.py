"""Tests of the daemon's boundary in process: store faults, dangerous numbers, and the engine giving up."""

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

import orjson
import pytest
from conftest import Client

import streamchat.store as store_module
from streamchat import settings
from streamchat.server.app import Daemon

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import FaultyStore  # noqa: E402

pytestmark = pytest.mark.slow


def user_item(text, item_id=None):
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    if item_id:
        item["id"] = item_id
    return {"type": "conversation.item.create", "item": item}


@contextlib.asynccontextmanager
async def daemon(tmp_path, monkeypatch, *extra):
    """An in-process daemon whose store fails on demand: (daemon, its FaultyStore, websocket url)."""
    monkeypatch.setattr(store_module, "Store", FaultyStore)
    parser = argparse.ArgumentParser()
    settings.add_flags(parser)
    args = parser.parse_args(["--port", "0", "--database-url", f"sqlite:///{tmp_path / 'b.db'}",
                              "--num-blocks", "200", "--window-tokens", "256",
                              "--num-threads", os.environ.get("TEST_NUM_THREADS", "2"),
                              "--data-dir", str(tmp_path / "kv"), *extra])
    d = Daemon(settings.load(args, environ={}))
    await d.start()
    try:
        yield d, d.store._store, f"ws://127.0.0.1:{d.port}/v1/realtime"
    finally:
        await d.shutdown()


def test_store_failures_answer_typed_errors_and_change_nothing(tmp_path, monkeypatch):
    """Locked store, duplicate item id, a reply that cannot be stored: typed errors, and the session
    goes on with exactly what was acknowledged."""
    async def go():
        async with daemon(tmp_path, monkeypatch) as (d, store, url):
            c = await Client.open(url)
            sid = c.created["session"]["id"]
            await c.send(user_item("My name is Ada.", "item_a"))
            await c.until("conversation.item.added")
            store.fail_next("add_item", "locked")
            await c.send(user_item("This one is lost."))
            err = (await c.until("error"))[-1]["error"]
            assert (err["code"], err["type"]) == ("store_unavailable", "server_error")
            await c.send(user_item("Again.", "item_a"))
            assert (await c.until("error"))[-1]["error"]["code"] == "item_id_in_use"
            store.fail_next("append_text", "full")
            await c.send({"type": "streamchat.input_text.append", "text": "first part"})
            await c.until("streamchat.input_text.appended")
            await c.send({"type": "streamchat.input_text.append", "text": " second part"})
            assert (await c.until("error"))[-1]["error"]["code"] == "store_unavailable"
            await c.send({"type": "streamchat.session.stats"})
            stats = (await c.until("streamchat.session.stats"))[-1]
            store.fail_next("finish_item", "ioerr")  # the implicit close of the append
            await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
            assert (await c.until("error"))[-1]["error"]["code"] == "store_unavailable"
            await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
            events = await c.until("response.done")
            assert events[-1]["response"]["status"] in ("completed", "incomplete")
            items = await d.store.items(sid)
            assert [(i.item_id, i.text) for i in items[:2]] == [("item_a", "My name is Ada."),
                                                               (items[1].item_id, "first part")]
            assert "This one is lost." not in [i.text for i in items]
            assert "second part" not in items[1].text
            assert stats["items"] == 2  # the refused events never reached the engine
            await c.close()
    asyncio.run(go())


def test_a_reply_that_cannot_be_stored_still_ends_with_response_done(tmp_path, monkeypatch):
    """Storing the finished reply fails: response.done arrives, failed with store_unavailable."""
    async def go():
        async with daemon(tmp_path, monkeypatch) as (d, store, url):
            c = await Client.open(url)
            await c.send(user_item("Hi."))
            await c.until("conversation.item.added")
            await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
            await c.until("response.created")
            store.fail_next("finish_item", "locked")
            events = await c.until("response.done")
            response = events[-1]["response"]
            assert response["status"] == "failed"
            assert response["status_details"]["error"]["code"] == "store_unavailable"
            await c.send(user_item("Still here?"))  # the session goes on
            await c.until("conversation.item.added")
            await c.close()
    asyncio.run(go())


def test_a_tiny_temperature_and_a_huge_top_k_are_served(tmp_path, monkeypatch):
    """temperature 1e-300 and top_k 2^63-1 (both admitted) complete; the engine serves on."""
    async def go():
        async with daemon(tmp_path, monkeypatch) as (d, store, url):
            c = await Client.open(url)
            await c.send(user_item("Count to three."))
            for response in ({"temperature": 1e-300}, {"temperature": 2.0, "top_k": 2**63 - 1, "top_p": 1e-300}):
                await c.send({"type": "response.create", "response": {**response, "max_output_tokens": 6}})
                done = (await c.until("response.done"))[-1]["response"]
                assert done["status"] in ("completed", "incomplete"), done
            assert d.health()["status"] == "ok" and d.aengine.fatal is None
            await c.close()
    asyncio.run(go())


def test_an_engine_that_cannot_recover_says_503_and_exits_non_zero(tmp_path, monkeypatch):
    """The engine core dies more often than --max-engine-restarts allows: the response fails
    (engine_restarting), /healthz answers 503 with the reason, the daemon exits 1 for its supervisor."""
    async def go():
        async with daemon(tmp_path, monkeypatch, "--max-engine-restarts", "0") as (d, store, url):
            c = await Client.open(url)
            await c.send(user_item("Hello."))
            await c.send({"type": "response.create", "response": {"max_output_tokens": 200}})
            await c.until("response.created")
            os.kill(d.aengine.info.pid, signal.SIGKILL)
            done = (await c.until("response.done"))[-1]
            assert done["response"]["status"] == "failed"
            assert done["response"]["status_details"]["error"]["code"] == "engine_restarting"
            await asyncio.wait_for(d.stopping.wait(), 30)
            reader, writer = await asyncio.open_connection("127.0.0.1", d.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = (await reader.read(65536)).decode()
            writer.close()
            assert head.startswith("HTTP/1.1 503")
            body = orjson.loads(head.split("\r\n\r\n", 1)[1])
            assert body["status"] == "failed" and "died 1 times" in body["reason"] and "signal 9" in body["reason"]
        return d.exit_code
    assert asyncio.run(go()) == 1


def test_sessions_nobody_holds_leave_memory_and_resume_from_disk(tmp_path, monkeypatch):
    """An idle session with no connection leaves memory (KV to disk) and its lease is released; a resume
    takes the lease again and brings the session back.
    An append item closed by the next item gets its conversation.item.done."""
    async def go():
        async with daemon(tmp_path, monkeypatch, "--session-idle-release-s", "0.5") as (d, store, url):
            c = await Client.open(url)
            sid, token = c.created["session"]["id"], c.created["session"]["resume_token"]
            await c.send({"type": "streamchat.input_text.append", "text": "The locker code is 4817."})
            appended = (await c.until("streamchat.input_text.appended"))[-1]
            await c.send(user_item("Remember it."))
            seen = await c.until("conversation.item.added")
            while not any(e["type"] == "conversation.item.done" and e["item"]["id"] == appended["item_id"]
                          for e in seen):
                seen.append(await c.recv(60))
            await c.close()
            for _ in range(100):
                await asyncio.sleep(0.1)
                if sid not in d.hub.sessions and d.aengine.snapshot.sessions == 0:
                    break
            assert sid not in d.hub.sessions and d.health()["sessions_in_engine"] == 0
            lease = await d.store.leases.get(sid)  # released as it left: any daemon may take it at once
            assert lease.owner == d.fleet.id and lease.expires_at <= datetime.now(timezone.utc)
            assert not d.fleet.holds(sid) and d.health()["leases"] == 0
            c = await Client.open(url)
            await c.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
            resumed = (await c.until("streamchat.session.resumed"))[-1]
            assert resumed["restored_from"] == "disk"
            assert d.fleet.epoch_of(sid) == lease.epoch  # taken again by its own daemon: the same epoch
            await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
            assert (await c.until("response.done"))[-1]["response"]["status"] in ("completed", "incomplete")
            await c.close()
    asyncio.run(go())


def test_a_connections_session_enters_the_engine_with_its_first_engine_call(tmp_path, monkeypatch):
    """A new connection's session is opened in the engine core only when it is used: a connection that
    resumes another session, or closes unused, leaves nothing in the core (it used to cost an open and a
    close there); one that starts with session.update enters it with the instructions it asked for."""
    async def until_only(d, session_ids):
        for _ in range(100):
            if set(d.hub.sessions) == session_ids:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the daemon holds {set(d.hub.sessions)}, not {session_ids}")

    async def go():
        async with daemon(tmp_path, monkeypatch) as (d, store, url):
            a = await Client.open(url)
            sid, token = a.created["session"]["id"], a.created["session"]["resume_token"]
            assert d.health()["sessions"] == 1 and d.aengine.snapshot.sessions == 0
            await a.send({"type": "session.update", "session": {"instructions": "Answer in French."}})
            await a.until("session.updated")
            assert d.aengine.snapshot.sessions == 1
            await a.send(user_item("Say hello."))
            await a.until("conversation.item.done")
            await a.send({"type": "streamchat.session.stats"})
            stats = (await a.until("streamchat.session.stats"))[-1]
            assert stats["total_tokens"] == stats["context_tokens"], stats  # the instructions entered once
            b = await Client.open(url)
            await b.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
            assert (await b.until("streamchat.session.resumed"))[-1]["restored_from"] == "memory"
            unused = await Client.open(url)
            await unused.close()
            await until_only(d, {sid})
            await b.send({"type": "streamchat.session.stats"})  # a command: the core sends its figures after it
            await b.until("streamchat.session.stats")
            assert d.aengine.snapshot.sessions == 1
            await b.send({"type": "response.create", "response": {"max_output_tokens": 4}})
            assert (await b.until("response.done"))[-1]["response"]["status"] in ("completed", "incomplete")
            for c in (a, b):
                await c.close()
    asyncio.run(go())
