"""Tests of the engine core process in a real daemon: a core killed mid-reply costs a reconnect, not a
conversation; files are read off the step loop."""

import asyncio
import os
import signal
import sqlite3
import time
import urllib.request

import orjson
import pytest
from conftest import Client, Daemon
from test_tiers_daemon import TIER_ARGS, TURNS, ids, metric, resume, stats, turn, user_item

pytestmark = pytest.mark.slow

BOTCHAN = (__import__("pathlib").Path(__file__).resolve().parents[2] / "streamchat" / "data" / "botchan.txt")


def health(d) -> dict:
    return orjson.loads(urllib.request.urlopen(d.http + "/healthz", timeout=10).read())


def stored(db, session_id) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT role, kind, status, text FROM items WHERE session_id = ? ORDER BY seq",
                            (session_id,)).fetchall()


async def until_checkpointed(c, timeout=30):
    deadline = time.monotonic() + timeout
    while not (await stats(c))["on_disk"]:
        assert time.monotonic() < deadline, "the idle session was not checkpointed"
        await asyncio.sleep(0.2)


def test_a_core_killed_mid_reply_fails_the_reply_and_every_session_comes_back(tmp_path):
    """SIGKILL of the engine core while z streams: z's response.done (failed, engine_restarting) within 5 s;
    /healthz says restarting; y's commit and append sent during the restart are served once the core is
    back; then x, checkpointed before, answers exactly as its twin y did without a crash; z's next reply
    works with its history as stored; nothing acknowledged is lost."""
    db = tmp_path / "s.db"
    d = Daemon(db, *TIER_ARGS, "--checkpoint-idle-s", "0.5").start()
    try:
        async def go():
            x, y, z = await Client.open(d.url), await Client.open(d.url), await Client.open(d.url)
            for text in TURNS:
                assert await turn(x, text) == await turn(y, text)
            live = await turn(y, "Answer in one word: which?", max_tokens=16)  # the twin, never crashed
            await y.send({"type": "streamchat.input_text.append", "text": "Notes: the lamp is lit."})
            await y.until("streamchat.input_text.appended")
            await until_checkpointed(x)
            await z.send(user_item("My name is Ada. Tell me a long story about a lighthouse."))
            await z.send({"type": "response.create", "response": {"max_output_tokens": 200, "temperature": 0}})
            seen = []
            while sum(e["type"] == "response.output_text.delta" for e in seen) < 3:
                seen.append(await z.recv())
            pid = health(d)["engine"]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            done = (await z.until("response.done", timeout=10))[-1]["response"]
            failed_in = time.monotonic() - killed
            states = {health(d)["status"]}
            # y's commit and next append, pipelined, arrive while the core restarts: served once it is back
            await y.send({"type": "streamchat.input_text.commit"})
            await y.send({"type": "streamchat.input_text.append", "text": " And the door is shut."})

            async def y_served():
                seen = await y.until("streamchat.input_text.appended", timeout=60)
                return [e["type"] for e in seen], time.monotonic() - killed

            y_waits = asyncio.create_task(y_served())  # beside x's turn, which waits for the new core too
            assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "engine_restarting"
            shown = done["output"][0]["content"][0]["text"]
            assert shown.startswith("".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta"))
            reply = await turn(x, "Answer in one word: which?", max_tokens=16)  # waits for the new core
            during, served_in = await y_waits
            sx = await stats(x)
            again = await turn(z, "What is my name?", max_tokens=8)
            sz = await stats(z)
            h = health(d)
            for c in (x, y, z):
                await c.close()
            return failed_in, states, live, reply, sx, again, sz, h, shown, ids(z)[0], pid, during, served_in

        failed_in, states, live, reply, sx, again, sz, h, shown, zid, pid, during, served_in = asyncio.run(go())
        assert failed_in < 5.0, failed_in
        assert "error" not in during and "conversation.item.done" in during, during
        assert served_in < 30.0, served_in  # --engine-call-timeout-s
        assert "restarting" in states
        assert reply == live  # exactly as the twin that never crashed: its KV came back from its checkpoint
        assert sx["evicted_tokens"] > 0 and sx["tier"] == "device"
        assert metric(d, 'streamchat_tier_moves_total{from_tier="disk",to_tier="device"}') >= 1
        assert again and sz["items"] == 4  # item, the failed reply's shown text, item, reply
        assert h["status"] == "ok" and h["engine"]["starts"] == 2 and h["engine"]["pid"] != pid
        rows = stored(db, zid)
        assert [r[:3] for r in rows] == [("user", "message", "completed"), ("assistant", "response", "failed"),
                                         ("user", "message", "completed"), ("assistant", "response", rows[3][2])]
        assert rows[1][3] == shown and rows[3][3] == again
    finally:
        d.stop()


def test_an_http_completion_cut_by_a_core_restart_is_503_with_retry_after(tmp_path):
    """A chat completion in flight when the core is killed is a server error the client may retry (503,
    engine_restarting, Retry-After), not a 400 that says its request was bad (as bench/soak.py once saw);
    the same request after the restart completes."""
    import http.client
    import threading

    d = Daemon(tmp_path / "s.db").start()
    try:
        body = orjson.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 256, "temperature": 0,
                             "logit_bias": {"0": -100, "2": -100},  # no end token: still running at the kill
                             "messages": [{"role": "user", "content": "Count from 1 to 1000."}]})
        got = {}

        def post():
            conn = http.client.HTTPConnection("127.0.0.1", int(d.http.rsplit(":", 1)[1]), timeout=120)
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            got.update(status=r.status, retry=r.getheader("Retry-After"), doc=orjson.loads(r.read()))

        steps = metric(d, "streamchat_decode_steps_total") or 0.0
        t = threading.Thread(target=post)
        t.start()
        deadline = time.monotonic() + 60
        while (metric(d, "streamchat_decode_steps_total") or 0.0) < steps + 5:  # its reply is decoding
            assert time.monotonic() < deadline and t.is_alive(), ("the completion never started decoding", got)
            time.sleep(0.05)
        os.kill(health(d)["engine"]["pid"], signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        assert (got["status"], got["doc"]["error"]["code"], got["retry"]) == (503, "engine_restarting", "1"), got
        got.clear()
        deadline = time.monotonic() + 60
        while health(d)["status"] != "ok":
            assert time.monotonic() < deadline, "the core did not come back"
            time.sleep(0.1)
        body = body.replace(b'"max_tokens":256', b'"max_tokens":4')
        post()
        assert got["status"] == 200 and got["doc"]["choices"][0]["message"]["content"], got
    finally:
        d.stop()


def test_files_are_read_off_the_step_loop(tmp_path):
    """Sessions resumed from disk while another streams: all three come back from disk and the stream keeps
    delivering tokens while they do (the read itself is shown to run on the reader thread in
    tests/tiers/test_pager.py; how much it costs the stream is bench/pagein_itl.py's to measure)."""
    db = tmp_path / "s.db"
    text = BOTCHAN.read_text()[20000:24000]  # about 1,000 tokens a session
    d = Daemon(db, "--window-tokens", "1024", "--session-idle-release-s", "1", "--checkpoint-idle-s", "0").start()
    try:
        async def go():
            saved = []
            for i in range(3):
                c = await Client.open(d.url)
                await c.send({"type": "streamchat.input_text.append", "text": text[i * 100:]})
                await c.send({"type": "streamchat.input_text.commit"})
                await c.until("conversation.item.done")
                saved.append(ids(c))
                await c.close()
            deadline = time.monotonic() + 60
            while health(d)["sessions"] > 0:
                assert time.monotonic() < deadline, "idle sessions did not leave memory"
                await asyncio.sleep(0.3)
            x = await Client.open(d.url)
            await x.send(user_item("Write a long story about a cat who learns to fly."))
            await x.until("conversation.item.done")
            await x.send({"type": "response.create", "response": {"max_output_tokens": 128, "temperature": 0}})
            arrivals, window, origins = [], [], []

            async def reader():
                while True:
                    e = await x.recv()
                    if e["type"] == "response.output_text.delta":
                        arrivals.append(time.monotonic())
                    if e["type"] == "response.done":
                        return e["response"]

            streaming = asyncio.create_task(reader())
            while len(arrivals) < 40:
                assert not streaming.done(), "the reply ended early"
                await asyncio.sleep(0.02)
            window.append(time.monotonic())
            for sid, token in saved:
                c, origin = await resume(d.url, sid, token)
                origins.append(origin)
                await c.close()
            window.append(time.monotonic())
            done = await streaming
            await x.close()
            return arrivals, window, origins, done

        arrivals, (t0, t1), origins, done = asyncio.run(go())
        assert origins == ["disk"] * 3
        assert done["usage"]["output_tokens"] == len(arrivals) == 128
        gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
        before = [g for t, g in gaps[5:] if t < t0]
        during = [g for t, g in gaps if t0 <= t <= t1]
        assert before and len(during) >= 5, (len(during), t1 - t0)
    finally:
        d.stop()
