"""The web page's files: what GET answers (types, caching, CSP, 404s), and that the page fetches nothing elsewhere."""

import asyncio
import http.client
import re
from importlib import resources

import pytest
from websockets.asyncio.client import connect
from websockets.datastructures import Headers

from streamchat.server import web

WEB = resources.files("streamchat.server").joinpath("static")
TYPES = {"/": "text/html; charset=utf-8", "/static/app.js": "text/javascript; charset=utf-8",
         "/static/style.css": "text/css; charset=utf-8", "/static/icon.svg": "image/svg+xml"}
NOT_SERVED = ["/static/nope.js", "/static/", "/static/../app.py", "/static/..%2fapp.py", "/static/%2e%2e/app.py",
              "/static/web/app.js", "/static//app.js", "/static/app.js/", "/static/./app.js", "/static/APP.JS"]


def answer(path, **headers):
    return web.respond(path, Headers({"Host": "127.0.0.1:8765", **headers}))


def test_each_file_has_its_type_and_the_security_headers():
    """/ is index.html; every file says its type, revalidates (ETag) and carries a strict CSP."""
    for path, content_type in TYPES.items():
        r = answer(path)
        name = "index.html" if path == "/" else path.removeprefix("/static/")
        assert (r.status_code, r.body) == (200, WEB.joinpath(name).read_bytes())
        assert r.headers["Content-Type"] == content_type
        assert r.headers["Content-Length"] == str(len(r.body))
        assert r.headers["Cache-Control"] == "no-cache" and re.fullmatch(r'"[0-9a-f]{20}"', r.headers["ETag"])
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Content-Security-Policy"] == (
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
            "connect-src 'self' ws://127.0.0.1:8765 wss://127.0.0.1:8765; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")


def test_a_host_that_is_not_a_plain_name_is_left_out_of_the_csp():
    """connect-src names the Host only when it is a name or address with a port, so nothing can inject a directive."""
    for host in ("evil; script-src *", "a b", "", "[::1]x"):
        assert "connect-src 'self'; base-uri" in answer("/", Host=host).headers["Content-Security-Policy"]
    assert "ws://[::1]:80 " in answer("/", Host="[::1]:80").headers["Content-Security-Policy"]
    assert "ws://localhost " in answer("/", Host="localhost").headers["Content-Security-Policy"]


def test_a_matching_etag_answers_304_without_a_body():
    """If-None-Match with the file's ETag (alone or in a list) gets 304; another tag gets the file."""
    etag = answer("/static/app.js").headers["ETag"]
    for offered in (etag, f'"x", {etag}'):
        r = answer("/static/app.js", **{"If-None-Match": offered})
        assert (r.status_code, r.body, r.headers["ETag"]) == (304, b"", etag)
        assert "Content-Length" not in r.headers
    assert answer("/static/app.js", **{"If-None-Match": '"x"'}).status_code == 200


def test_unknown_names_and_path_tricks_are_404():
    """Only the exact names shipped in static/ are served; traversal, encodings and sub-paths are not."""
    for path in NOT_SERVED:
        r = answer(path)
        assert (r.status_code, r.body) == (404, b"not found\n"), path
        assert "Content-Security-Policy" in r.headers


def test_other_paths_are_not_the_pages():
    """The daemon's own paths, and near misses of /, fall through to the daemon (None)."""
    for path in ("/healthz", "/metrics", "/v1/realtime", "/index.html", "/static", "//", "/app.js"):
        assert answer(path) is None, path


def test_the_page_loads_nothing_from_elsewhere_and_writes_no_html():
    """Every src/href is a file served here; no URL to another host; model text never goes through HTML."""
    html = WEB.joinpath("index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs and all(answer(ref).status_code == 200 for ref in refs), refs
    for name in ("index.html", "app.js", "style.css", "icon.svg"):
        text = WEB.joinpath(name).read_text()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)|@import|url\(", text), name
        assert "style=" not in text and "<script>" not in text, name  # the CSP refuses inline code
    js = WEB.joinpath("app.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", js)


def raw_get(d, path, host=None, origin=None):
    """(status, headers, body) of a GET sent exactly as written (http.client keeps `..` as is)."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host or f"127.0.0.1:{d.port}")
        if origin:
            conn.putheader("Origin", origin)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_the_daemon_serves_the_page_under_its_default_origin_rules(daemon):
    """GET / and /static/* from the daemon, with no Origin or its own; a foreign Origin is still 403."""
    own = [f"http://{name}:{daemon.port}" for name in ("127.0.0.1", "localhost")]
    for host, origin in [(None, None), (f"localhost:{daemon.port}", None), (None, own[0]), (None, own[1])]:
        status, headers, body = raw_get(daemon, "/", host, origin)
        assert (status, headers["Content-Type"]) == (200, "text/html; charset=utf-8")
        assert body == WEB.joinpath("index.html").read_bytes()
        assert headers["Content-Security-Policy"].startswith("default-src 'none'; script-src 'self'")
    for path, content_type in TYPES.items():
        assert raw_get(daemon, path)[1]["Content-Type"] == content_type
    for path in NOT_SERVED + ["/static/../streamchat/server/app.py", "/static/../../pyproject.toml"]:
        assert raw_get(daemon, path)[0] == 404, path
    assert raw_get(daemon, "/", origin="http://evil.example")[0] == 403
    assert raw_get(daemon, "/", host="evil.example")[0] == 403


@pytest.mark.slow
def test_a_page_from_either_loopback_name_can_open_the_websocket(daemon):
    """The Origin a browser sends from http://127.0.0.1:PORT/ or http://localhost:PORT/ passes the handshake."""
    async def go(name):
        url = f"ws://{name}:{daemon.port}/v1/realtime"
        async with connect(url, origin=f"http://{name}:{daemon.port}", subprotocols=["realtime"]) as ws:
            return ws.subprotocol
    for name in ("127.0.0.1", "localhost"):
        assert asyncio.run(go(name)) == "realtime"
