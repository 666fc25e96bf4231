"""Tests of what survives: kill -9 and restart, disconnects mid-response, SIGTERM shutdown."""

import asyncio
import signal
import time

import pytest
from conftest import Client, Daemon, wait_for

from streamchat.store import Store

pytestmark = pytest.mark.slow


STORY = "Tell me a very long story, in many chapters, about the ship that sails at dawn."


def user_item(text):
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def reply_status(daemon, session_id):
    """The status of the session's second stored item (its first reply), or None before it is stored."""
    with Store(f"sqlite:///{daemon.db_path}") as store:
        items = store.items(session_id)
    return items[1].status if len(items) > 1 else None


def test_kill9_during_response_and_append_then_resume_from_transcript(tmp_path):
    """Every acknowledged item survives SIGKILL, and of the reply streaming then, all the text sent more
    than a second (plus half a second's slack for the write itself) before the kill; resume says
    `transcript`, the cut reply is in the transcript, incomplete, and the chat goes on."""
    db = tmp_path / "s.db"
    d = Daemon(db).start()

    async def first():
        c = await Client.open(d.url)
        sid, token = c.created["session"]["id"], c.created["session"]["resume_token"]
        await c.send({"type": "session.update", "session": {"instructions": "You are a pirate."}})
        await c.until("session.updated")
        await c.send(user_item("My name is Ada."))
        await c.until("conversation.item.added")
        await c.send({"type": "streamchat.input_text.append", "text": STORY})
        appended = await c.until("streamchat.input_text.appended")
        assert appended[-1]["tokens"] > 0
        await c.send({"type": "response.create", "response": {"max_output_tokens": 256, "temperature": 0}})
        seen = []  # (when, text so far)
        while not seen or time.monotonic() - seen[0][0] < 2.5:
            e = await c.recv()
            assert e["type"] != "response.done", "the reply ended before the kill"
            if e["type"] == "response.output_text.delta":
                seen.append((time.monotonic(), (seen[-1][1] if seen else "") + e["delta"]))
        return sid, token, seen

    sid, token, seen = asyncio.run(first())
    d.kill(signal.SIGKILL)
    killed = time.monotonic()
    with Store(f"sqlite:///{db}") as store:
        items = store.items(sid)
        assert [(i.role, i.kind) for i in items][:2] == [("user", "message"), ("user", "append")]
        assert items[0].text == "My name is Ada." and items[1].text == STORY
        reply = items[2].text
    shown = seen[-1][1]
    due = max((text for when, text in seen if when <= killed - 1.5), key=len)
    assert shown.startswith(reply) and reply.startswith(due), (len(due), len(reply), len(shown))
    d2 = Daemon(db).start()

    async def second():
        c = await Client.open(d2.url)
        await c.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
        resumed = await c.recv()
        assert resumed["type"] == "streamchat.session.resumed"
        assert resumed["restored_from"] == "transcript" and resumed["session"]["id"] == sid
        assert resumed["session"]["instructions"] == "You are a pirate."
        await c.send(user_item("What is my name?"))
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"max_output_tokens": 30}})
        done = (await c.until("response.done"))[-1]["response"]
        assert done["status"] in ("completed", "incomplete") and done["usage"]["output_tokens"] > 0
        await c.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": "wrong"})
        assert (await c.recv())["error"]["code"] == "session_not_found"
        await c.close()

    try:
        asyncio.run(second())
    finally:
        d2.stop()
    with Store(f"sqlite:///{db}") as store:
        items = store.items(sid)
        statuses = [(i.kind, i.status) for i in items]
    assert statuses[2] == ("response", "incomplete") and items[2].text == reply, "the cut reply, as stored"
    assert statuses[-1] == ("response", "completed") or statuses[-1] == ("response", "incomplete")


def test_disconnect_mid_response_stores_incomplete_and_resumes_from_memory(daemon):
    """Closing the socket mid-reply stores the reply incomplete, frees nothing leaked, resumes from memory."""
    async def go():
        c = await Client.open(daemon.url)
        sid, token = c.created["session"]["id"], c.created["session"]["resume_token"]
        await c.send(user_item("Tell me a long story about a dragon."))
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"max_output_tokens": 200}})
        await c.until("response.output_text.delta")
        await c.close()
        await asyncio.to_thread(wait_for, lambda: reply_status(daemon, sid) == "incomplete",
                                "the cut reply stored incomplete")
        c2 = await Client.open(daemon.url)
        await c2.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
        resumed = await c2.recv()
        assert resumed["restored_from"] == "memory"
        await c2.send({"type": "response.create", "response": {"max_output_tokens": 5}})
        done = (await c2.until("response.done"))[-1]["response"]
        assert done["status"] in ("completed", "incomplete")
        await c2.close()
        return sid

    sid = asyncio.run(go())
    with Store(f"sqlite:///{daemon.db_path}") as store:
        kinds = [(i.kind, i.status) for i in store.items(sid)]
    assert kinds[1] == ("response", "incomplete") and kinds[1][1] != "in_progress"


def test_sigterm_ends_responses_closes_1001_and_exits_0(tmp_path):
    """SIGTERM: the running response is stored incomplete, sockets close with 1001, exit code 0."""
    db = tmp_path / "s.db"
    d = Daemon(db).start()

    async def go():
        c = await Client.open(d.url)
        sid = c.created["session"]["id"]
        await c.send(user_item("Tell me a long story."))
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"max_output_tokens": 250}})
        await c.until("response.output_text.delta")
        d.proc.send_signal(signal.SIGTERM)
        events = await c.until("response.done")
        assert events[-1]["response"]["status"] == "cancelled"
        with pytest.raises(Exception):
            await c.recv(timeout=30)
        assert c.ws.close_code == 1001
        return sid

    sid = asyncio.run(go())
    assert d.proc.wait(timeout=60) == 0
    with Store(f"sqlite:///{db}") as store:
        assert [i.status for i in store.items(sid)] == ["completed", "incomplete"]
