"""The web chat page: the static files in streamchat/server/static/, answered to GET.

    GET /                 -> static/index.html
    GET /static/<name>    -> static/<name>, for the names shipped there and no other

Owns the file list, content types, caching and security headers. Knows
nothing about sessions or the engine: the page speaks the Realtime protocol
to /v1/realtime like any other client. The daemon's Host and Origin checks
run before this, as for every path.
"""

from __future__ import annotations

import functools
import hashlib
import http
import re
from importlib import resources

from websockets.datastructures import Headers
from websockets.http11 import Response

STATIC_PREFIX = "/static/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# Everything from this origin, nothing inline, nothing framed. connect-src
# names the websocket URLs too: 'self' covers ws: only in CSP level 3.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'{ws}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


@functools.cache
def _files() -> dict[str, tuple[bytes, str, str]]:
    """name -> (body, content type, ETag) of every file shipped in static/, read once."""
    found = {}
    for entry in resources.files("streamchat.server").joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            body = entry.read_bytes()
            found[entry.name] = (body, CONTENT_TYPES[suffix], f'"{hashlib.sha256(body).hexdigest()[:20]}"')
    return found


def respond(path: str, headers: Headers) -> Response | None:
    """The answer to GET `path` if it is the page's (a file, 304 or 404); None for other paths."""
    if path == "/":
        name = "index.html"
    elif path.startswith(STATIC_PREFIX):
        name = path[len(STATIC_PREFIX):]
    else:
        return None
    found = _files().get(name)  # a lookup by exact name: "../x", "a/b" and "%2e" never match
    if found is None:
        return _answer(http.HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", headers)
    body, content_type, etag = found
    if etag in (tag.strip() for tag in headers.get("If-None-Match", "").split(",")):
        return _answer(http.HTTPStatus.NOT_MODIFIED, b"", content_type, headers, etag)
    return _answer(http.HTTPStatus.OK, body, content_type, headers, etag)


def _answer(status: http.HTTPStatus, body: bytes, content_type: str, request: Headers,
            etag: str | None = None) -> Response:
    host = request.get("Host", "")
    ws = f" ws://{host} wss://{host}" if _HOST.match(host) else ""
    h = Headers({"Content-Type": content_type,
                 # revalidate every time (the ETag makes it cheap), so a new daemon's page is never stale
                 "Cache-Control": "no-cache", "Content-Security-Policy": CSP.format(ws=ws),
                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})
    if status != http.HTTPStatus.NOT_MODIFIED:  # a 304 has no body, and no length to say
        h["Content-Length"] = str(len(body))
    if etag is not None:
        h["ETag"] = etag
    return Response(status.value, status.phrase, h, body)
