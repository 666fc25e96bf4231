"""Plain HTTP/1.1 requests with bodies on the websocket port, beside websockets' own handshake.

Owns the front of every TCP connection and a small HTTP/1.1 server for the
paths an `HttpApp` claims. websockets reads only bodiless GET requests (a
handshake has no body), so each connection first shows its request head to
`FrontConnection`; a head for a claimed path switches the transport to an
asyncio stream pair served here, anything else (websocket upgrades, /healthz,
/metrics, other GETs) goes on to websockets' machinery unchanged:

    TCP accept -> FrontConnection: buffer to the end of the head
        claimed path -> StreamReaderProtocol -> serve_connection(app)   (keep-alive loop)
        anything else -> websockets ServerConnection (handshake, process_request, frames)

Served here: Content-Length bodies up to a limit (413 past it; chunked
request bodies 411), keep-alive, and chunked responses for server-sent
events. Knows nothing about the engine or the OpenAI shapes.
"""

from __future__ import annotations

import asyncio
import http
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 10.0  # the whole request head must arrive within this
IDLE_TIMEOUT_S = 30.0  # a kept-alive connection with no new request is closed after this
BODY_TIMEOUT_S = 30.0


class BodyTooLarge(Exception):
    """The request's body is over the limit; it was not read."""


@dataclass
class HttpRequest:
    method: str
    target: str
    path: str
    headers: Headers
    version: str
    port: int  # the local port it came in on
    content_length: int = 0


class HttpApp(Protocol):
    def claims(self, path: str) -> bool: ...

    async def __call__(self, request: HttpRequest, read_body: Callable[[int], Awaitable[bytes]],
                       out: "Responder") -> None:
        """Answer through `out`; `read_body(limit)` reads the body (BodyTooLarge past `limit`)."""


class Responder:
    """Writes one response: whole (`send`), or streamed in chunks (`start`, `chunk`, `end`)."""

    def __init__(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, keep_alive: bool) -> None:
        self.writer = writer
        self.reader = reader
        self.keep_alive = keep_alive
        self.started = False

    @property
    def gone(self) -> bool:
        """The client closed its side: nobody reads what follows."""
        return self.reader.at_eof() or self.writer.transport.is_closing()

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        assert not self.started, "one response per request"
        self.started = True
        lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append("Connection: keep-alive" if self.keep_alive else "Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        head = self._head(status, {**headers, "Content-Length": str(len(body))})
        self.writer.write(head + body)
        await self.writer.drain()

    async def start(self, status: int, headers: dict[str, str]) -> None:
        self.writer.write(self._head(status, {**headers, "Transfer-Encoding": "chunked"}))
        await self.writer.drain()

    async def chunk(self, data: bytes) -> None:
        if data:
            self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self.writer.drain()

    async def end(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


class HttpFront:
    """The HTTP side of the port: hands claimed connections to `app` and owns their tasks."""

    def __init__(self, app: HttpApp) -> None:
        self.app = app
        self.tasks: set[asyncio.Task] = set()  # one per HTTP connection in progress

    def create_connection(self, protocol, server, **kwargs) -> FrontConnection:
        """`create_connection` for websockets' `serve`."""
        return FrontConnection(protocol, server, front=self, **kwargs)

    def take(self, transport: asyncio.Transport, buffered: bytes) -> None:
        """Serve HTTP/1.1 on `transport` from now on; `buffered` is what was read already."""
        reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES)

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.get_running_loop().create_task(serve_connection(reader, writer, self.app))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        proto = asyncio.StreamReaderProtocol(reader, connected)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(buffered)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Shutdown: cancel every HTTP connection's task (its request's `finally` runs) and wait."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


class FrontConnection(ServerConnection):
    """websockets' connection, held back until the request head shows who serves it.

    Until then no websockets machinery runs (no handshake task exists); once
    the head is in, the connection either becomes a plain ServerConnection
    (connection_made and the buffered bytes replayed) or hands its transport
    to the HTTP server here.
    """

    def __init__(self, protocol, server, *, front: HttpFront, **kwargs) -> None:
        super().__init__(protocol, server, **kwargs)
        self._front = front
        self._head = bytearray()
        self._mode = "undecided"  # undecided | websockets | http
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._timer = self.loop.call_later(HEAD_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._mode == "websockets":
            return super().data_received(data)
        self._head += data
        if b"\r\n\r\n" not in self._head and len(self._head) <= MAX_HEAD_BYTES:
            return
        self._timer.cancel()
        buffered, self._head = bytes(self._head), bytearray()
        if self._front.app.claims(_path_of(buffered)):
            self._mode = "http"
            self._front.take(self._transport, buffered)
        else:
            self._mode = "websockets"
            super().connection_made(self._transport)
            super().data_received(buffered)

    def eof_received(self):
        if self._mode == "websockets":
            return super().eof_received()
        return None  # closes the transport

    def connection_lost(self, exc) -> None:
        if self._mode == "websockets":
            return super().connection_lost(exc)
        if self._timer is not None:
            self._timer.cancel()

    def pause_writing(self) -> None:
        if self._mode == "websockets":
            super().pause_writing()

    def resume_writing(self) -> None:
        if self._mode == "websockets":
            super().resume_writing()


def _path_of(head: bytes) -> str:
    """The path of the request line (no query), or "" when the line is not one."""
    line = head.split(b"\r\n", 1)[0].split(b" ")
    return line[1].split(b"?", 1)[0].decode("latin-1") if len(line) == 3 else ""


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, app: HttpApp) -> None:
    """Requests one after another on one connection, until either side ends it."""
    port = writer.get_extra_info("sockname")[1]
    timeout = HEAD_TIMEOUT_S
    try:
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            except asyncio.LimitOverrunError:
                await _refuse(writer, 431, "request head too large\n")
                return
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            timeout = IDLE_TIMEOUT_S
            try:
                request = parse_head(head, port)
            except ValueError as exc:
                await _refuse(writer, 400, f"{exc}\n")
                return
            if not await _serve_one(reader, writer, app, request):
                return
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _serve_one(reader, writer, app: HttpApp, request: HttpRequest) -> bool:
    """Serve one request; whether the connection can take another."""
    if "Transfer-Encoding" in request.headers:
        await _refuse(writer, 411, "chunked request bodies are not accepted; send Content-Length\n")
        return False
    consumed = request.content_length == 0
    keep_alive = request.headers.get("Connection", "").lower() != "close" and request.version == "HTTP/1.1"

    async def read_body(limit: int) -> bytes:
        nonlocal consumed
        if request.content_length > limit:
            raise BodyTooLarge
        body = await asyncio.wait_for(reader.readexactly(request.content_length), BODY_TIMEOUT_S)
        consumed = True
        return body

    out = Responder(writer, reader, keep_alive)
    await app(request, read_body, out)
    if not out.started:
        if out.gone:
            return False
        log.error("HTTP %s %s: no response was written", request.method, request.path)
        return False
    return keep_alive and consumed


def parse_head(head: bytes, port: int) -> HttpRequest:
    """The request line and headers of one HTTP/1.1 request; ValueError if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise ValueError(f"bad request line {lines[0][:80]!r}")
    headers = Headers()
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise ValueError(f"bad header line {line[:80]!r}")
        headers[name] = value.strip()
    lengths = set(headers.get_all("Content-Length"))
    if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
        raise ValueError("bad Content-Length")
    method, target, version = parts
    return HttpRequest(method, target, target.split("?", 1)[0], headers, version, port,
                       int(lengths.pop()) if lengths else 0)


async def _refuse(writer: asyncio.StreamWriter, status: int, text: str) -> None:
    body = text.encode()
    writer.write(f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: text/plain; "
                 f"charset=utf-8\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
