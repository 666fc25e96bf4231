"""Real parts of a fleet on loopback: daemons (subprocesses), HAProxy with deploy/haproxy.cfg, a chat client.

The daemons share one PostgreSQL database and one data folder; each dies
with the test run (PR_SET_PDEATHSIG) and has its log drained by a thread, so
a chatty daemon never blocks on a full pipe. Polls wait with a deadline and
fail saying what they waited for.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
# float32: see tests/server/conftest.py's DAEMON_ARGS
SMALL = ["--dtype", "float32", "--num-blocks", "300", "--window-tokens", "256", "--max-output-tokens", "256",
         "--num-threads", "1",
         "--kv-dtype", "float", "--host-tier-gib", "0", "--shutdown-timeout-s", "10"]


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, what: str, timeout_s: float):
    """Poll `condition` until it returns something truthy; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


class FleetDaemon:
    """`streamchat serve` with a fleet's flags; `port` once it listens, `lines` its log so far."""

    def __init__(self, daemon_id: str, database_url: str, data_dir: Path, *extra: str) -> None:
        self.id = daemon_id
        self.cmd = [sys.executable, "-m", "streamchat", "serve", "--port", "0", "--database-url", database_url,
                    "--daemon-id", daemon_id, "--data-dir", str(data_dir), *SMALL, *extra]
        self.lines: list[str] = []
        self.port: int | None = None
        self._listening = threading.Event()

    def spawn(self) -> FleetDaemon:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on ws://[\d.]+:(\d+)/", line)
            if m:
                self.port = int(m.group(1))
                self._listening.set()
        self._listening.set()  # exited: wait() says so

    def wait(self, timeout_s: float = 180) -> FleetDaemon:
        if not self._listening.wait(timeout_s) or self.port is None:
            raise RuntimeError(f"daemon {self.id} did not start:\n" + "".join(self.lines[-40:]))
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://{self.address}/v1/realtime"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{self.address}{path}", timeout=10) as r:
            return r.read()

    def health(self) -> dict:
        return json.loads(self.get("/healthz"))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        """SIGTERM (after a SIGCONT, in case it is paused); SIGKILL if it has not exited in 30 s."""
        for sig in (signal.SIGCONT, signal.SIGTERM):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Proxy:
    """Debian's haproxy with deploy/haproxy.cfg in front of three daemons, on a free port."""

    def __init__(self, daemons: list[FleetDaemon]) -> None:
        found = shutil.which("haproxy") or "/usr/sbin/haproxy"
        if not os.access(found, os.X_OK):
            raise AssertionError("haproxy not found: install Debian's haproxy package (`make haproxy`, as root)")
        self.port = free_port()
        env = {**os.environ, "STREAMCHAT_PROXY_BIND": f"127.0.0.1:{self.port}",
               **{f"STREAMCHAT_D{i + 1}": d.address for i, d in enumerate(daemons)}}
        self.proc = subprocess.Popen([found, "-db", "-f", str(CONFIG)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        wait_for(self._answers, "haproxy to answer /healthz", 15)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"haproxy exited {self.proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Chat:
    """One conversation over one websocket at a time, keeping what the daemon acknowledged."""

    def __init__(self) -> None:
        self.ws = None
        self.session_id = self.token = None
        self.acked: list[tuple[str, str, str]] = []  # (item id, role, text) the daemon acknowledged
        self.replies: list[str] = []  # each completed reply's text
        self.partial = ""  # what streamed of the last reply so far

    async def open(self, url: str) -> Chat:
        self.ws = await connect(url, max_size=None, open_timeout=10)
        created = await self.recv()
        assert created["type"] == "session.created", created
        if self.session_id is None:
            self.session_id, self.token = created["session"]["id"], created["session"]["resume_token"]
        return self

    async def resume(self, url: str) -> dict:
        """Connect with ?session_id= and resume: the resumed event, or the error event."""
        await self.open(f"{url}?session_id={self.session_id}")
        await self.send({"type": "streamchat.session.resume", "session_id": self.session_id,
                         "resume_token": self.token})
        return await self.until("streamchat.session.resumed", "error")

    async def resume_until_served(self, url: str, timeout_s: float) -> tuple[dict, float]:
        """Resume through `url` again and again (refused, leased, a dead daemon) until it works."""
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout_s:
            try:
                answer = await self.resume(url)
                if answer["type"] == "streamchat.session.resumed":
                    return answer, time.monotonic() - t0
                last = answer["error"]
                assert last["code"] == "session_leased", last
            except (OSError, ConnectionClosed, InvalidHandshake, asyncio.TimeoutError) as exc:
                last = repr(exc)
            await self.close()
            await asyncio.sleep(0.1)
        raise AssertionError(f"session {self.session_id} not resumed within {timeout_s} s: {last}")

    async def send(self, event: dict) -> None:
        await self.ws.send(orjson.dumps(event).decode())

    async def recv(self, timeout_s: float = 60) -> dict:
        return orjson.loads(await asyncio.wait_for(self.ws.recv(), timeout_s))

    async def until(self, *types: str, timeout_s: float = 120) -> dict:
        while True:
            event = await self.recv(timeout_s)
            if event["type"] in types:
                return event

    async def say(self, text: str) -> None:
        await self.send({"type": "conversation.item.create",
                         "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        added = await self.until("conversation.item.added", "error")
        assert added["type"] == "conversation.item.added", added
        self.acked.append((added["item"]["id"], "user", text))

    async def reply(self, max_tokens: int, on_delta=None) -> str:
        """A greedy reply; its text once done (kept if completed), or what streamed before the socket closed."""
        await self.send({"type": "response.create", "response": {"temperature": 0, "max_output_tokens": max_tokens}})
        text = self.partial = ""
        while True:
            event = await self.recv()
            if event["type"] == "response.output_text.delta":
                text = self.partial = text + event["delta"]
                if on_delta is not None:
                    on_delta(self)
            elif event["type"] == "response.done":
                out = event["response"]["output"][0]
                if event["response"]["status"] in ("completed", "incomplete"):
                    self.acked.append((out["id"], "assistant", text))
                    self.replies.append(text)
                return text
            elif event["type"] == "error":
                raise AssertionError(event)

    async def stats(self) -> dict:
        await self.send({"type": "streamchat.session.stats"})
        return await self.until("streamchat.session.stats")

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
            self.ws = None
