"""Session churn: does a session that has come and gone leave memory behind in the daemon?

Starts one `streamchat serve` (--kv-dtype float, sessions released --release-s after their
connection closes) and runs --sessions short sessions one after another through the websocket:
each sets its instructions (so it is stored), resumes itself on the same connection, sends one
user item, reads one greedy reply of --reply-tokens tokens and closes. After session --mark, every
--every sessions and after the last one it waits until the daemon has released every session
(/healthz: none in the front, none in the engine), then reads the RSS of the front process and of
the engine core. Prints the growth from the --mark reading to the last per session, for each
process and both together (issue 26's bound: under 10 KiB a session).

    python bench/churn.py                  # 400 sessions, RSS read at 100 and 400
    python bench/churn.py --sessions 200 --mark 50
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import orjson
from websockets.asyncio.client import connect


class Daemon:
    def __init__(self, folder: Path, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "streamchat", "serve", "--port", "0", "--database-url",
               f"sqlite:///{folder / 's.db'}", "--kv-dtype", "float", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port = 0
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            m = re.search(r"listening on ws://[\d.]+:(\d+)/", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise RuntimeError("the daemon did not start:\n" + "".join(self.log[-30:]))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def health(self) -> dict:
        return orjson.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=10).read())

    def rss_kib(self) -> dict[str, int]:
        return {"front": _rss_kib(self.proc.pid), "core": _rss_kib(self.health()["engine"]["pid"])}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def one_session(url: str, n: int, reply_tokens: int) -> None:
    async with connect(url, max_size=1 << 22) as ws:
        created = (await _until(ws, "session.created"))["session"]
        await _send(ws, {"type": "session.update", "session": {"instructions": f"You are terse. Session {n}."}})
        await _until(ws, "session.updated")
        # resuming the session the connection already holds (it once counted the session twice)
        await _send(ws, {"type": "streamchat.session.resume", "session_id": created["id"],
                         "resume_token": created["resume_token"]})
        await _until(ws, "streamchat.session.resumed")
        await _send(ws, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"Count to {n % 9 + 2}."}]}})
        await _until(ws, "conversation.item.added")
        await _send(ws, {"type": "response.create", "response": {"max_output_tokens": reply_tokens, "temperature": 0}})
        done = await _until(ws, "response.done")
        if done["response"]["status"] not in ("completed", "incomplete"):
            raise RuntimeError(f"session {n}: the reply ended {done['response']}")


async def _send(ws, event: dict) -> None:
    await ws.send(orjson.dumps(event).decode())


async def _until(ws, kind: str) -> dict:
    while True:
        e = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
        if e["type"] == kind:
            return e
        if e["type"] == "error":
            raise RuntimeError(f"error while waiting for {kind}: {e['error']}")


def wait_released(d: Daemon, timeout_s: float) -> float:
    """Seconds until the daemon holds no session in the front or the engine; RuntimeError past the timeout."""
    t0 = time.monotonic()
    while True:
        h = d.health()
        if h["sessions"] == 0 and h["sessions_in_engine"] == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"sessions still held after {timeout_s:g} s: {h['sessions']} in the front, "
                               f"{h['sessions_in_engine']} in the engine")
        time.sleep(0.2)


async def run(args) -> None:
    folder = Path(tempfile.mkdtemp(prefix="churn-"))
    extra = ["--session-idle-release-s", str(args.release_s), "--num-threads", str(args.num_threads), *args.extra]
    d = Daemon(folder, extra)
    print(f"daemon on port {d.port}, front pid {d.proc.pid}, core pid {d.health()['engine']['pid']}; "
          f"flags {' '.join(extra)}", flush=True)
    url = f"ws://127.0.0.1:{d.port}/v1/realtime"
    readings: dict[int, dict[str, int]] = {}
    t0 = time.monotonic()
    try:
        for n in range(1, args.sessions + 1):
            await one_session(url, n, args.reply_tokens)
            if n in (args.mark, args.sessions) or n % args.every == 0:
                waited = await asyncio.to_thread(wait_released, d, args.release_s * 4 + 30)
                readings[n] = d.rss_kib()
                print(f"  session {n:4d} ({time.monotonic() - t0:6.1f} s): all released after {waited:4.1f} s; "
                      f"RSS front {readings[n]['front'] / 1024:7.1f} MiB, core {readings[n]['core'] / 1024:7.1f} MiB",
                      flush=True)
    finally:
        d.stop()
    first, last = readings[args.mark], readings[args.sessions]
    between = args.sessions - args.mark
    print(f"\nchurn of {args.sessions} sessions, RSS after release at session {args.mark} and {args.sessions}:")
    for name in ("front", "core"):
        print(f"  {name:<6} {first[name] / 1024:8.1f} -> {last[name] / 1024:8.1f} MiB   "
              f"{(last[name] - first[name]) / between:+7.1f} KiB a session")
    total = sum(last.values()) - sum(first.values())
    print(f"  both   {sum(first.values()) / 1024:8.1f} -> {sum(last.values()) / 1024:8.1f} MiB   "
          f"{total / between:+7.1f} KiB a session (bound: < 10)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--mark", type=int, default=100, help="the session after which the first RSS reading is taken")
    p.add_argument("--every", type=int, default=50, help="RSS read (after release) every this many sessions too")
    p.add_argument("--reply-tokens", type=int, default=4)
    p.add_argument("--release-s", type=float, default=1.0, help="--session-idle-release-s of the daemon")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("extra", nargs="*", help="more flags for `streamchat serve` (after --)")
    args = p.parse_args()
    if not 0 < args.mark < args.sessions:
        p.error("--mark must lie between 0 and --sessions")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
