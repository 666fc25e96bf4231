"""Tests for the handshake's guards: API key, Origin allow-list, connection and session limits."""

import asyncio

import pytest
from conftest import Client, Daemon
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("db") / "g.db", "--api-key", "s3cret", "--allowed-origins",
               "http://good.example", "--max-connections", "3", "--max-sessions-per-connection", "2").start()
    yield d
    d.stop()


def status_of(url, **kw):
    async def go():
        try:
            async with connect(url, **kw):
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code
    return asyncio.run(go())


def test_api_key_required_by_header_or_subprotocol(guarded):
    """No key or a wrong one: 401; Bearer header or the insecure subprotocol: accepted."""
    assert status_of(guarded.url) == 401
    assert status_of(guarded.url, additional_headers={"Authorization": "Bearer nope"}) == 401
    assert status_of(guarded.url, additional_headers={"Authorization": "Bearer s3cret"}) == 101
    assert status_of(guarded.url, subprotocols=["realtime", "openai-insecure-api-key.s3cret"]) == 101


def test_disallowed_origin_gets_403(guarded):
    """An Origin outside the allow-list is refused with 403; the listed one passes."""
    auth = {"Authorization": "Bearer s3cret"}
    assert status_of(guarded.url, additional_headers=auth, origin="http://evil.example") == 403
    assert status_of(guarded.url, additional_headers=auth, origin="http://good.example") == 101


def test_wrong_model_query_is_refused(guarded):
    """`model` must name the served model when given."""
    auth = {"Authorization": "Bearer s3cret"}
    assert status_of(guarded.url + "?model=gpt-4o", additional_headers=auth) == 400


def test_connection_limit_answers_503_and_session_limit_errors(guarded):
    """Past --max-connections the handshake gets 503; past the session limit, resume errors."""
    auth = {"Authorization": "Bearer s3cret"}

    async def go():
        held = [await Client.open(guarded.url, additional_headers=auth) for _ in range(3)]
        try:
            async with connect(guarded.url, additional_headers=auth):
                raise AssertionError("a fourth connection was accepted")
        except InvalidStatus as exc:
            assert exc.response.status_code == 503
        a = held[0]
        other = held[1].created["session"]
        await held[1].send({"type": "session.update", "session": {"instructions": "x"}})
        await held[1].until("session.updated")
        await a.send({"type": "streamchat.session.resume", "session_id": other["id"],
                      "resume_token": other["resume_token"]})
        assert (await a.recv())["type"] == "streamchat.session.resumed"
        await a.send({"type": "streamchat.session.resume", "session_id": other["id"],
                      "resume_token": other["resume_token"], "event_id": "third"})
        err = await a.recv()
        assert err["type"] == "error" and err["error"]["event_id"] == "third"
        assert "too many sessions" in err["error"]["message"]
        for c in held:
            await c.close()

    asyncio.run(go())
