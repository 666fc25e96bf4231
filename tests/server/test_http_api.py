"""The OpenAI HTTP API on the websocket port: the official SDK, prefix reuse, and every error over raw HTTP."""

import asyncio
import http.client
import socket

import orjson
import pytest
from websockets.asyncio.client import connect

from tests.server.conftest import Daemon

pytestmark = pytest.mark.slow

KEY = "sekret-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def api_daemon(tmp_path_factory):
    """A daemon with an API key, a window that holds a 10-turn chat, and room for one connection."""
    d = Daemon(tmp_path_factory.mktemp("http") / "h.db", "--api-key", KEY, "--window-tokens", "1024",
               "--max-connections", "1").start()
    yield d
    d.stop()


def sdk(d):
    from openai import OpenAI

    return OpenAI(base_url=f"{d.http}/v1", api_key=KEY, max_retries=0)


def request(d, method, path, body=None, headers=None, conn=None):
    """(status, headers, parsed JSON body) of one raw HTTP request."""
    c = conn or http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    data = body if isinstance(body, (bytes, type(None))) else orjson.dumps(body)
    c.request(method, path, body=data, headers={k: v for k, v in h.items() if v is not None})
    r = c.getresponse()
    raw = r.read()
    if conn is None:
        c.close()
    return r.status, r.headers, orjson.loads(raw) if raw else None


def chat(content, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def engine_sessions(d, timeout_s=10.0):
    """Sessions in the engine once none is left, or after `timeout_s` (a request's close trails its answer)."""
    for _ in range(int(timeout_s / 0.1)):
        left = request(d, "GET", "/healthz")[2]["sessions_in_engine"]
        if left == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    return left


def test_models_list_and_retrieve(api_daemon):
    """client.models.list() names the daemon's model; retrieve finds it and 404s another."""
    client = sdk(api_daemon)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = request(api_daemon, "GET", "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_sdk_streaming_and_not_give_the_same_greedy_reply(api_daemon):
    """stream=True deltas join to the non-streaming content; include_usage adds one usage chunk."""
    client = sdk(api_daemon)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant" and text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1 and whole.usage.total_tokens == (
        whole.usage.prompt_tokens + whole.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                 temperature=0,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert engine_sessions(api_daemon) == 0, "every stateless session is closed"


def test_ten_turn_chat_reuses_the_prefix_cache(api_daemon):
    """Each turn re-sends the chat; cached_tokens grows turn by turn and covers all but the newest blocks."""
    client = sdk(api_daemon)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}]
    cached, prompts = [], []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn}: what is {turn} plus {turn}?"})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           stream=turn % 2 == 1, **({"stream_options": {"include_usage": True}}
                                                                    if turn % 2 else {}))
        if turn % 2:
            chunks = list(r)
            text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            text, usage = r.choices[0].message.content, r.usage
        messages.append({"role": "assistant", "content": text})
        cached.append(usage.prompt_tokens_details.cached_tokens)
        prompts.append(usage.prompt_tokens)
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    for turn in range(1, 10):
        new = prompts[turn] - prompts[turn - 1]  # this turn's user message and the last reply's close
        assert prompts[turn] - cached[turn] <= new + 10 + 2 * 16, (turn, prompts, cached)


def test_a_chat_longer_than_the_window_is_served(api_daemon):
    """A request past sink + window runs under the window policy: 200, its context capped."""
    long = "The quick brown fox jumps over the lazy dog. " * 300  # ~3000 tokens, window 1024
    status, _, body = request(api_daemon, "POST", "/v1/chat/completions", chat(long))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] <= 1024 + 2 * 16


def test_keep_alive_serves_requests_one_after_another(api_daemon):
    """Two requests on one connection: the second is answered like one on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", api_daemon.port, timeout=120)
    first = request(api_daemon, "GET", "/v1/models", conn=conn)
    second = request(api_daemon, "POST", "/v1/chat/completions", {**chat(REPEAT, temperature=0), "max_tokens": 12},
                     conn=conn)
    conn.close()
    assert first[0] == 200 and second[0] == 200, second
    assert second[2]["choices"][0]["message"]["content"] == reply(api_daemon, temperature=0)[0]


# A prompt whose 12-token greedy reply repeats a word, so each penalty below changes it (checked once).
REPEAT = "Count from 1 to 20, separated by commas."
HOT = {"temperature": 1.5, "seed": 1}  # far from greedy, and reproducible


def reply(d, **fields):
    """(text, finish_reason) of a 12-token chat completion of REPEAT with these fields."""
    status, _, body = request(d, "POST", "/v1/chat/completions", {**chat(REPEAT, **fields), "max_tokens": 12})
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]


def test_every_sampling_field_is_honoured(api_daemon):
    """Each sampling field changes the reply against a control request, or does exactly what it says:
    top_k 1, a tiny top_p and min_p 1 make a hot draw greedy; the seed reproduces a draw; each penalty
    changes a greedy reply of repeats; a stop string cuts the reply before it."""
    greedy, _ = reply(api_daemon, temperature=0)
    hot, _ = reply(api_daemon, **HOT)
    assert hot != greedy, "temperature 1.5 drew the greedy reply"
    assert reply(api_daemon, **HOT)[0] == hot, "the same seed drew another reply"
    assert reply(api_daemon, **{**HOT, "seed": 2})[0] != hot, "another seed drew the same reply"
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert reply(api_daemon, **HOT, **narrow)[0] == greedy, narrow
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert reply(api_daemon, temperature=0, **penalty)[0] != greedy, penalty
    word = greedy.split()[2]
    cut, finish = reply(api_daemon, temperature=0, stop=[word])
    assert (cut, finish) == (greedy[:greedy.index(word)], "stop"), (greedy, word, cut)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 20001}]}, "messages[0].content"),
    (chat("hi", temperature=2.5), "temperature"),
    (chat("hi", temperature="hot"), "temperature"),
    (chat("hi", top_p=0), "top_p"),
    (chat("hi", max_tokens=0), "max_tokens"),
    (chat("hi", max_completion_tokens=10**6), "max_completion_tokens"),
    (chat("hi", seed=1.5), "seed"),
    (chat("hi", stop=[""]), "stop"),
    (chat("hi", stream="yes"), "stream"),
    (chat("hi", stream_options={"include_usage": True}), "stream_options"),
    (chat("hi", n=2), "n"),
    (chat("hi", frequency_penalty=2.5), "frequency_penalty"),
    (chat("hi", presence_penalty=-3), "presence_penalty"),
    (chat("hi", repetition_penalty=0), "repetition_penalty"),
    (chat("hi", min_p=1.5), "min_p"),
    (chat("hi", top_k=-1), "top_k"),
    (chat("hi", top_k=2.5), "top_k"),
])
def test_bad_requests_get_400_naming_the_field(api_daemon, body, param):
    """Every malformed request is a 400 invalid_request_error whose param names the field at fault."""
    status, _, doc = request(api_daemon, "POST", "/v1/chat/completions", body)
    assert status == 400, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == "invalid_request_error" and doc["error"]["param"] == param
    assert doc["error"]["message"]


@pytest.mark.parametrize("method, path, headers, status, code", [
    ("POST", "/v1/chat/completions", {"Authorization": None}, 401, "invalid_api_key"),
    ("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
    ("GET", "/v1/models", {"Authorization": None}, 401, "invalid_api_key"),
    ("POST", "/v1/chat/completions", {"Origin": "http://evil.example"}, 403, "forbidden"),
    ("POST", "/v1/chat/completions", {"Host": "evil.example"}, 403, "forbidden"),
    ("GET", "/v1/chat/completions", {}, 405, "method_not_allowed"),
    ("POST", "/v1/completions", {}, 404, "unknown_url"),
])
def test_refusals_before_the_body(api_daemon, method, path, headers, status, code):
    """Key, Host/Origin, method and route are checked as on the websocket, with OpenAI error objects."""
    got, h, doc = request(api_daemon, method, path, chat("hi"), headers)
    assert (got, doc["error"]["code"]) == (status, code), doc
    if status == 401:
        assert h["WWW-Authenticate"] == "Bearer"
    assert "access-control-allow-origin" not in {k.lower() for k in h}, "no CORS by default"


def test_unknown_model_is_404_model_not_found(api_daemon):
    status, _, doc = request(api_daemon, "POST", "/v1/chat/completions", {**chat("hi"), "model": "gpt-4o"})
    assert status == 404
    assert doc["error"] == {"message": "The model `gpt-4o` does not exist or you do not have access to it.",
                            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_too_large_body_is_413_and_never_read(api_daemon):
    """A Content-Length over --max-frame-bytes (65536 here) is refused from the head alone."""
    with socket.create_connection(("127.0.0.1", api_daemon.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                  + KEY.encode() + b"\r\nContent-Length: 9999999\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):  # to the end: the body unread, the daemon closes after answering
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413 ")
    assert orjson.loads(reply.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"


def test_overloaded_is_503_with_retry_after(api_daemon):
    """With --max-connections 1 taken by a websocket, a chat completion is 503 overloaded."""
    async def go():
        async with connect(api_daemon.url.replace("ws://", "ws://"), additional_headers={
                "Authorization": f"Bearer {KEY}"}) as ws:
            await ws.recv()  # session.created
            return await asyncio.to_thread(request, api_daemon, "POST", "/v1/chat/completions", chat("hi"))

    status, h, doc = asyncio.run(go())
    assert (status, doc["error"]["code"], h["Retry-After"]) == (503, "overloaded", "1")


def test_a_client_leaving_mid_stream_ends_its_session(api_daemon):
    """Closing the socket during a stream closes the engine session: nothing is left behind."""
    body = orjson.dumps(chat("Tell me a long story.", max_tokens=200, stream=True))
    with socket.create_connection(("127.0.0.1", api_daemon.port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert b"200 OK" in s.recv(4096)
    assert engine_sessions(api_daemon) == 0


def test_websocket_and_health_still_served_on_the_same_port(api_daemon):
    """The front hands websocket upgrades and plain GETs to websockets unchanged."""
    assert request(api_daemon, "GET", "/healthz")[0] == 200

    async def go():
        async with connect(api_daemon.url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            return orjson.loads(await ws.recv())["type"]

    assert asyncio.run(go()) == "session.created"
