"""A real `streamchat serve` subprocess on loopback, for end-to-end client tests.

The same pattern as tests/server/conftest.py's Daemon (kept separate so the two
test folders do not import each other's conftest), plus a thread that drains
the daemon's log so a chatty daemon never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

from websockets.asyncio.client import connect

SMALL = ["--max-output-tokens", "256", "--max-text-chars", "20000", "--max-frame-bytes", "65536",
         "--num-threads", os.environ.get("TEST_NUM_THREADS", "2"), "--kv-dtype", "float", "--dtype", "float32"]  # float: auto measures at a model's
# first start; float32: see tests/server/conftest.py's DAEMON_ARGS


class RealDaemon:
    """`streamchat serve --port 0` with its own SQLite file; `url` once it listens."""

    def __init__(self, db_path, *extra: str) -> None:
        self.db_path = db_path
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log: list[str] = []

    def start(self, timeout: float = 120) -> "RealDaemon":
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMCHAT_")}
        cmd = [sys.executable, "-m", "streamchat", "serve", "--port", "0", "--database-url",
               f"sqlite:///{self.db_path}", *SMALL, *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        listening = threading.Event()
        threading.Thread(target=self._drain, args=(listening,), daemon=True).start()
        if not listening.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError("the daemon did not start:\n" + "".join(self.log))
        return self

    def _drain(self, listening: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            m = re.search(r"listening on ws://[\d.]+:(\d+)/", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                listening.set()
        listening.set()  # exited: start() reports the log

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def healthz(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=10) as answer:
            return json.loads(answer.read())

    def stop(self) -> int | None:
        """SIGTERM (the daemon's clean shutdown); SIGKILL if it has not exited within 30 s."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def session_stats(url: str, session_id: str, token: str, api_key: str | None = None,
                  timeout: float = 30) -> tuple[dict, dict]:
    """(`streamchat.session.resumed`, `streamchat.session.stats`) for a session, over a new socket."""
    async def go() -> tuple[dict, dict]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with connect(url, additional_headers=headers, max_size=None) as ws:
            async def until(type_: str) -> dict:
                while True:
                    event = json.loads(await ws.recv())
                    if event["type"] in (type_, "error"):
                        assert event["type"] == type_, event
                        return event

            await until("session.created")
            await ws.send(json.dumps({"type": "streamchat.session.resume", "session_id": session_id,
                                      "resume_token": token}))
            resumed = await until("streamchat.session.resumed")
            await ws.send(json.dumps({"type": "streamchat.session.stats"}))
            return resumed, await until("streamchat.session.stats")

    return asyncio.run(asyncio.wait_for(go(), timeout))

