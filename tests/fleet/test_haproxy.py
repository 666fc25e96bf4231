"""Tests of deploy/haproxy.cfg with Debian's real haproxy: valid, affinity by session_id, least connections, failover.

Three stub daemons (plain HTTP servers on loopback that answer with their
name and serve /healthz) stand behind the shipped config, started as an
operator would, with the addresses in its environment variables. haproxy
missing is a failure saying what to install, never a skip.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
SESSION_IDS = [f"sess_{i:02d}" for i in range(24)]


def _haproxy() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if found is None:
        pytest.fail("haproxy not found: install Debian's haproxy package (`make haproxy`, as root)", pytrace=False)
    return found


class StubDaemon(http.server.ThreadingHTTPServer):
    """Answers GET /healthz with `health` and any other GET with its name; records each check's Host."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.name = name
        self.health = 200
        self.checks: list[str | None] = []  # the Host header of each /healthz request
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _StubHandler(http.server.BaseHTTPRequestHandler):
    server: StubDaemon

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self.server.checks.append(self.headers.get("Host"))
            status, body = self.server.health, b"{}"
        else:
            status, body = 200, self.server.name.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # the test reads what matters from `checks`
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fleet() -> Iterator[tuple[int, dict[str, StubDaemon]]]:
    """haproxy with deploy/haproxy.cfg on a free port in front of stub daemons d1, d2, d3."""
    stubs = {name: StubDaemon(name) for name in ("d1", "d2", "d3")}
    port = _free_port()
    env = {**os.environ, "STREAMCHAT_PROXY_BIND": f"127.0.0.1:{port}",
           **{f"STREAMCHAT_{name.upper()}": stub.address for name, stub in stubs.items()}}  # fmt: skip
    proxy = subprocess.Popen([_haproxy(), "-db", "-f", str(CONFIG)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _wait_for(lambda: _alive(proxy) and all(stub.checks for stub in stubs.values()),
                  "a health check of every daemon")
        yield port, stubs
    finally:
        proxy.terminate()
        proxy.wait(10)
        for stub in stubs.values():
            if stub.socket.fileno() != -1:
                stub.stop()


def _alive(proxy: subprocess.Popen) -> bool:
    """True while haproxy runs; its own words if it has exited."""
    if proxy.poll() is not None:
        raise AssertionError(f"haproxy exited {proxy.returncode}: {proxy.stderr.read().decode()}")
    return True


def _wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _served_by(port: int, session_id: str | None) -> str:
    """Which daemon answered GET /v1/realtime (with ?session_id= when given) through the proxy.

    Reads until the proxy closes the connection, so the request is over in the
    proxy too before the next one: bounded-load hashing counts requests in flight.
    """
    path = "/v1/realtime" + (f"?session_id={session_id}" if session_id else "")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200", head
    return body.decode()


def test_config_is_valid() -> None:
    """`haproxy -c` accepts the shipped config with no warning."""
    done = subprocess.run([_haproxy(), "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip(), "WARNING" in done.stderr) == (0, "Configuration file is valid", False)


def test_affinity_leastconn_and_failover(fleet: tuple[int, dict[str, StubDaemon]]) -> None:
    """Same session, same daemon; new sessions spread; a failing daemon's sessions, and only those, move."""
    port, stubs = fleet
    assert {host for stub in stubs.values() for host in stub.checks} == {"localhost"}
    placed = {sid: _served_by(port, sid) for sid in SESSION_IDS}
    assert {sid: _served_by(port, sid) for sid in SESSION_IDS} == placed
    assert set(placed.values()) == {"d1", "d2", "d3"}
    assert {_served_by(port, None) for _ in range(6)} == {"d1", "d2", "d3"}

    # d3's /healthz says 503: after two failed checks it is down, and only its sessions move.
    stubs["d3"].health = 503
    failed_before = len(stubs["d3"].checks)
    # The check that arrives 4th was sent after the 3rd's answer was read: by then
    # two checks have failed even if the first was answered before the switch.
    _wait_for(lambda: len(stubs["d3"].checks) >= failed_before + 4, "d3 to fail two health checks")
    moved = {sid: _served_by(port, sid) for sid in SESSION_IDS}
    assert {sid: d for sid, d in moved.items() if placed[sid] != "d3"} == {
        sid: d for sid, d in placed.items() if d != "d3"
    }
    assert "d3" not in moved.values() and "d3" not in {_served_by(port, None) for _ in range(6)}

    # d1 dies outright: before any check notices, its sessions are redispatched to the one daemon left.
    stubs["d1"].stop()
    assert {_served_by(port, sid) for sid in SESSION_IDS if moved[sid] == "d1"} == {"d2"}
