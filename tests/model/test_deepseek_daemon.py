"""A real daemon serves a DeepSeek-V2-Lite-shaped folder (`--model PATH`) over the websocket and the HTTP
API, with sinks + window evicting past a small window, and reports the latent's bytes per token."""

import asyncio
import http.client
import re
import urllib.request

import orjson
import pytest
from deepseek_kit import hf_model, save_folder

from streamchat.model.loader import resolve
from tests.server.conftest import Client, Daemon

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 3 * 576 * 4  # three layers, one float32 latent row of 512 + 64 values each


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = save_folder(hf_model("v2"), tmp_path_factory.mktemp("models") / "dsv2-lite-tiny", resolve(None).folder)
    d = Daemon(tmp_path_factory.mktemp("db") / "s.db", "--model", str(folder), "--dtype", "float32",
               "--window-tokens", "32", "--sink-tokens", "4", "--block-size", "16").start()
    yield d
    d.stop()


async def ws_chat(d, texts):
    """A websocket session's greedy replies to `texts`, and its stats after them."""
    c = await Client.open(d.url)
    replies = []
    for text in texts:
        await c.send({"type": "conversation.item.create",
                      "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        await c.send({"type": "response.create", "response": {"max_output_tokens": 8, "temperature": 0}})
        done = (await c.until("response.done"))[-1]["response"]
        replies.append((done["status"], done["output"][0]["content"][0]["text"]))
    await c.send({"type": "streamchat.session.stats"})
    stats = (await c.until("streamchat.session.stats"))[-1]
    await c.close()
    return replies, stats


def test_websocket_and_http_serve_mla_past_the_window(daemon):
    """Four websocket turns run past sink + window (tokens evicted, the cache bounded), an HTTP chat
    completion longer than the window is answered, and /healthz and /metrics give 576 values a token
    and layer."""
    texts = ["Tell me about cats.", "And what about dogs?", "Which one is easier to keep?", "Why?"]
    replies, stats = asyncio.run(ws_chat(daemon, texts))
    assert all(status in ("completed", "incomplete") and text for status, text in replies), replies
    assert stats["evicted_tokens"] > 0 and stats["context_tokens"] <= 16 * (2 + 2 + 1)
    assert stats["kv_bytes"] % (16 * BYTES_PER_TOKEN) == 0 and stats["kv_bytes"] > 0

    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    body = {"model": "dsv2-lite-tiny", "max_tokens": 8,
            "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 10}]}
    conn.request("POST", "/v1/chat/completions", body=orjson.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = orjson.loads(r.read())
    assert r.status == 200 and answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["prompt_tokens"] <= 16 * (1 + 2 + 1)  # the cache it answered from: sinks + window

    health = orjson.loads(urllib.request.urlopen(daemon.http + "/healthz", timeout=10).read())
    assert health["status"] == "ok" and health["kv_bytes_per_token"] == BYTES_PER_TOKEN
    metrics = urllib.request.urlopen(daemon.http + "/metrics", timeout=10).read().decode()
    assert float(re.search(r"^streamchat_kv_bytes_per_token (\S+)$", metrics, re.M).group(1)) == BYTES_PER_TOKEN
