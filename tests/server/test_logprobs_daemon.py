"""logit_bias, logprobs and top_logprobs through a real daemon on loopback: the HTTP API in OpenAI's shapes
(whole and streamed), the websocket's response.create extensions, and the refusals of both naming the field."""

import asyncio
import http.client

import orjson
import pytest
from conftest import Client, Daemon
from tokenizers import Tokenizer

from streamchat.model.loader import resolve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "repetition_penalty": 1}
QUESTION = "Name a fruit."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("logprobs") / "s.db").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled model's tokenizer, to name token ids as a client would find them."""
    return Tokenizer.from_file(str(resolve(None).folder / "tokenizer.json"))


def one_token(tokenizer, text):
    [token_id] = tokenizer.encode(text, add_special_tokens=False).ids
    return token_id


def post(d, body):
    """(status, parsed JSON) of one chat completion; a streamed one as its list of chunks."""
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    c.request("POST", "/v1/chat/completions", body=orjson.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    raw = r.read()
    c.close()
    if body.get("stream") and r.status == 200:
        events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return r.status, [orjson.loads(e) for e in events[:-1]]
    return r.status, orjson.loads(raw)


def chat(max_tokens=6, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            **GREEDY, **extra}


def check_entries(content, top_n):
    """OpenAI's logprobs.content rules: logprobs <= 0, top_logprobs of top_n sorted descending, and under
    greedy the chosen token is the top one with the same logprob."""
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and entry["token"] == bytes(entry["bytes"]).decode("utf-8", "replace")
        top = entry["top_logprobs"]
        assert len(top) == top_n and all(t["logprob"] <= 0 and set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        if top_n:
            assert (top[0]["bytes"], top[0]["logprob"]) == (entry["bytes"], entry["logprob"])


def test_http_logprobs_whole_and_streamed(daemon):
    """A greedy completion with logprobs: one entry per token whose bytes make the content; streamed, the
    chunks carry the same entries."""
    status, whole = post(daemon, chat(logprobs=True, top_logprobs=5))
    assert status == 200, whole
    choice = whole["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] >= 1
    check_entries(content, 5)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]

    status, chunks = post(daemon, chat(logprobs=True, top_logprobs=5, stream=True))
    assert status == 200
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-3)

    status, plain = post(daemon, chat(logprobs=True))  # no top_logprobs: the chosen tokens only
    check_entries(plain["choices"][0]["logprobs"]["content"], 0)
    assert post(daemon, chat())[1]["choices"][0]["logprobs"] is None  # not asked: null, as OpenAI's


def test_http_logit_bias_forces_and_bans_tokens(daemon, tokenizer):
    """+100 on a token makes every greedy token that one; -100 on the greedy reply's first token changes it."""
    banana = one_token(tokenizer, " banana")
    status, forced = post(daemon, chat(logit_bias={str(banana): 100}, logprobs=True, top_logprobs=1))
    assert status == 200, forced
    assert forced["choices"][0]["message"]["content"] == " banana" * 6
    assert all(e["top_logprobs"][0]["bytes"] == list(b" banana") and e["logprob"] > -1e-3
               for e in forced["choices"][0]["logprobs"]["content"])

    first = post(daemon, chat(logprobs=True))[1]["choices"][0]["logprobs"]["content"][0]
    greedy_id = one_token(tokenizer, bytes(first["bytes"]).decode())
    banned = post(daemon, chat(logit_bias={str(greedy_id): -100}, logprobs=True))[1]
    assert banned["choices"][0]["logprobs"]["content"][0]["bytes"] != first["bytes"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"frobnicate": 1}, "frobnicate"),
    ({"functions_v2": []}, "functions_v2"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"logit_bias": {"7": -100.5}}, "logit_bias"),
    ({"logit_bias": {"seven": 1}}, "logit_bias"),
    ({"logit_bias": [7, 1]}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_http_refusals_name_the_field(daemon, extra, param):
    """An unknown field, or a logprobs or logit_bias value out of range: 400 naming it."""
    status, doc = post(daemon, chat(**extra))
    assert status == 400, doc
    assert doc["error"]["type"] == "invalid_request_error" and doc["error"]["param"] == param
    assert param in doc["error"]["message"]


async def ws_reply(d, **response):
    """A fresh session's greedy reply to QUESTION: (its deltas, its final text), or the error event."""
    c = await Client.open(d.url)
    try:
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}})
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"max_output_tokens": 6, **GREEDY, **response}})
        deltas = []
        while True:
            event = await c.recv()
            if event["type"] == "error":
                return event
            if event["type"] == "response.output_text.delta":
                deltas.append(event)
            if event["type"] == "response.done":
                return deltas, event["response"]["output"][0]["content"][0]["text"]
    finally:
        await c.close()


def test_websocket_logprobs_on_the_deltas_and_logit_bias(daemon, tokenizer):
    """response.create's logprobs/top_logprobs put `logprobs` on each output_text.delta (none unless asked);
    logit_bias forces a token as on HTTP."""
    async def go():
        deltas, text = await ws_reply(daemon, logprobs=True, top_logprobs=3)
        content = [e for d in deltas for e in d["logprobs"]]
        check_entries(content, 3)
        assert b"".join(bytes(e["bytes"]) for e in content).decode() == text
        plain, plain_text = await ws_reply(daemon)
        assert plain_text == text and all("logprobs" not in d for d in plain)
        banana = one_token(tokenizer, " banana")
        _, forced = await ws_reply(daemon, logit_bias={str(banana): 100})
        assert forced == " banana" * 6
    asyncio.run(go())


@pytest.mark.parametrize(("response", "field"), [
    ({"logprobs": True, "top_logprobs": 21}, "response.top_logprobs"),
    ({"top_logprobs": 1}, "response.top_logprobs"),
    ({"logprobs": 1}, "response.logprobs"),
    ({"logit_bias": {"7": 100.5}}, "response.logit_bias"),
    ({"logit_bias": {"x": 1}}, "response.logit_bias"),
    ({"logit_bias": {"49152": 1}}, "response.logit_bias"),
    ({"temperature": 2.5}, "response.temperature"),
])
def test_websocket_refusals_name_the_field(daemon, response, field):
    """Out-of-range values are an invalid_event error whose message starts with the field."""
    error = asyncio.run(ws_reply(daemon, **response))
    assert error["type"] == "error" and error["error"]["code"] == "invalid_event", error
    assert error["error"]["message"].startswith(field + " "), error
