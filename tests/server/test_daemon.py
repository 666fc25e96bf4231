"""Tests against a real daemon on loopback: event sequences, errors, HTTP answers."""

import asyncio
import time
import urllib.error
import urllib.request

import orjson
import pytest
from conftest import Client, settled_stats

pytestmark = pytest.mark.slow

RESPONSE_TYPES = [
    "response.created", "response.output_item.added", "conversation.item.added",
    "response.content_part.added",
]
# One block of the bundled SmolLM2-135M's KV in float32 (--kv-dtype float): keys and values of 30 layers,
# 3 KV heads of 64, 16 tokens, 4 bytes each.
BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 4
END_TYPES = [
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "conversation.item.done", "response.done",
]


def run(coro):
    return asyncio.run(coro)


def test_session_update_item_and_response_event_by_event(daemon):
    """create -> update -> item (added, done) -> response with deltas that make the final text."""
    async def go():
        c = await Client.open(daemon.url)
        sess = c.created["session"]
        assert sess["id"].startswith("sess_") and len(sess["resume_token"]) >= 22
        assert sess["truncation"] == {"type": "streamchat.sink_window", "sink_tokens": 4,
                                      "window_tokens": 256, "block_size": 16}
        await c.send({"type": "session.update", "event_id": "u1",
                      "session": {"type": "realtime", "instructions": "You are terse.", "max_output_tokens": 40,
                                  "temperature": 0}})
        upd = await c.recv()
        assert upd["type"] == "session.updated" and upd["session"]["instructions"] == "You are terse."
        assert "resume_token" not in upd["session"]
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}})
        added, done = await c.recv(), await c.recv()
        assert (added["type"], done["type"]) == ("conversation.item.added", "conversation.item.done")
        assert done["item"]["content"][0]["text"] == "Name a fruit."
        await c.send({"type": "response.create"})
        events = await c.until("response.done")
        types = [e["type"] for e in events]
        n = types.count("response.output_text.delta")
        assert n >= 1 and types == RESPONSE_TYPES + ["response.output_text.delta"] * n + END_TYPES
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert events[-5]["text"] == text
        final = events[-1]["response"]
        assert final["status"] == "incomplete"  # greedy: always the same reply, cut at 40 tokens
        assert final["output"][0]["content"][0]["text"] == text
        usage = final["usage"]
        assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert usage["input_token_details"]["cached_tokens"] >= 0 and usage["timing"]["ttft_ms"] > 0
        stats = await settled_stats(c)
        # the context holds the prompt, the reply and the close of the cut message (<|im_end|> and a newline)
        assert stats["context_tokens"] == usage["input_tokens"] + usage["output_tokens"] + 2, (stats, usage)
        assert stats["total_tokens"] == stats["context_tokens"] and stats["evicted_tokens"] == 0  # window 256
        blocks = stats["blocks"]["owned"] + stats["blocks"]["shared"]
        assert blocks == -(-stats["context_tokens"] // 16), stats
        assert stats["kv_bytes"] == blocks * BLOCK_BYTES and stats["items"] == 2, stats
        await c.close()
    run(go())


def test_cancel_second_response_and_cancel_without_response(daemon):
    """A second response.create is refused; cancel ends the response `cancelled`; cancel again errors."""
    async def go():
        c = await Client.open(daemon.url)
        await c.send({"type": "response.cancel", "event_id": "c0"})
        err = await c.recv()
        assert err["type"] == "error" and err["error"]["code"] == "response_cancel_not_active"
        assert err["error"]["event_id"] == "c0"
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a long story."}]}})
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"max_output_tokens": 200}})
        await c.until("response.output_text.delta")
        await c.send({"type": "response.create", "event_id": "dup"})
        await c.send({"type": "response.cancel"})
        events = await c.until("response.done")
        errors = [e for e in events if e["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["conversation_already_has_active_response"]
        assert errors[0]["error"]["event_id"] == "dup"
        done = events[-1]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
        await c.close()
    run(go())


@pytest.mark.parametrize("frame,code", [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ('{"type": 5}', "invalid_event"),
    ('{"type": "no.such.event", "event_id": "x"}', "unknown_event"),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "wizard", "content": []}}',
     "invalid_event"),
    ('{"type": "streamchat.session.resume", "session_id": "sess_nope", "resume_token": "t"}', "session_not_found"),
    ('{"type": "streamchat.input_text.append", "text": "' + "x" * 30000 + '"}', "message_too_large"),
    (b"\x00\x01binary", "invalid_event"),
])
def test_bad_frames_get_their_error_and_the_socket_stays_open(daemon, frame, code):
    """Each malformed frame answers `error` with its code; the next valid event still works."""
    async def go():
        c = await Client.open(daemon.url)
        await c.ws.send(frame)
        err = await c.recv()
        assert err["type"] == "error" and err["error"]["code"] == code
        await c.send({"type": "streamchat.session.stats"})
        assert (await c.recv())["type"] == "streamchat.session.stats"
        await c.close()
    run(go())


def test_frame_over_the_transport_limit_closes_1009(daemon):
    """A frame above --max-frame-bytes closes the socket with 1009."""
    async def go():
        c = await Client.open(daemon.url)
        await c.ws.send('{"type": "streamchat.input_text.append", "text": "' + "y" * 70000 + '"}')
        with pytest.raises(Exception):
            await c.recv(timeout=10)
        assert c.ws.close_code == 1009
    run(go())


def http_get(url, method="GET", headers=None):
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_healthz_metrics_404_405(daemon):
    """/healthz is JSON (the KV storage with why), /metrics Prometheus text with our names, other paths 404,
    POST 405."""
    status, body = http_get(daemon.http + "/healthz")
    doc = orjson.loads(body)
    assert status == 200 and doc["status"] == "ok" and doc["kv_blocks"]["total"] == 399
    assert doc["model"] and "sessions" in doc
    assert doc["kv_dtype"] == {"dtype": "float", "why": "as configured (--kv-dtype float)"}  # DAEMON_ARGS
    for _ in range(50):  # once the engine is idle, every used block is in some session's table
        kb = orjson.loads(http_get(daemon.http + "/healthz")[1])["kv_blocks"]
        if kb["held"] == kb["total"] - kb["free"]:
            break
        time.sleep(0.1)
    assert kb["held"] == kb["total"] - kb["free"], kb
    status, text = http_get(daemon.http + "/metrics")
    assert status == 200
    for name in ("streamchat_kv_blocks", "streamchat_prefix_hit_tokens_total", "streamchat_evicted_tokens_total",
                 "streamchat_preemptions_total", "streamchat_sessions", "streamchat_time_to_first_token_seconds",
                 "streamchat_inter_token_latency_seconds", "streamchat_kv_usage_ratio"):
        assert name in text
    assert "sess_" not in text
    assert http_get(daemon.http + "/nope")[0] == 404
    assert http_get(daemon.http + "/healthz", method="POST")[0] == 405
