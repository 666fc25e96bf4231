"""The listening socket: uvicorn's HTTP/1.1 and websocket protocols, with the daemon's connection limits.

Owns what happens on a connection outside the ASGI application: which
connections count against --max-connections (`Gate`), the deadline of a
request head (408 past --head-timeout-s), and the means to drop a connection
whose client stopped reading (`ABORT` in the scope's extensions: closing
would wait for a buffer that never drains). uvicorn parses HTTP (httptools)
and hands websocket upgrades to the `websockets` package's sans-I/O
protocol, so frames, limits and close codes are websockets' own. Knows
nothing about routes, sessions or the engine: the ASGI app does.

    accept -> FrontHttp: the head within --head-timeout-s, else 408 and close
        Upgrade: websocket -> FrontWebSocket (websockets' ServerProtocol) -> app, scope "websocket"
        anything else      -> app, scope "http" (keep-alive, chunked responses: uvicorn's)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState

from streamchat.config import ServerConfig

log = logging.getLogger(__name__)

ABORT = "streamchat.abort"  # scope["extensions"][ABORT]: drop the connection now, unsent bytes and all
KEEP_ALIVE_S = 30.0  # a kept-alive connection with no new request is closed after this
PING_INTERVAL_S = 20.0  # websocket keepalive, as before: a ping every 20 s, 20 s for its pong
# messages received and not yet taken by the app before reading stops (and with it the pongs: a
# client is only dropped as silent if it sends this many events while one waits on the engine)
MAX_QUEUED_MESSAGES = 4


class Gate:
    """The connections that count against --max-connections, and every open one.

    Counted: a websocket from accept to close; an HTTP connection from accept
    until its response is complete, and again from the first byte of each
    later request (an unfinished head or handshake counts). Not counted: an
    HTTP connection idle between kept-alive requests (it costs a socket, and
    is closed after KEEP_ALIVE_S).
    """

    def __init__(self) -> None:
        self.busy: set[asyncio.Protocol] = set()
        self.open: set[asyncio.Protocol] = set()

    @property
    def count(self) -> int:
        return len(self.busy)

    def enter(self, conn: asyncio.Protocol) -> None:
        self.open.add(conn)
        self.busy.add(conn)

    def leave(self, conn: asyncio.Protocol) -> None:
        self.open.discard(conn)
        self.busy.discard(conn)


def bound_send_buffer(transport: asyncio.Transport, num_bytes: int) -> None:
    """At most `num_bytes` wait in the transport, and a fixed socket buffer in the kernel.

    Linux grows a loopback or LAN socket's send buffer up to 4 MiB on its own;
    a fixed size keeps a client that stops reading from holding megabytes,
    and makes its sends wait (and meet their deadline) once that much is queued.
    """
    transport.set_write_buffer_limits(high=num_bytes)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)


class FrontHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, counted by the gate, with a deadline on each request head."""

    def __init__(self, config, server_state, app_state, _loop=None, *, gate: Gate, head_timeout_s: float,
                 send_buffer_bytes: int) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.gate = gate
        self.head_timeout_s = head_timeout_s
        self.send_buffer_bytes = send_buffer_bytes
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        bound_send_buffer(transport, self.send_buffer_bytes)
        self.gate.enter(self)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.gate.leave(self)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {ABORT: self.transport.abort}
        self.gate.busy.add(self)
        if self.head_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined:
            self.gate.busy.discard(self)

    def handle_websocket_upgrade(self) -> None:
        self._disarm()
        self.gate.leave(self)  # the websocket protocol counts it from here
        super().handle_websocket_upgrade()

    def _arm(self) -> None:
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        body = f"the request head did not arrive within {self.head_timeout_s:g} s\n".encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


class FrontWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's websockets protocol, counted by the gate, with ABORT in its scope."""

    def __init__(self, config, server_state, app_state, _loop=None, *, gate: Gate) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.gate = gate

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.gate.enter(self)

    def connection_lost(self, exc) -> None:
        self.gate.leave(self)
        super().connection_lost(exc)

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:  # the handshake was valid: the app runs (from the next loop turn)
            scope["extensions"][ABORT] = self.transport.abort

    def send_receive_event_to_app(self) -> None:
        """Queue a message for the app, reading on until MAX_QUEUED_MESSAGES wait.

        uvicorn stops reading after every message until the app takes it; an event
        that waits 30 s on a restarting engine then leaves the client's pongs unread,
        and the keepalive drops a client that did nothing wrong (1011).
        """
        paused, self.read_paused = self.read_paused, True  # uvicorn's own pause: not here
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = paused
        if not paused and self.queue.qsize() >= MAX_QUEUED_MESSAGES:
            self.read_paused = True
            self.transport.pause_reading()


async def listen(app, cfg: ServerConfig, gate: Gate) -> asyncio.Server:
    """Bind cfg.host:cfg.port and serve `app` (ASGI 3) on it through the protocols above."""
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, lifespan="off", interface="asgi3",
        http=functools.partial(FrontHttp, gate=gate, head_timeout_s=cfg.head_timeout_s,
                               send_buffer_bytes=cfg.send_buffer_bytes),
        ws=functools.partial(FrontWebSocket, gate=gate), ws_max_size=cfg.max_frame_bytes,
        ws_ping_interval=PING_INTERVAL_S, ws_ping_timeout=PING_INTERVAL_S, timeout_keep_alive=KEEP_ALIVE_S,
        # the daemon's own rules decide who may ask (no X-Forwarded-* trusted), and its own log says what
        proxy_headers=False, server_header=False, log_config=None, access_log=False,
        ws_per_message_deflate=cfg.ws_compression)
    config.load()
    state = ServerState()
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # one INFO line per handshake otherwise

    def protocol() -> asyncio.Protocol:
        return config.http_protocol_class(config=config, server_state=state, app_state={})

    return await asyncio.get_running_loop().create_server(protocol, cfg.host, cfg.port, backlog=2048)


def close_all(gate: Gate, grace_s: float) -> None:
    """Shutdown: close every open connection (uvicorn's way), and abort those still open after `grace_s`."""
    loop = asyncio.get_running_loop()
    for conn in list(gate.open):
        conn.shutdown()
        loop.call_later(grace_s, conn.transport.abort)
