"""An async client for the daemon's websocket protocol (see PROTOCOL.md).

Owns one websocket: the handshake (with the API key), `session.created`,
`streamchat.session.resume`, sending client events and reading server events,
and turning transport failures and `error` events into `ClientError`s.
It knows nothing about terminals, prompts or the session file.

One coroutine at a time reads (`recv`, `request`); sending from another task,
such as a `response.cancel` on Ctrl-C, is allowed.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from . import DEFAULT_URL
from .errors import (
    AuthFailed,
    ClientError,
    ConnectionLost,
    DaemonNotRunning,
    Overloaded,
    from_error_event,
)

log = logging.getLogger(__name__)

_MAX_FRAME = 64 * 2**20
# websockets >= 15 reads proxies from the environment; never for loopback.
_HAS_PROXY_ARG = "proxy" in inspect.signature(connect.__init__).parameters
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is and how to authenticate."""

    url: str = DEFAULT_URL
    api_key: str | None = None
    open_timeout_s: float = 10.0
    reply_timeout_s: float = 60.0


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for `overloaded` answers and reconnects."""

    attempts: int = 5
    initial_s: float = 0.5
    max_s: float = 8.0

    def delays(self) -> Iterator[float]:
        """The waits between attempts: one fewer than `attempts`."""
        delay = self.initial_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * 2, self.max_s)


class Connection:
    """One open websocket attached to one session."""

    def __init__(self, ws: ClientConnection, endpoint: Endpoint, session: dict,
                 resume_token: str | None, restored_from: str | None,
                 retry: RetryPolicy | None = None) -> None:
        self.endpoint = endpoint
        self.retry = retry or RetryPolicy()
        self.session = session
        self.resume_token = resume_token  # only known for a new session
        self.restored_from = restored_from  # None for a new session
        self._ws = ws
        self._ids = itertools.count(1)

    @property
    def session_id(self) -> str:
        return str(self.session.get("id", ""))

    async def send(self, type_: str, **fields: object) -> str:
        """Sends one client event; returns its `event_id`."""
        event_id = f"client_{next(self._ids)}"
        event = {"type": type_, "event_id": event_id, **fields}
        log.debug("-> %s", event)
        try:
            await self._ws.send(json.dumps(event, ensure_ascii=False))
        except ConnectionClosed as exc:
            raise ConnectionLost(self.endpoint.url, _close_reason(exc)) from exc
        return event_id

    async def recv(self) -> dict:
        """The next server event."""
        return await _recv_event(self._ws, self.endpoint.url)

    async def request(self, type_: str, expect: str | tuple[str, ...],
                      timeout_s: float | None = None, **fields: object) -> dict:
        """Sends an event and returns the first event of a type in `expect`.

        An `error` about this event raises; `overloaded` is retried with
        backoff (`self.retry`) first. Other events that arrive meanwhile are
        skipped. The answer is awaited `timeout_s` (default
        `endpoint.reply_timeout_s`).
        """
        delays = self.retry.delays()
        started = time.monotonic()
        for attempt in itertools.count(1):
            event_id = await self.send(type_, **fields)
            try:
                return await self._wait_for(expect, event_id, timeout_s)
            except Overloaded as exc:
                delay = next(delays, None)
                if delay is None:
                    raise Overloaded(attempt, time.monotonic() - started) from exc
                log.info("overloaded; retrying %s in %.1f s", type_, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _wait_for(self, expect: str | tuple[str, ...], event_id: str,
                        timeout_s: float | None = None) -> dict:
        wanted = (expect,) if isinstance(expect, str) else expect
        deadline = self.endpoint.reply_timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(self._first_of(wanted, event_id), deadline)
        except asyncio.TimeoutError:
            raise ClientError(f"no answer from the daemon within {deadline:.0f} s "
                              f"(waiting for {' or '.join(wanted)})") from None

    async def _first_of(self, wanted: tuple[str, ...], event_id: str) -> dict:
        while True:
            event = await self.recv()
            if event.get("type") in wanted:
                return event
            if event.get("type") == "error":
                error = event.get("error") or {}
                if error.get("event_id") in (None, "", event_id):
                    raise from_error_event(error, self.session_id)
                log.info("error about an earlier event: %s", error)

    async def close(self) -> None:
        await self._ws.close()

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def open_connection(endpoint: Endpoint, resume: tuple[str, str] | None = None,
                          retry: RetryPolicy | None = None) -> Connection:
    """Connects and attaches to a new session, or to `resume` = (id, token).

    Retries with backoff while the daemon answers `overloaded` (or HTTP 503).
    """
    policy = retry or RetryPolicy()
    delays = policy.delays()
    started = time.monotonic()
    for attempt in itertools.count(1):
        try:
            return await _open_once(endpoint, resume, policy)
        except Overloaded as exc:
            delay = next(delays, None)
            if delay is None:
                raise Overloaded(attempt, time.monotonic() - started) from exc
            log.info("overloaded; reconnecting in %.1f s", delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def _open_once(endpoint: Endpoint, resume: tuple[str, str] | None,
                     retry: RetryPolicy) -> Connection:
    ws = await _handshake(endpoint, resume[0] if resume else None)
    try:
        return await asyncio.wait_for(_attach(ws, endpoint, resume, retry),
                                      endpoint.reply_timeout_s)
    except asyncio.TimeoutError:
        await ws.close()
        raise ClientError(f"the daemon at {endpoint.url} did not announce a session") from None
    except BaseException:
        await ws.close()
        raise


async def _attach(ws: ClientConnection, endpoint: Endpoint, resume: tuple[str, str] | None,
                  retry: RetryPolicy) -> Connection:
    """Waits for session.created, then resumes `resume` = (id, token) if given."""
    created = await _first_session_event(ws, endpoint.url, "session.created", "")
    if resume is None:
        session = created["session"]
        return Connection(ws, endpoint, session, session.get("resume_token"), None, retry)
    session_id, token = resume
    await ws.send(json.dumps({"type": "streamchat.session.resume", "event_id": "client_0",
                              "session_id": session_id, "resume_token": token}))
    resumed = await _first_session_event(ws, endpoint.url, "streamchat.session.resumed", session_id)
    return Connection(ws, endpoint, resumed["session"], token, resumed.get("restored_from"), retry)


async def _first_session_event(ws: ClientConnection, url: str, type_: str, session_id: str) -> dict:
    while True:
        event = await _recv_event(ws, url)
        if event.get("type") == type_ and isinstance(event.get("session"), dict):
            return event
        if event.get("type") == "error":
            raise from_error_event(event.get("error") or {}, session_id)
        log.debug("skipped before %s: %s", type_, event.get("type"))


def with_session_id(url: str, session_id: str | None) -> str:
    """`url` naming the session to resume (`?session_id=`), so a proxy in front of a fleet routes it home."""
    if session_id is None:
        return url
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "session_id"]
    return urlunsplit(parts._replace(query=urlencode(query + [("session_id", session_id)])))


async def _handshake(endpoint: Endpoint, session_id: str | None = None) -> ClientConnection:
    url = with_session_id(endpoint.url, session_id)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    extra: dict = {}
    if _HAS_PROXY_ARG and _is_loopback(url):
        extra["proxy"] = None
    try:
        return await connect(url, additional_headers=headers, open_timeout=endpoint.open_timeout_s,
                             max_size=_MAX_FRAME, max_queue=1024,
                             user_agent_header="streamchat-client", **extra)
    except InvalidStatus as exc:
        raise _status_error(url, exc.response.status_code, bool(endpoint.api_key)) from exc
    except InvalidURI as exc:
        raise ClientError(f"{url} is not a websocket URL; expected e.g. {DEFAULT_URL}") from exc
    except ConnectionRefusedError as exc:
        raise DaemonNotRunning(url) from exc
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise ClientError(f"no answer from {url} within {endpoint.open_timeout_s:.0f} s") from exc
    except OSError as exc:
        if "refused" in str(exc).lower():  # several addresses, all refused
            raise DaemonNotRunning(url) from exc
        raise ClientError(f"cannot connect to {url}: {exc.strerror or exc}") from exc
    except InvalidHandshake as exc:
        raise ClientError(f"{url} did not accept a websocket handshake: {exc}") from exc


def _status_error(url: str, status: int, key_given: bool) -> ClientError:
    if status == 401:
        return AuthFailed(url, key_given)
    if status in (429, 503):
        return Overloaded()
    if status == 403:
        return ClientError(f"the daemon at {url} refused this client "
                           "(HTTP 403: origin not allowed).")
    if status == 404:
        return ClientError(f"no websocket endpoint at {url} (HTTP 404); "
                           "the daemon serves /v1/realtime.")
    return ClientError(f"the daemon at {url} refused the websocket handshake (HTTP {status}).")


async def _recv_event(ws: ClientConnection, url: str) -> dict:
    try:
        frame = await ws.recv()
    except ConnectionClosed as exc:
        raise ConnectionLost(url, _close_reason(exc)) from exc
    try:
        event = json.loads(frame)
    except ValueError as exc:
        raise ClientError(f"the daemon sent a frame that is not JSON: {str(frame)[:80]!r}") from exc
    if not isinstance(event, dict):
        raise ClientError(f"the daemon sent a frame that is not an event: {str(frame)[:80]!r}")
    log.debug("<- %s", event)
    return event


def _close_reason(exc: ConnectionClosed) -> str:
    rcvd = exc.rcvd
    if rcvd is None:
        return "closed without a close frame"
    return f"closed with code {rcvd.code}" + (f": {rcvd.reason}" if rcvd.reason else "")


def _is_loopback(url: str) -> bool:
    try:
        return (urlsplit(url).hostname or "") in _LOOPBACK
    except ValueError:
        return False
