"""Tests for the handshake's guards: API key, Origin and Host checks, connection and session limits."""

import asyncio
import http.client

import pytest
from conftest import Client, Daemon
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("db") / "g.db", "--api-key", "s3cret", "--allowed-origins",
               "http://good.example", "--max-connections", "3", "--max-sessions-per-connection", "2",
               "--served-model-name", "smol", "--served-model-name", "SmolLM2-135M-Instruct,gpt-realtime").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def open_daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("db") / "o.db", "--allowed-origins", "*",
               "--allowed-hosts", "mybox.lan,Other.LAN").start()
    yield d
    d.stop()


def handshake(url, **kw):
    """(status, body) of a websocket handshake: 101 and b"" when it succeeds."""
    async def go():
        try:
            async with connect(url, **kw):
                return 101, b""
        except InvalidStatus as exc:
            return exc.response.status_code, exc.response.body
    return asyncio.run(go())


def status_of(url, **kw):
    return handshake(url, **kw)[0]


def get(d, path, headers):
    """(status, body) of a plain GET with these headers; Host is 127.0.0.1:port unless given, None omits it."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for name, value in {"Host": f"127.0.0.1:{d.port}", **headers}.items():
            if value is not None:
                conn.putheader(name, value)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_default_refuses_other_origins_with_a_hint(daemon):
    """Without --allowed-origins a foreign Origin gets 403 saying which flag allows it."""
    status, body = handshake(daemon.url, origin="http://evil.example")
    assert (status, body) == (403, b"Origin 'http://evil.example' is not allowed; to allow it, "
                                    b"start the daemon with --allowed-origins http://evil.example\n")
    assert status_of(daemon.url, origin="null") == 403
    assert status_of(daemon.url, origin=f"http://127.0.0.1:{daemon.port + 1}") == 403
    assert status_of(daemon.url, origin=f"https://127.0.0.1:{daemon.port}") == 403
    assert get(daemon, "/elsewhere", {"Origin": "http://evil.example"})[0] == 403


def test_default_accepts_no_origin_and_its_own(daemon):
    """No Origin (not a browser) and the daemon's own loopback origins on its port pass."""
    assert status_of(daemon.url) == 101
    for host in ("127.0.0.1", "localhost", "[::1]"):
        assert status_of(daemon.url, origin=f"http://{host}:{daemon.port}") == 101


def test_health_and_metrics_skip_the_origin_check(daemon):
    """A foreign Origin may GET /healthz and /metrics (a browser cannot read the answer cross-origin)."""
    for path in ("/healthz", "/metrics"):
        assert get(daemon, path, {"Origin": "http://evil.example"})[0] == 200


def test_foreign_host_gets_403_on_every_path(daemon):
    """Bound to loopback, a non-loopback Host (DNS rebinding) gets 403, /healthz included."""
    status, body = get(daemon, "/v1/realtime", {"Host": f"evil.example:{daemon.port}"})
    assert (status, body) == (403, b"Host 'evil.example:" + str(daemon.port).encode()
                              + b"' is not allowed; to allow it, start the daemon with --allowed-hosts NAME\n")
    for path in ("/healthz", "/metrics", "/"):
        assert get(daemon, path, {"Host": "evil.example"})[0] == 403
    assert get(daemon, "/healthz", {"Host": "127.0.0.1.evil.example"})[0] == 403
    assert get(daemon, "/healthz", {"Host": None})[0] == 403
    for host in ("localhost", f"localhost:{daemon.port}", "127.0.0.2:1", f"[::1]:{daemon.port}", "LOCALHOST"):
        assert get(daemon, "/healthz", {"Host": host})[0] == 200
    assert status_of(f"ws://localhost:{daemon.port}/v1/realtime") == 101


def test_star_allows_any_origin_and_allowed_hosts_extend_loopback(open_daemon):
    """`--allowed-origins '*'` accepts every Origin; --allowed-hosts adds names, any port, any case."""
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{open_daemon.port}"):
        assert status_of(open_daemon.url, origin=origin) == 101
    assert status_of(open_daemon.url) == 101
    for host in ("mybox.lan", "MyBox.lan:8765", "other.lan", "localhost"):
        assert get(open_daemon, "/healthz", {"Host": host})[0] == 200
    assert get(open_daemon, "/healthz", {"Host": "evil.example"})[0] == 403


def test_api_key_required_by_header_or_subprotocol(guarded):
    """No key or a wrong one: 401; Bearer header or the insecure subprotocol: accepted."""
    assert status_of(guarded.url) == 401
    assert status_of(guarded.url, additional_headers={"Authorization": "Bearer nope"}) == 401
    assert status_of(guarded.url, additional_headers={"Authorization": "Bearer s3cret"}) == 101
    assert status_of(guarded.url, subprotocols=["realtime", "openai-insecure-api-key.s3cret"]) == 101


def test_disallowed_origin_gets_403(guarded):
    """An Origin outside the allow-list is refused with 403; the listed one passes, and only it."""
    auth = {"Authorization": "Bearer s3cret"}
    assert status_of(guarded.url, additional_headers=auth, origin="http://evil.example") == 403
    assert status_of(guarded.url, additional_headers=auth, origin="http://good.example") == 101
    # An explicit list replaces the default: the daemon's own origin is not in it.
    assert status_of(guarded.url, additional_headers=auth, origin=f"http://127.0.0.1:{guarded.port}") == 403
    # The Origin check runs before the key check, so a foreign page learns nothing more.
    assert status_of(guarded.url, origin="http://evil.example") == 403


def test_wrong_model_query_is_refused(guarded):
    """`model` must name a served model when given: 400 naming the served names; each of them passes,
    and the session reports the first."""
    auth = {"Authorization": "Bearer s3cret"}
    assert handshake(guarded.url + "?model=gpt-4o", additional_headers=auth) == (
        400, b"this daemon serves the model 'smol', 'SmolLM2-135M-Instruct', 'gpt-realtime', not 'gpt-4o'; "
             b"the operator may add names with --served-model-name\n")
    for name in ("smol", "SmolLM2-135M-Instruct", "gpt-realtime"):
        assert status_of(f"{guarded.url}?model={name}", additional_headers=auth) == 101

    async def created_model():
        c = await Client.open(guarded.url + "?model=gpt-realtime", additional_headers=auth)
        await c.close()
        return c.created["session"]["model"]
    assert asyncio.run(created_model()) == "smol"


def test_default_serves_only_the_models_own_name(daemon):
    """Without --served-model-name the model's own name is the only one accepted."""
    assert status_of(daemon.url + "?model=SmolLM2-135M-Instruct") == 101
    assert handshake(daemon.url + "?model=gpt-4o")[0] == 400
    assert b"'SmolLM2-135M-Instruct', not 'gpt-4o'" in handshake(daemon.url + "?model=gpt-4o")[1]


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
