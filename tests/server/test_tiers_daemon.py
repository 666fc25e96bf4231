"""Tests of session tiers in a real daemon: exact resume from disk after SIGTERM and kill -9, bad files refused."""

import asyncio
import json
import os
import re
import signal
import time
import urllib.request

import pytest
from conftest import Client, Daemon

from streamchat.tiers.disk import STALE_TEMP_S

pytestmark = pytest.mark.slow

TIER_ARGS = ["--window-tokens", "64", "--sink-tokens", "4", "--block-size", "16", "--prefix-sharing", "false"]
TURNS = ["Tell me about cats.", "And what about dogs?", "Which one is easier to keep?"]


def user_item(text):
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


async def turn(c, text, max_tokens=12):
    """An item and a greedy reply (temperature 0: the daemon's default samples); the reply's text."""
    await c.send(user_item(text))
    await c.until("conversation.item.done")
    await c.send({"type": "response.create", "response": {"max_output_tokens": max_tokens, "temperature": 0}})
    done = (await c.until("response.done"))[-1]["response"]
    assert done["status"] in ("completed", "incomplete")
    return done["output"][0]["content"][0]["text"]


async def stats(c):
    await c.send({"type": "streamchat.session.stats"})
    return (await c.until("streamchat.session.stats"))[-1]


async def resume(url, sid, token):
    c = await Client.open(url)
    await c.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
    resumed = await c.recv()
    assert resumed["type"] == "streamchat.session.resumed", resumed
    return c, resumed["restored_from"]


def metric(d, name):
    text = urllib.request.urlopen(d.http + "/metrics", timeout=10).read().decode()
    m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def ids(c):
    return c.created["session"]["id"], c.created["session"]["resume_token"]


def rest_of_log(d):
    d.proc.wait(timeout=60)
    return "".join(d.log) + d.proc.stdout.read()


@pytest.mark.parametrize("kv_dtype", ["auto", "float", "fp8", "int4"])
def test_sigterm_restart_resume_continues_exactly_as_without_restart(tmp_path, kv_dtype):
    """Two identical sessions with evictions: one continues live, the other after SIGTERM + restart
    and a resume from disk (by two sockets at once), with the same greedy reply; in every KV storage
    (auto is what this machine's measured decision chose: int8 where its step keeps within 5% of float's,
    float where it does not, as on the 2026-12-06 EPYC; float is the model's dtype; fp8 and int4 keep
    their scales in the file)."""
    db = tmp_path / "s.db"
    args = [*TIER_ARGS, "--checkpoint-idle-s", "0", "--kv-dtype", kv_dtype]
    a = Daemon(db, *args).start()
    health = json.loads(urllib.request.urlopen(a.http + "/healthz", timeout=10).read())
    chosen = health["kv_dtype"]["dtype"]
    if kv_dtype == "auto":
        assert chosen in ("float", "int8", "fp8", "int4"), health["kv_dtype"]
        assert health["kv_dtype"]["why"].startswith(f"auto chose {chosen}"), health["kv_dtype"]
    else:
        assert chosen == kv_dtype, health["kv_dtype"]

    async def before():
        x, y = await Client.open(a.url), await Client.open(a.url)
        for text in TURNS:
            assert await turn(x, text) == await turn(y, text)
        sx, sy = await stats(x), await stats(y)
        assert sx["evicted_tokens"] > 0 and sx["tier"] == "device" and not sx["on_disk"]
        assert {k: sx[k] for k in ("context_tokens", "evicted_tokens")} == \
               {k: sy[k] for k in ("context_tokens", "evicted_tokens")}
        live = await turn(y, "Answer in one word: which?", max_tokens=16)
        await x.close()
        await y.close()
        return ids(x), ids(y)[0], sx, live

    (sid, token), yid, sx, live = asyncio.run(before())
    assert 'streamchat_tier_sessions{tier="device"} 2.0' in urllib.request.urlopen(a.http + "/metrics").read().decode()
    a.kill(signal.SIGTERM)
    assert a.proc.returncode == 0 and "saved 2 of 2 sessions" in rest_of_log(a)
    assert sorted(p.name for p in (tmp_path / "s.kv").iterdir()) == sorted(
        [".streamchat-data-dir", *(f"{i}.safetensors" for i in (sid, yid))])
    b = Daemon(db, *args).start()
    try:
        async def after():
            (c, first), (other, second) = await asyncio.gather(resume(b.url, sid, token), resume(b.url, sid, token))
            assert sorted([first, second]) == ["disk", "memory"]  # two sockets at once: loaded once
            await other.close()
            st = await stats(c)
            assert st["tier"] == "device" and st["on_disk"]
            assert (st["context_tokens"], st["evicted_tokens"]) == (sx["context_tokens"], sx["evicted_tokens"])
            reply = await turn(c, "Answer in one word: which?", max_tokens=16)
            await c.close()
            return reply

        assert asyncio.run(after()) == live
        assert metric(b, 'streamchat_resumes_total{restored_from="disk"}') == 1
        assert metric(b, 'streamchat_tier_moves_total{from_tier="disk",to_tier="device"}') == 1
    finally:
        b.stop()


def test_kill9_after_a_checkpoint_resumes_from_disk_and_bad_files_fall_back(tmp_path):
    """kill -9 after idle sessions were saved: resume from disk; a torn file, or one the transcript
    moved past with a half-written newer copy beside it: transcript, with the reason in the log."""
    db, kv = tmp_path / "s.db", tmp_path / "s.kv"
    c1 = Daemon(db, *TIER_ARGS, "--checkpoint-idle-s", "0.5").start()

    async def first():
        x, z = await Client.open(c1.url), await Client.open(c1.url)
        await turn(x, TURNS[0])
        await turn(z, TURNS[1])
        deadline = time.monotonic() + 30
        while (metric(c1, "streamchat_tier_disk_writes_total") or 0) < 2:
            assert time.monotonic() < deadline, "the two idle sessions were not saved within 30 s"
            await asyncio.sleep(0.2)
        return ids(x), ids(z)

    (xid, xtok), (zid, ztok) = asyncio.run(first())
    c1.kill(signal.SIGKILL)
    zfile = kv / (zid + ".safetensors")
    data = zfile.read_bytes()
    zfile.write_bytes(data[: len(data) // 2])  # what a torn write would leave without the atomic rename
    c2 = Daemon(db, *TIER_ARGS, "--checkpoint-idle-s", "0").start()

    async def second():
        z, restored_from = await resume(c2.url, zid, ztok)
        assert restored_from == "transcript"
        await z.close()
        x, restored_from = await resume(c2.url, xid, xtok)
        assert restored_from == "disk"
        await x.send(user_item("One more thing."))
        await x.until("conversation.item.done")  # acknowledged: the transcript is past the file now

    asyncio.run(second())
    c2.kill(signal.SIGKILL)
    assert re.search(rf"WARNING .*session {zid}: saved KV not used \(truncated", rest_of_log(c2))
    xfile = kv / (xid + ".safetensors")
    cut = kv / f".{xfile.name}.0badc0de.tmp"
    cut.write_bytes(xfile.read_bytes()[:1000])  # a write cut by kill -9 ...
    old = time.time() - STALE_TEMP_S - 60  # ... long enough ago not to be a fleet peer's write in progress
    os.utime(cut, (old, old))
    c3 = Daemon(db, *TIER_ARGS, "--checkpoint-idle-s", "0").start()
    try:
        async def third():
            x, restored_from = await resume(c3.url, xid, xtok)
            assert restored_from == "transcript"
            assert await turn(x, "Thanks.", max_tokens=4)
            await x.close()

        asyncio.run(third())
        assert metric(c3, 'streamchat_tier_load_failures_total{reason="stale"}') == 1
    finally:
        c3.stop()
    log = rest_of_log(c3)
    assert "removing half-written session file" in log and not list(kv.glob("*.tmp"))
    assert re.search(rf"WARNING .*session {xid}: saved KV not used \(stale", log)
