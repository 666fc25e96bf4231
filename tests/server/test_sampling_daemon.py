"""Tests of sampling defaults through the daemon: model defaults shown, session defaults applied, stored, resumed."""

import asyncio
import signal

import pytest
from conftest import Client, Daemon, settled_stats

pytestmark = pytest.mark.slow

FIELDS = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p")
# The bundled model has no generation_config.json: DEFAULT_PARAMS.
MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                  "repetition_penalty": 1.1, "min_p": 0.0}
PLAIN_GREEDY = {"temperature": 0, "repetition_penalty": 1}
HOT = {"temperature": 2, "top_k": 5}  # seeded per response: reproducible, and far from greedy
SEED = {"seed": 3}
QUESTION = "List three fruits and say why you like each."


def sampling(session):
    return {k: session[k] for k in FIELDS}


async def update(c, **fields):
    await c.send({"type": "session.update", "session": fields})
    return await c.recv()


async def reply(c, text=None, **response):
    """Optionally an item, then a reply of at most 12 tokens with these response fields; its text."""
    if text is not None:
        await c.send({"type": "conversation.item.create",
                      "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        await c.until("conversation.item.done")
    await c.send({"type": "response.create", "response": {"max_output_tokens": 12, **response}})
    done = (await c.until("response.done"))[-1]["response"]
    assert done["status"] in ("completed", "incomplete"), done
    return done["output"][0]["content"][0]["text"]


async def session_figures(c):
    """The session's own figures from its settled stats (not the pool's, which others change)."""
    stats = await settled_stats(c)
    return {k: stats[k] for k in ("context_tokens", "total_tokens", "evicted_tokens", "items", "queued_tokens",
                                  "kv_bytes")} | {"owned": stats["blocks"]["owned"]}


def test_session_defaults_show_apply_and_refuse_bad_values(daemon):
    """session.created shows the model's defaults; session.update's sampling fields show in session.updated,
    apply to later responses (a response's own field still wins), and a bad value is invalid_event."""
    async def go():
        c = await Client.open(daemon.url)
        assert sampling(c.created["session"]) == MODEL_DEFAULTS
        updated = await update(c, **HOT)
        assert updated["type"] == "session.updated"
        assert sampling(updated["session"]) == {**MODEL_DEFAULTS, "temperature": 2.0, "top_k": 5}
        hot = await reply(c, QUESTION, **SEED)
        overridden = await reply(c, "And two vegetables?", **SEED, **PLAIN_GREEDY)  # the response's fields win

        ref = await Client.open(daemon.url)  # the same turns, the params given per response
        assert await reply(ref, QUESTION, **HOT, **SEED) == hot
        assert await reply(ref, "And two vegetables?", **PLAIN_GREEDY) == overridden
        assert hot != await reply(ref, QUESTION, **PLAIN_GREEDY)

        own = await session_figures(c)
        for bad, field in (({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                           ({"frequency_penalty": -3}, "frequency_penalty"), ({"top_k": 1.5}, "top_k")):
            error = await update(c, **bad)
            assert error["type"] == "error" and error["error"]["code"] == "invalid_event", error
            assert field in error["error"]["message"]
        assert await session_figures(c) == own  # the refused updates changed nothing
        assert (await update(c, instructions=""))["type"] == "session.updated"
        last = await update(c)
        assert sampling(last["session"]) == sampling(updated["session"])
        await c.close()
        await ref.close()
    asyncio.run(go())


def test_session_defaults_survive_a_restart_and_resume(tmp_path):
    """Defaults set by session.update are stored: after SIGTERM and a restart, the resumed session shows
    them, and its next reply equals that of a twin session given the same params per response."""
    db = tmp_path / "s.db"
    a = Daemon(db).start()

    async def before():
        ids = []
        for defaults in (HOT, {}, {}):  # the session under test, then two twins without defaults
            c = await Client.open(a.url)
            await update(c, **defaults)
            await reply(c, QUESTION, **PLAIN_GREEDY, max_output_tokens=4)
            await c.close()
            ids.append((c.created["session"]["id"], c.created["session"]["resume_token"]))
        return ids

    try:
        ids = asyncio.run(before())
    finally:
        a.kill(signal.SIGTERM)
    b = Daemon(db).start()
    try:
        async def after():
            texts = []
            for (sid, token), response in zip(ids, (SEED, {**HOT, **SEED}, PLAIN_GREEDY)):
                c = await Client.open(b.url)
                await c.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
                resumed = await c.recv()
                assert resumed["type"] == "streamchat.session.resumed", resumed
                if response is SEED:
                    assert sampling(resumed["session"]) == {**MODEL_DEFAULTS, "temperature": 2.0, "top_k": 5}
                texts.append(await reply(c, "And two vegetables?", **response))
                await c.close()
            return texts

        mine, explicit, plain = asyncio.run(after())
        assert mine == explicit and mine != plain
    finally:
        b.stop()
