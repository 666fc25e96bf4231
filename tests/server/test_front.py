"""The front's limits seen from a client: deadlines, the connection cap, duplicate headers, /metrics, Host."""

import asyncio
import contextlib
import socket
import time

import orjson
import pytest
from conftest import Client, Daemon
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

pytestmark = pytest.mark.slow

KEY = "k3y"
CHAT_MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def running(tmp_path_factory, *flags):
    d = Daemon(tmp_path_factory.mktemp("db") / "front.db", "--api-key", KEY, *flags).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """Short deadlines and small send buffers, so a stalled client is dropped within seconds."""
    with running(tmp_path_factory, "--send-timeout-s", "2", "--head-timeout-s", "1", "--body-timeout-s", "1",
                 "--send-buffer-bytes", "4096") as d:
        yield d


@pytest.fixture(scope="module")
def lan(tmp_path_factory):
    """Bound to every interface with --allowed-hosts, an open /metrics and room for three connections."""
    with running(tmp_path_factory, "--host", "0.0.0.0", "--allowed-hosts", "good.example", "--metrics-public",
                 "--max-connections", "3") as d:
        yield d


def exchange(d, raw: bytes, read_s: float = 30.0, rcvbuf: int | None = None) -> bytes:
    """Everything the daemon sends back to `raw` until it closes (or `read_s` passes)."""
    with socket.socket() as s:
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(read_s)
        s.connect(("127.0.0.1", d.port))
        s.sendall(raw)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def post(path: str, body: bytes, version: str = "1.1", extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def chat(**extra) -> bytes:
    return orjson.dumps({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                         "max_tokens": 8, **extra})


def health(d) -> dict:
    reply = exchange(d, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    return orjson.loads(reply.split(b"\r\n\r\n", 1)[1])


def wait_health(d, pred, timeout_s=30.0) -> dict:
    """/healthz once `pred` holds of it (else the last one seen, for the assertion to show)."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(d)
        if pred(h) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def test_a_slow_head_gets_408_and_a_slow_body_too(strict):
    """A head unfinished after --head-timeout-s, or a body short of its length after --body-timeout-s: 408."""
    reply = exchange(strict, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in reply
    reply = exchange(strict, post("/v1/chat/completions", chat())[:-10])
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), reply
    assert reply.endswith(b"the request body did not arrive within 1 s\n")


def test_a_truncated_body_is_no_500(strict):
    """A client that sends half its body and leaves gets nothing, and the daemon logs no traceback."""
    raw = post("/v1/chat/completions", chat())
    with socket.create_connection(("127.0.0.1", strict.port), timeout=30) as s:
        s.sendall(raw[:-20])
        s.shutdown(socket.SHUT_WR)
        reply = s.recv(65536)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408 "), reply
    assert health(strict)["status"] == "ok"


def test_http10_gets_no_chunked_encoding(strict):
    """A streamed completion asked over HTTP/1.0 comes whole, with a length, and the connection closes."""
    reply = exchange(strict, post("/v1/chat/completions", chat(stream=True), version="1.0"))
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
    assert f"content-length: {len(body)}".encode() in head.lower()
    assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n")


def test_duplicate_headers_get_400_on_http_and_the_websocket(strict):
    """Two Authorization (or Host) headers are refused with 400 on every path, the handshake included."""
    twice = b"Authorization: Bearer k3y\r\nAuthorization: Bearer other\r\n"
    close = b"Connection: close\r\n"  # else the reply is read until the kept-alive connection idles out
    reply = exchange(strict, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + close + twice + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert orjson.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "duplicate_header"
    reply = exchange(strict, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n" + close + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ") and reply.endswith(b"the host header appears more than once\n")

    async def handshake():
        try:
            async with connect(strict.url, additional_headers=[("Authorization", "Bearer k3y"),
                                                               ("Authorization", "Bearer k3y")]):
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code
    assert asyncio.run(handshake()) == 400


def test_metrics_need_the_key_unless_public(strict, lan):
    """/metrics answers 401 without the API key, 200 with it, and 200 to anyone with --metrics-public."""
    get = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    assert exchange(strict, get + b"\r\n").startswith(b"HTTP/1.1 401 ")
    assert exchange(strict, get + f"Authorization: Bearer {KEY}\r\n\r\n".encode()).startswith(b"HTTP/1.1 200 ")
    reply = exchange(lan, get + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ") and b"streamchat_" in reply


def test_allowed_hosts_are_checked_on_a_non_loopback_bind(lan):
    """Bound to 0.0.0.0 with --allowed-hosts: that name and loopback names pass, any other Host gets 403."""
    def status(host):
        reply = exchange(lan, f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return int(reply.split(b" ", 2)[1])
    assert [status(h) for h in ("good.example", f"good.example:{lan.port}", "127.0.0.1", "evil.example",
                                "10.1.2.3")] == [200, 200, 200, 403, 403]


def test_the_cap_counts_unfinished_heads_and_answers_503(lan):
    """Three connections that never finish their head fill --max-connections 3: a handshake and a
    completion get 503 with Retry-After; /healthz is still answered; once they go, handshakes pass."""
    held = [socket.create_connection(("127.0.0.1", lan.port), timeout=30) for _ in range(3)]
    try:
        for s in held:
            s.sendall(b"GET /v1/realtime HTTP/1.1\r\n")
        assert wait_health(lan, lambda h: h["connections_counted"] >= 4)["connections_counted"] == 4

        async def handshake():
            try:
                async with connect(lan.url, additional_headers={"Authorization": f"Bearer {KEY}"}):
                    return 101, None
            except InvalidStatus as exc:
                return exc.response.status_code, exc.response.headers.get("Retry-After")
        assert asyncio.run(handshake()) == (503, "1")
        reply = exchange(lan, post("/v1/chat/completions", chat()))
        assert reply.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in reply.lower()
        assert orjson.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "overloaded"
    finally:
        for s in held:
            s.close()
    assert wait_health(lan, lambda h: h["connections_counted"] == 1)["connections_counted"] == 1
    assert asyncio.run(handshake()) == (101, None)


async def stall(d, timeout_s=30.0):
    """A client with a tiny receive window starts a response, stops reading, and sends 120 bad events
    (each answered by an error of ~400 bytes: far more than the buffers hold). (Seconds from the stall
    until /healthz shows no connection and nothing running, that /healthz, the session, the client.)"""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", d.port))
    auth = {"Authorization": f"Bearer {KEY}"}
    c = Client(await connect(d.url, sock=sock, compression=None, additional_headers=auth, max_size=None))
    c.created = await c.recv()
    await c.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}})
    await c.until("conversation.item.done")
    await c.send({"type": "response.create", "response": {"max_output_tokens": 200}})
    await c.until("response.output_text.delta")
    c.ws.transport.pause_reading()  # from here on the client reads nothing
    for i in range(120):
        await c.send({"type": "no.such.event", "event_id": f"{i:03d}" + "x" * 250})
    stalled = time.monotonic()
    h = await asyncio.to_thread(wait_health, d, lambda h: h["connections"] == 0 and h["running"] == 0, timeout_s)
    c.ws.transport.abort()
    return time.monotonic() - stalled, h, c.created["session"]


def test_a_websocket_that_stops_reading_is_dropped_and_its_session_resumes(strict):
    """A client with a tiny receive window stops reading while its response runs: within
    --send-timeout-s of its buffers filling it is disconnected, the response cancelled (no session
    running), and the session resumes on a new connection."""
    async def go():
        took, h, session = await stall(strict)
        assert (h["connections"], h["running"]) == (0, 0)
        assert took < 2 + 10, "dropped about --send-timeout-s after the buffers filled"
        again = await Client.open(strict.url, additional_headers={"Authorization": f"Bearer {KEY}"})
        await again.send({"type": "streamchat.session.resume", "session_id": session["id"],
                          "resume_token": session["resume_token"]})
        resumed = await again.recv()
        await again.close()
        return resumed
    resumed = asyncio.run(go())
    assert resumed["type"] == "streamchat.session.resumed" and resumed["session"]["id"]


def test_send_queue_events_drops_a_client_whose_queue_overflows_before_the_send_timeout(tmp_path_factory):
    """--send-queue-events 16 with a 60 s --send-timeout-s: the same stalled client is dropped as soon as
    more than 16 events wait for it, long before the timeout (with the default 256, its 120 errors would
    all fit and it would be held for the 60 s)."""
    with running(tmp_path_factory, "--send-queue-events", "16", "--send-timeout-s", "60",
                 "--send-buffer-bytes", "4096") as d:
        took, h, _ = asyncio.run(stall(d, timeout_s=50.0))
    assert (h["connections"], h["running"]) == (0, 0), h
    assert took < 20, f"held {took:.1f} s: the queue limit did not drop it"


def test_an_http_stream_that_stops_reading_is_dropped_and_cancelled(strict):
    """A streaming completion whose client reads nothing is dropped once its buffers fill, and its
    engine session is closed: nothing keeps decoding for nobody."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.connect(("127.0.0.1", strict.port))
        s.sendall(post("/v1/chat/completions", chat(stream=True, max_tokens=256, temperature=0,
                                                    stream_options={"include_usage": True})))
        h = wait_health(strict, lambda h: h["running"] == 1)
        assert h["running"] == 1
        before = h["sessions_in_engine"]  # the stateless session of this request among them
        h = wait_health(strict, lambda h: h["running"] == 0 and h["sessions_in_engine"] < before, timeout_s=60)
        assert (h["running"], h["sessions_in_engine"]) == (0, before - 1)
        s.settimeout(30)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    assert got.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in got, "the stream was cut, not finished"


def test_a_client_gone_before_its_answer_cancels_the_completion(strict):
    """A whole (not streamed) completion whose client leaves while it decodes stops at once."""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=30) as s:
        s.sendall(post("/v1/chat/completions", chat(max_tokens=256, temperature=0)))
        h = wait_health(strict, lambda h: h["running"] == 1)
        assert h["running"] == 1
    before = h["sessions_in_engine"]
    h = wait_health(strict, lambda h: h["running"] == 0 and h["sessions_in_engine"] < before, timeout_s=5)
    assert (h["running"], h["sessions_in_engine"]) == (0, before - 1)


def test_a_websocket_whose_event_waits_long_still_answers_keepalive_pings(monkeypatch):
    """The app takes 2 s over one event (as an event waits on a restarting engine) while the client's next
    event waits behind it, under a 0.3 s keepalive: the front reads on, the client's pongs arrive, and
    the answers come instead of a 1011 close (uvicorn alone stops reading at the queued event)."""
    from streamchat.config import ServerConfig
    from streamchat.server import front

    monkeypatch.setattr(front, "PING_INTERVAL_S", 0.3)

    async def app(scope, receive, send):
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        for _ in range(2):
            message = await receive()
            await asyncio.sleep(1.0)  # reads nothing meanwhile
            await send({"type": "websocket.send", "text": "answer to " + message["text"]})
        await receive()

    async def go():
        gate = front.Gate()
        server = await front.listen(app, ServerConfig(port=0), gate)
        port = server.sockets[0].getsockname()[1]
        try:
            async with connect(f"ws://127.0.0.1:{port}/", ping_interval=None) as ws:
                await ws.send("a slow event")
                await ws.send("the next")
                return [await asyncio.wait_for(ws.recv(), 10) for _ in range(2)]
        finally:
            server.close()
            front.close_all(gate, 0.1)

    assert asyncio.run(go()) == ["answer to a slow event", "answer to the next"]


@pytest.mark.parametrize("compression", [False, True])
def test_websocket_compression_is_accepted_only_when_asked_for(compression):
    """A client that offers permessage-deflate (as websockets and browsers do) gets it only with
    --ws-compression; by default its frames go uncompressed, and both ways the text arrives whole."""
    from streamchat.config import ServerConfig
    from streamchat.server import front

    async def app(scope, receive, send):
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        message = await receive()
        await send({"type": "websocket.send", "text": message["text"] * 50})
        await receive()

    async def go():
        gate = front.Gate()
        server = await front.listen(app, ServerConfig(port=0, ws_compression=compression), gate)
        port = server.sockets[0].getsockname()[1]
        try:
            async with connect(f"ws://127.0.0.1:{port}/", compression="deflate") as ws:
                await ws.send("delta ")
                text = await asyncio.wait_for(ws.recv(), 10)
                return ws.response.headers.get("Sec-WebSocket-Extensions"), [type(e).__name__ for e in
                                                                             ws.protocol.extensions], text
        finally:
            server.close()
            front.close_all(gate, 0.1)

    header, extensions, text = asyncio.run(go())
    assert text == "delta " * 50
    if compression:
        assert header is not None and header.startswith("permessage-deflate")
        assert extensions == ["PerMessageDeflate"]
    else:
        assert header is None and extensions == []
