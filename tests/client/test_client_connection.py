"""Tests of the protocol client against the fake daemon: sessions, resume and errors."""

import asyncio
import socket
import time

import pytest
from client_fake_daemon import FakeDaemon

from streamchat.client.connection import Endpoint, RetryPolicy, open_connection
from streamchat.client.errors import (
    AuthFailed,
    ConnectionLost,
    DaemonNotRunning,
    Overloaded,
    ServerError,
    SessionNotFound,
)

FAST = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_new_session_exposes_id_token_and_session_object():
    """A connection without resume gets session.created's id and resume token."""
    async def main():
        async with FakeDaemon() as daemon:
            async with await open_connection(Endpoint(daemon.url)) as conn:
                return conn.session_id, conn.resume_token, conn.restored_from, conn.session["model"]

    assert run(main()) == ("sess_1", "tok_1", None, "fake-model")


def test_resume_sends_resume_first_and_switches_session():
    """Resuming sends streamchat.session.resume as the first event and reports restored_from."""
    async def main():
        async with FakeDaemon() as daemon:
            daemon.add_session("sess_old", "secret", instructions="be brief")
            conn = await open_connection(Endpoint(daemon.url + "?model=fake-model"), resume=("sess_old", "secret"))
            await conn.close()
            return daemon.received, conn.session_id, conn.restored_from, conn.session["instructions"], daemon.paths

    received, session_id, restored, instructions, paths = run(main())
    assert paths == ["/v1/realtime?model=fake-model&session_id=sess_old"]  # a fleet's proxy routes on it
    assert [e["type"] for e in received] == ["streamchat.session.resume"]
    assert received[0]["session_id"] == "sess_old" and received[0]["resume_token"] == "secret"
    assert (session_id, restored, instructions) == ("sess_old", "memory", "be brief")


def test_wrong_resume_token_raises_session_not_found():
    """A wrong token is reported as session_not_found, naming the session."""
    async def main():
        async with FakeDaemon() as daemon:
            daemon.add_session("sess_old", "secret")
            await open_connection(Endpoint(daemon.url), resume=("sess_old", "wrong"))

    with pytest.raises(SessionNotFound, match="session sess_old was not found"):
        run(main())


def test_connection_refused_says_how_to_start_the_daemon():
    """Nothing listening: the message names `make serve` and `streamchat serve`."""
    url = f"ws://127.0.0.1:{free_port()}/v1/realtime"
    with pytest.raises(DaemonNotRunning) as info:
        run(open_connection(Endpoint(url)))
    message = str(info.value)
    assert url in message and "connection refused" in message
    assert "`make serve`" in message and "`streamchat serve`" in message


def test_http_401_says_how_to_pass_the_key():
    """A refused key maps HTTP 401 to a message naming --api-key and STREAMCHAT_API_KEY."""
    async def main():
        async with FakeDaemon(api_key="right") as daemon:
            with pytest.raises(AuthFailed) as info:
                await open_connection(Endpoint(daemon.url, api_key="wrong"))
            return str(info.value), daemon.auth_headers

    message, headers = run(main())
    assert "rejected the API key (HTTP 401)" in message
    assert "--api-key" in message and "STREAMCHAT_API_KEY" in message
    assert headers == ["Bearer wrong"]


def test_missing_key_message_and_bearer_header_on_success():
    """Without a key the 401 says one is required; with the right key the handshake sends Bearer."""
    async def main():
        async with FakeDaemon(api_key="k1") as daemon:
            with pytest.raises(AuthFailed, match="requires an API key"):
                await open_connection(Endpoint(daemon.url))
            async with await open_connection(Endpoint(daemon.url, api_key="k1")):
                pass
            return daemon.auth_headers

    assert run(main()) == [None, "Bearer k1"]


def test_request_retries_overloaded_with_backoff():
    """Two overloaded answers are retried after growing delays; the third attempt succeeds."""
    async def main():
        async with FakeDaemon(overloaded_responses=2) as daemon:
            policy = RetryPolicy(attempts=3, initial_s=0.05, max_s=1.0)
            async with await open_connection(Endpoint(daemon.url), retry=policy) as conn:
                started = time.monotonic()
                created = await conn.request("response.create", "response.created")
                return created, time.monotonic() - started, daemon.types()

    created, elapsed, types = run(main())
    assert created["response"]["status"] == "in_progress"
    assert types == ["response.create"] * 3
    assert elapsed >= 0.05 + 0.10


def test_overloaded_after_all_attempts_says_so():
    """When every attempt is overloaded, the error counts the attempts and says to retry later."""
    async def main():
        async with FakeDaemon(overloaded_responses=10) as daemon:
            async with await open_connection(Endpoint(daemon.url), retry=FAST) as conn:
                with pytest.raises(Overloaded) as info:
                    await conn.request("response.create", "response.created")
                return str(info.value), daemon.types()

    message, types = run(main())
    assert message.startswith("the daemon is overloaded: no capacity after 3 attempts")
    assert message.endswith("Try again later.")
    assert types == ["response.create"] * 3


def test_overloaded_connect_is_retried():
    """An overloaded answer instead of session.created makes open_connection reconnect."""
    async def main():
        async with FakeDaemon(overloaded_connects=2) as daemon:
            async with await open_connection(Endpoint(daemon.url), retry=FAST) as conn:
                return conn.session_id, daemon.connections

    assert run(main()) == ("sess_1", 3)


def test_http_503_at_handshake_is_retried_then_reported():
    """HTTP 503 at the handshake counts as overloaded: retried, then reported after the last attempt."""
    async def main():
        async with FakeDaemon(http_503_connects=2) as daemon:
            async with await open_connection(Endpoint(daemon.url), retry=FAST) as conn:
                session_id = conn.session_id
            daemon.http_503_connects = 5
            with pytest.raises(Overloaded, match="no capacity after 3 attempts"):
                await open_connection(Endpoint(daemon.url), retry=FAST)
            return session_id

    assert run(main()) == "sess_1"


def test_error_about_the_request_raises_server_error_with_code():
    """An error event echoing the request's event_id raises with the daemon's code."""
    async def main():
        async with FakeDaemon() as daemon:
            async with await open_connection(Endpoint(daemon.url)) as conn:
                await conn.request("response.cancel", "never.sent")

    with pytest.raises(ServerError) as info:
        run(main())
    assert info.value.code == "response_cancel_not_active"


def test_request_skips_unrelated_events_and_echoes_event_ids():
    """Events of other types are skipped; each client event carries a fresh event_id."""
    async def main():
        async with FakeDaemon() as daemon:
            async with await open_connection(Endpoint(daemon.url)) as conn:
                item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
                done = await conn.request("conversation.item.create", "conversation.item.done", item=item)
                stats = await conn.request("streamchat.session.stats", "streamchat.session.stats")
                return done["type"], stats["items"], [e["event_id"] for e in daemon.received]

    assert run(main()) == ("conversation.item.done", 1, ["client_1", "client_2"])


def test_closed_socket_raises_connection_lost():
    """A socket the daemon closes surfaces as ConnectionLost, not a websockets exception."""
    async def main():
        async with FakeDaemon(drop_after_deltas=0) as daemon:
            async with await open_connection(Endpoint(daemon.url)) as conn:
                await conn.send("response.create")
                while True:
                    await conn.recv()

    with pytest.raises(ConnectionLost, match="closed with code 1011"):
        run(main())
