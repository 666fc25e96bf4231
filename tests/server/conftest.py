"""A real daemon process on loopback, and a small protocol client for tests."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import orjson
import pytest
from websockets.asyncio.client import connect

# --kv-dtype float: auto (the default) measures the storages at a model's first start, longer than a
# daemon test waits; tests/model/test_kv_auto.py tests auto.
# --dtype float32: the greedy equality checks compare replies computed along different paths (a prefix-cache
# hit, a resume, a restart), which are equal in float32; "auto" is bfloat16 on CPUs with avx512_bf16, where
# such paths round differently and a near-tie can flip a greedy token.
DAEMON_ARGS = ["--dtype", "float32", "--num-blocks", "400", "--window-tokens", "256", "--max-output-tokens", "256",
               "--max-text-chars", "20000", "--max-frame-bytes", "65536", "--num-threads", os.environ.get("TEST_NUM_THREADS", "2"),
               "--kv-dtype", "float"]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test run that started it dies (a killed or timed-out
    pytest leaves no daemon behind to load the machine; its engine core follows it the same way)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Daemon:
    """`streamchat serve` in a subprocess; `url` once it listens."""

    def __init__(self, db_path, *extra, env=None):
        self.db_path = db_path
        self.extra = list(extra)
        self.env = {**os.environ, **(env or {})}
        self.proc = None
        self.port = None

    def start(self, timeout=120):
        cmd = [sys.executable, "-m", "streamchat", "serve", "--port", "0", "--database-url",
               f"sqlite:///{self.db_path}", *DAEMON_ARGS, *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        self.log = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("daemon exited:\n" + "".join(self.log))
            self.log.append(line)
            m = re.search(r"listening on ws://[\d.]+:(\d+)/", line)
            if m:
                self.port = int(m.group(1))
                return self
        raise RuntimeError("daemon did not start:\n" + "".join(self.log))

    @property
    def url(self):
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def http(self):
        return f"http://127.0.0.1:{self.port}"

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Client:
    """One websocket with helpers to send events and read them in order."""

    def __init__(self, ws):
        self.ws = ws
        self.created = None

    @classmethod
    async def open(cls, url, **kw):
        c = cls(await connect(url, max_size=None, **kw))
        c.created = await c.recv()
        assert c.created["type"] == "session.created"
        return c

    async def send(self, event):
        await self.ws.send(orjson.dumps(event).decode())

    async def recv(self, timeout=60):
        return orjson.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, type_, timeout=120):
        """Events up to and including the first of `type_`."""
        seen = []
        while True:
            e = await self.recv(timeout)
            seen.append(e)
            if e["type"] == type_:
                return seen

    async def close(self):
        await self.ws.close()


async def settled_stats(c, timeout=30.0):
    """The session's streamchat.session.stats once none of its tokens waits to enter the cache: a reply's
    close (its last token, <|im_end|>, a newline) is still queued when response.done is sent."""
    deadline = time.monotonic() + timeout
    while True:
        await c.send({"type": "streamchat.session.stats"})
        stats = await c.recv()
        assert stats["type"] == "streamchat.session.stats", stats
        if stats["queued_tokens"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the session's queued tokens never entered the cache: {stats}"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """One daemon shared by the server tests that need no special flags."""
    d = Daemon(tmp_path_factory.mktemp("db") / "s.db").start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def counted_daemon(tmp_path_factory):
    """A daemon for the tests that read its global figures (/metrics counters, /healthz blocks and sessions):
    no other module uses it, its tests run one after another and each compares figures taken before and
    after its own work, waiting (with a deadline) until the daemon has settled. A 64-token window, so a
    short chat evicts."""
    d = Daemon(tmp_path_factory.mktemp("counted") / "c.db", "--window-tokens", "64").start()
    yield d
    d.stop()


def wait_for(condition, what, timeout=20.0, interval=0.05):
    """Poll `condition()` until it returns a true value, which is returned; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(interval)
