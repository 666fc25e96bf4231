"""ASGI to the daemon's terms: one HTTP request and its answer, and a websocket as `Connection` reads it.

Owns the deadlines on the application's side of a socket: the body's (408
past --body-timeout-s), every send's (past --send-timeout-s a client that
reads nothing is dropped: `ClientGone`), and noticing a client that left
while its request runs (the request's task is cancelled, so a completion
stops in the engine instead of decoding for nobody). Also the one rule
every request meets first: a header that may appear once appears once.
Knows nothing about routes or the engine.
"""

from __future__ import annotations

import asyncio
import http
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from uvicorn.protocols.utils import ClientDisconnected
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response

from streamchat.server.front import ABORT

log = logging.getLogger(__name__)

# Headers a request may carry at most once: two could say two things, and each
# check would read a different one.
SINGLE_HEADERS = ("host", "authorization", "origin", "content-length", "content-type", "transfer-encoding",
                  "if-none-match", "sec-websocket-key", "sec-websocket-version")


class BodyTooLarge(Exception):
    """The request's body is over the limit; it was not read (or not past the limit)."""


class BodyTimeout(Exception):
    """The body did not arrive within its deadline."""


class ClientGone(ConnectionError):
    """The client left, or read nothing for --send-timeout-s and was dropped."""


@dataclass
class HttpRequest:
    method: str
    target: str  # path and query as sent
    path: str
    headers: Headers
    version: str  # "HTTP/1.1", "HTTP/1.0"
    port: int  # the local port it came in on
    content_length: int | None = None  # None: no Content-Length (chunked, or no body)


def request_of(scope: dict) -> HttpRequest:
    headers = Headers()
    for name, value in scope["headers"]:
        headers[name.decode("latin-1")] = value.decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    path = scope["path"]
    length = headers.get_all("Content-Length")
    return HttpRequest(scope.get("method", "GET"), path + ("?" + query if query else ""), path, headers,
                       "HTTP/" + scope.get("http_version", "1.1"), (scope.get("server") or ("", 0))[1],
                       int(length[0]) if len(length) == 1 and length[0].isdigit() else None)


def duplicate_header(headers: Headers) -> str | None:
    """The first header of SINGLE_HEADERS that the request repeats, or None."""
    return next((name for name in SINGLE_HEADERS if len(headers.get_all(name)) > 1), None)


class HttpApp(Protocol):
    async def __call__(self, request: HttpRequest, read_body: Callable[[int], Awaitable[bytes]],
                       out: "Responder") -> None:
        """Answer through `out`; `read_body(limit)` reads the body (BodyTooLarge past `limit`)."""


class Responder:
    """Writes one response: whole (`send`), or streamed (`start`, `chunk`, `end`), each send with a deadline.

    HTTP/1.0 has no chunked encoding: a streamed answer to a 1.0 client is
    collected and sent whole, with its length, when it ends.
    """

    def __init__(self, send, abort: Callable[[], None], version: str, send_timeout_s: float) -> None:
        self._send = send
        self._abort = abort
        self.send_timeout_s = send_timeout_s
        self.whole_only = version == "HTTP/1.0"
        self.started = False
        self.complete = False
        self.gone = False  # the client left: nobody reads what follows
        self.close_after = False  # the connection cannot carry another request (a body left unread)
        self.body_pending: Callable[[], bool] = lambda: False
        self._held: tuple[int, dict[str, str], bytearray] | None = None

    async def send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        assert not self.started, "one response per request"
        self.started = True
        length = {} if status in (204, 304) else {"Content-Length": str(len(body))}  # no body, no length
        await self._message({"type": "http.response.start", "status": status,
                             "headers": _raw({**headers, **length}, self._closes())})
        self.complete = True
        await self._message({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: dict[str, str]) -> None:
        if self.whole_only:
            self._held = (status, headers, bytearray())
            return
        assert not self.started, "one response per request"
        self.started = True
        await self._message({"type": "http.response.start", "status": status,
                             "headers": _raw(headers, self._closes())})

    async def chunk(self, data: bytes) -> None:
        if self._held is not None:
            self._held[2].extend(data)
        elif data:
            await self._message({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        if self._held is not None:
            status, headers, body = self._held
            self._held = None
            return await self.send(status, bytes(body), headers)
        self.complete = True
        await self._message({"type": "http.response.body", "body": b""})

    def _closes(self) -> bool:
        return self.close_after or self.body_pending()

    async def _message(self, message: dict) -> None:
        if self.gone:
            raise ClientGone("the client left")
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await self._send(message)
        except TimeoutError:
            self.gone = True
            self._abort()
            log.warning("dropped an HTTP client that read nothing for %g s", self.send_timeout_s)
            raise ClientGone(f"the client read nothing for {self.send_timeout_s:g} s") from None


def _raw(headers: dict[str, str], close: bool) -> list[tuple[bytes, bytes]]:
    raw = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]
    return raw + [(b"connection", b"close")] if close else raw


class _Body:
    """The request body, read once within its deadline."""

    def __init__(self, receive, request: HttpRequest, timeout_s: float) -> None:
        self.receive = receive
        self.request = request
        self.timeout_s = timeout_s
        self.read_whole = asyncio.Event()
        if request.content_length is None and "Transfer-Encoding" not in request.headers:
            self.read_whole.set()  # no body

    async def read(self, limit: int) -> bytes:
        if (self.request.content_length or 0) > limit:
            raise BodyTooLarge
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await self.receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone("the client left before its body was read")
                    body += message.get("body", b"")
                    if len(body) > limit:
                        raise BodyTooLarge
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise BodyTimeout from None
        self.read_whole.set()
        return bytes(body)


async def serve_http(app: HttpApp, scope: dict, receive, send, send_timeout_s: float, body_timeout_s: float,
                     tasks: set[asyncio.Task]) -> None:
    """Run `app` for one request in a task of `tasks`; cancel it if the client leaves before its answer ends.

    Once the body is read (or when there is none), the next ASGI message can
    only be the client's disconnect.
    """
    request = request_of(scope)
    out = Responder(send, scope["extensions"][ABORT], request.version, send_timeout_s)
    body = _Body(receive, request, body_timeout_s)
    out.body_pending = lambda: not body.read_whole.is_set()

    async def run() -> None:
        try:
            await app(request, body.read, out)
        except BodyTimeout:
            if not out.started:
                out.close_after = True
                await out.send(408, f"the request body did not arrive within {body_timeout_s:g} s\n".encode(),
                               {"Content-Type": "text/plain; charset=utf-8"})
        except ClientGone:
            pass
        if not out.started and not out.gone:
            log.error("HTTP %s %s: no response was written", request.method, request.path)

    async def watch() -> None:
        await body.read_whole.wait()
        while (await receive())["type"] != "http.disconnect":
            pass

    work, watcher = asyncio.create_task(run()), asyncio.create_task(watch())
    tasks.add(work)
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and not out.complete:  # the client left mid-answer: stop what it asked for
            out.gone = True
            work.cancel()
        await asyncio.gather(work, return_exceptions=True)
    finally:
        tasks.discard(work)
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)


async def answer(scope: dict, send, response: Response, send_timeout_s: float, close: bool = False) -> None:
    """Send a whole websockets `Response` (status, headers, body) as an ASGI HTTP answer, within the deadline."""
    out = Responder(send, scope["extensions"][ABORT], "HTTP/1.1", send_timeout_s)
    out.close_after = close
    try:
        await out.send(response.status_code, response.body or b"", dict(response.headers.raw_items()))
    except ClientGone:
        pass


async def deny(send, response: Response) -> None:
    """Refuse a websocket handshake with this HTTP answer."""
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.raw_items()]
    await send({"type": "websocket.http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": response.body or b""})


def plain(status: int, text: str, headers: dict | None = None) -> Response:
    h = Headers({"Content-Type": "text/plain; charset=utf-8", **(headers or {})})
    body = text.encode()
    h["Content-Length"] = str(len(body))
    return Response(status, http.HTTPStatus(status).phrase, h, body)


class AsgiWebSocket:
    """An accepted ASGI websocket with the calls `Connection` makes: frames by `async for`, `send`, `close`.

    Every send has a deadline (--send-timeout-s): a client that reads nothing
    for that long is dropped, and its frames iteration ends as if it had left.
    """

    def __init__(self, scope: dict, receive, send, send_timeout_s: float) -> None:
        self._receive = receive
        self._send = send
        self._abort = scope["extensions"][ABORT]
        self.send_timeout_s = send_timeout_s
        self.remote_address = scope.get("client")
        self.query_string = scope.get("query_string", b"").decode("latin-1")
        self.close_code: int | None = None

    async def __aiter__(self):
        while True:
            message = await self._receive()
            if message["type"] == "websocket.disconnect":
                self.close_code = message.get("code", 1005)
                return
            if message["type"] != "websocket.receive":
                continue
            text = message.get("text")
            yield text if text is not None else message.get("bytes", b"")

    async def send(self, data: str, text: bool = True) -> None:
        assert text, "the protocol sends text frames only"
        await self._deadline({"type": "websocket.send", "text": data})

    async def close(self, code: int = 1000, reason: str = "") -> None:
        try:
            await self._deadline({"type": "websocket.close", "code": code, "reason": reason})
        except ConnectionClosed:
            pass

    async def _deadline(self, message: dict) -> None:
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await self._send(message)
        except TimeoutError:
            self._abort()
            log.warning("dropped a websocket client that read nothing for %g s", self.send_timeout_s)
            raise ConnectionClosed(None, None) from None
        except (ClientDisconnected, RuntimeError):  # gone, or closed already: nothing more can be sent
            raise ConnectionClosed(None, None) from None
