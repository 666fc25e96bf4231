"""Fuzzing the live daemon: 2,000 generated bad frames, each answered, nothing leaked."""

import asyncio
import json
import random
import urllib.request

import orjson
import pytest
from conftest import Client, settled_stats, wait_for

pytestmark = pytest.mark.slow

TYPES = ["session.update", "conversation.item.create", "response.create", "response.cancel",
         "streamchat.input_text.append", "streamchat.input_text.commit", "streamchat.session.resume",
         "streamchat.session.stats", "bogus.event", ""]
VALUES = [None, True, 0, -1, 2**70, 1.5, "", "x" * 25_000, [], {}, [1, [2, [3]]], {"a": {"b": 1}}, "\ud800"]


def bad_frame(rng: random.Random):
    """One malformed frame and the error codes it may fairly get."""
    kind = rng.randrange(7)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))), {"invalid_event"}
    if kind == 1:
        return "".join(rng.choice('{}[]":,ab1\\') for _ in range(rng.randrange(1, 30))), {"invalid_json", "invalid_event"}
    if kind == 2:
        return "[" * 2000 + "]" * 2000, {"invalid_json", "invalid_event"}
    if kind == 3:
        return '{"type": "conversation.item.create", "x": "\\ud800"}', {"invalid_json", "invalid_event"}
    if kind == 4:
        return json.dumps({"type": rng.choice(TYPES[-2:])}), {"unknown_event", "invalid_event"}
    event = {"type": rng.choice(TYPES[:7])}
    for key in rng.sample(["session", "item", "response", "text", "session_id", "resume_token", "event_id"], 2):
        event[key] = rng.choice(VALUES)
    if event["type"] == "streamchat.input_text.append":
        event["text"] = rng.choice([None, 5, [], {}, "z" * 30_000])
    if event["type"] == "streamchat.session.resume":
        event["session_id"] = rng.choice([None, 5, "sess_missing"])
    if event["type"] == "response.create":
        event["response"] = rng.choice([5, "x", {"temperature": 9}, {"max_output_tokens": -3}, {"stop": [1]}])
    if event["type"] == "response.cancel":
        event["response_id"] = rng.choice([5, "resp_missing"])
    if event["type"] == "session.update":
        event["session"] = rng.choice([5, {"instructions": 3}, {"max_output_tokens": 0}, {"type": "audio"}])
    if event["type"] == "conversation.item.create":
        event["item"] = rng.choice([5, {"type": "message", "role": "x"}, {"type": "message", "role": "user", "content": 3}])
    if event["type"] == "streamchat.input_text.commit":
        event["event_id"] = 17
    return orjson.dumps(event, option=orjson.OPT_PASSTHROUGH_DATACLASS) if False else json.dumps(event), {
        "invalid_event", "invalid_json", "message_too_large", "session_not_found", "response_cancel_not_active"}


def health(daemon):
    with urllib.request.urlopen(daemon.http + "/healthz", timeout=10) as r:
        return orjson.loads(r.read())


def test_two_thousand_bad_frames_each_get_an_error_and_nothing_leaks(counted_daemon):
    """Each of 2,000 generated bad frames gets exactly one fitting `error`; a healthy session still chats; the
    fuzzed session put nothing in the cache and is gone once closed, and the blocks held afterwards are
    exactly the healthy session's (a daemon of its own: no other test's sessions move these figures)."""
    daemon = counted_daemon
    rng = random.Random(1234)
    before = health(daemon)

    async def go():
        bad = await Client.open(daemon.url)
        good = await Client.open(daemon.url)
        for i in range(2000):
            frame, codes = bad_frame(rng)
            await bad.ws.send(frame)
            reply = await bad.recv()
            assert reply["type"] == "error", (frame[:200], reply)
            assert reply["error"]["code"] in codes, (frame[:200], reply)
            if i % 500 == 0:
                await good.send({"type": "streamchat.session.stats"})
                assert (await good.recv())["type"] == "streamchat.session.stats"
        await good.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}})
        await good.until("conversation.item.done")
        await good.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        assert (await good.until("response.done"))[-1]["response"]["status"] in ("completed", "incomplete")
        stats = [await settled_stats(bad), await settled_stats(good)]
        await bad.close()
        await good.close()
        return stats

    bad_stats, good_stats = asyncio.run(go())
    assert (bad_stats["context_tokens"], bad_stats["items"], bad_stats["queued_tokens"], bad_stats["kv_bytes"],
            bad_stats["blocks"]["owned"], bad_stats["blocks"]["shared"]) == (0, 0, 0, 0, 0, 0), bad_stats
    # the healthy session was stored and stays resident (by policy); the fuzzed one never was and leaves
    settled = before["sessions_in_engine"] + 1
    after = wait_for(lambda: (h := health(daemon))["connections"] == 0 and h["sessions_in_engine"] == settled and h,
                     f"both connections closed and {settled} sessions in the engine")
    assert after["sessions"] == before["sessions"] + 1, (before, after)
    held = good_stats["blocks"]["owned"] + good_stats["blocks"]["shared"]
    assert before["kv_blocks"]["free"] - after["kv_blocks"]["free"] == held, (before, after, good_stats)
