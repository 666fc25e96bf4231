"""A soak of the daemon as many kinds of client meet it, with kill -9s: nothing acknowledged or shown is lost.

For --minutes (default 10) against one `streamchat serve` on this machine:

    chat        --chats websocket sessions: a user item, a greedy reply, again; now and then the
                connection is dropped and the session resumed with its token. Each starts with
                --chat-history tokens of the shipped text, brought before the clock starts: past
                the default 2,048-token window, so every chat attends to a full window from its
                first turn to its last and the first minute's load is the last minute's (with
                --chat-history 0 the chats start empty and their contexts grow for the first
                minutes, so the last minute's gaps include that growth, not only the daemon's)
    feed        one session appending text and committing it, as `streamchat feed` does
    http        streamed /v1/chat/completions, one after another
    stalled     a websocket that asks for a reply and then reads nothing for 20 s
    bad         oversized, malformed and out-of-range requests on both wires
    kill        every --kill-every-s: kill -9 of the whole daemon (front and core), restarted on the
                same store, alternating with kill -9 of the engine core alone (the front restarts it)

Printed at the end:

    acknowledged items lost     items the daemon acknowledged (conversation.item.added) missing
                                from the store after the kills (target 0)
    streamed text lost per kill characters a client was shown but the store lacked after a kill of
                                the daemon, and the seconds of tokens they were (target <= 1 s)
    RSS                         front + core at minute 1 and at the end (target: growth < 10%)
    inter-token p50/p99         the chats' token gaps in the first and the last minute (<= 1.2x)
    errors by code              none `internal`

    python bench/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson
from common import percentile
from longchat import histories
from pagein_itl import save_sessions
from websockets.asyncio.client import connect

PROMPTS = ["Tell me about the sea.", "Name three fruits.", "What is a lighthouse?", "Describe a cat.",
           "Why is the sky blue?", "Write two lines about rain."]


class Daemon:
    def __init__(self, db: Path, extra: list[str]) -> None:
        self.db, self.extra = db, extra
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "streamchat", "serve", "--port", str(self.port), "--database-url",
               f"sqlite:///{self.db}", "--kv-dtype", "float", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in self.proc.stdout:
            m = re.search(r"listening on ws://[\d.]+:(\d+)/", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise RuntimeError("the daemon did not start")
        threading_drain(self.proc)

    def health(self) -> dict:
        return orjson.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=10).read())

    def rss_mib(self) -> float:
        pids = [self.proc.pid, self.health()["engine"]["pid"]]
        return sum(_rss_kib(p) for p in pids) / 1024


def threading_drain(proc) -> None:
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, daemon: Daemon, args, seeds: list[tuple[str, str] | None]) -> None:
        self.d, self.args, self.seeds = daemon, args, seeds
        self.t0 = time.monotonic()
        self.errors: collections.Counter = collections.Counter()
        self.acked: dict[str, set[str]] = collections.defaultdict(set)  # session -> acknowledged item ids
        self.shown: dict[str, tuple[str, list]] = {}  # session -> (item id, [(when, text shown so far)])
        self.gaps: list[tuple[float, float]] = []  # (minute, gap)
        self.lost_text: list[tuple[int, float]] = []  # per kill of the daemon: (characters, seconds)
        self.rss: list[tuple[float, float]] = []
        self.up = asyncio.Event()
        self.up.set()
        self.stop = False

    def minute(self) -> float:
        return (time.monotonic() - self.t0) / 60

    def url(self) -> str:
        return f"ws://127.0.0.1:{self.d.port}/v1/realtime"

    async def chat(self, i: int) -> None:
        sid, token = self.seeds[i] or (None, None)
        turn = 0
        while not self.stop:
            await self.up.wait()
            try:
                async with connect(self.url(), max_size=1 << 22) as ws:
                    created = orjson.loads(await ws.recv())
                    if sid is None:
                        sid, token = created["session"]["id"], created["session"]["resume_token"]
                    else:
                        ask = _event_id()
                        await ws.send(orjson.dumps({"type": "streamchat.session.resume", "session_id": sid,
                                                    "resume_token": token, "event_id": ask}).decode())
                        if await _until(ws, "streamchat.session.resumed", self.errors, ask) is None:
                            await asyncio.sleep(0.5)  # refused (counted): a new connection tries again
                            continue
                    for _ in range(3):
                        await self.turn(ws, sid, PROMPTS[(i + turn) % len(PROMPTS)])
                        turn += 1
            except (OSError, asyncio.TimeoutError, ConnectionError, Exception) as exc:  # noqa: BLE001
                self.errors[f"client:{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)

    async def turn(self, ws, sid: str, prompt: str) -> None:
        ask = _event_id()
        await ws.send(orjson.dumps({"type": "conversation.item.create", "event_id": ask, "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}}).decode())
        added = await _until(ws, "conversation.item.added", self.errors, ask)
        if added is None:  # refused (counted): the turn is over
            return
        self.acked[sid].add(added["item"]["id"])
        ask = _event_id()
        await ws.send(orjson.dumps({"type": "response.create", "event_id": ask,
                                    "response": {"max_output_tokens": 48, "temperature": 0}}).decode())
        text, item_id, last, seen = "", None, None, []
        while True:
            e = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
            if e["type"] == "error" and e["error"].get("event_id") == ask:  # refused: no response.done follows
                self.errors[e["error"]["code"]] += 1
                return
            if e["type"] == "response.output_text.delta":
                now = time.monotonic()
                if last is not None:
                    self.gaps.append((self.minute(), now - last))
                last, item_id, text = now, e["item_id"], text + e["delta"]
                seen.append((now, text))
                self.shown[sid] = (item_id, seen)
            elif e["type"] == "error":
                self.errors[e["error"]["code"]] += 1
            elif e["type"] == "response.done":
                r = e["response"]
                if r["status"] == "failed":
                    self.errors[(r.get("status_details") or {}).get("error", {}).get("code", "failed")] += 1
                if r["status"] == "completed" and item_id:
                    self.acked[sid].add(item_id)
                self.shown.pop(sid, None)
                return

    async def http(self) -> None:
        body = orjson.dumps({"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 24,
                             "messages": [{"role": "user", "content": "Say hello."}]})
        while not self.stop:
            await self.up.wait()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.d.port)
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                             b"application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
                status = int(head.split()[1])
                if status != 200:
                    self.errors[f"http:{status}"] += 1
                await asyncio.wait_for(reader.read(), 120)
                writer.close()
            except Exception as exc:  # noqa: BLE001 - counted
                self.errors[f"http:{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)

    async def feed(self) -> None:
        while not self.stop:
            await self.up.wait()
            try:
                async with connect(self.url()) as ws:
                    await ws.recv()
                    for n in range(20):
                        ask = _event_id()
                        await ws.send(orjson.dumps({"type": "streamchat.input_text.append", "event_id": ask,
                                                    "text": f"Line {n} of the log. "}).decode())
                        await _until(ws, "streamchat.input_text.appended", self.errors, ask)
                        if n % 5 == 4:
                            await ws.send(orjson.dumps({"type": "streamchat.input_text.commit"}).decode())
                        await asyncio.sleep(0.5)
            except Exception as exc:  # noqa: BLE001 - counted
                self.errors[f"feed:{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)

    async def stalled(self) -> None:
        while not self.stop:
            await self.up.wait()
            try:
                async with connect(self.url(), max_queue=1) as ws:
                    await ws.send(orjson.dumps({"type": "conversation.item.create", "item": {
                        "type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": "Write a very long story."}]}}).decode())
                    await ws.send(orjson.dumps({"type": "response.create", "response": {}}).decode())
                    await asyncio.sleep(20)  # reads nothing
            except Exception as exc:  # noqa: BLE001 - counted
                self.errors[f"stalled:{type(exc).__name__}"] += 1
            await asyncio.sleep(1)

    async def bad(self) -> None:
        frames = ["{not json", orjson.dumps({"type": "response.create", "response": {"temperature": 9}}).decode(),
                  orjson.dumps({"type": "session.update", "session": {"instructions": "x" * 199_000}}).decode(),
                  orjson.dumps({"type": "no.such.event"}).decode()]
        while not self.stop:
            await self.up.wait()
            try:
                async with connect(self.url(), max_size=1 << 22) as ws:
                    await ws.recv()
                    for f in frames:
                        await ws.send(f)
                        e = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
                        self.errors[e.get("error", {}).get("code", e["type"])] += 1
            except Exception as exc:  # noqa: BLE001 - counted
                self.errors[f"bad:{type(exc).__name__}"] += 1
            await asyncio.sleep(3)

    async def killer(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.args.kill_every_s)
            if self.stop:
                return
            n += 1
            if n % 2:  # the whole daemon: the front, and its core with it
                self.up.clear()
                shown = dict(self.shown)
                killed = time.monotonic()
                os.kill(self.d.proc.pid, signal.SIGKILL)
                self.d.proc.wait()
                await asyncio.sleep(1)
                self.check_shown(shown, killed)
                await asyncio.to_thread(self.d.start)
                self.up.set()
            else:  # the engine core alone: the front's supervisor restarts it
                os.kill(self.d.health()["engine"]["pid"], signal.SIGKILL)
            print(f"  minute {self.minute():.1f}: kill {n} ({'daemon' if n % 2 else 'engine core'})", flush=True)

    def check_shown(self, shown: dict, killed: float) -> None:
        with sqlite3.connect(self.d.db) as db:
            for sid, (item_id, seen) in shown.items():
                row = db.execute("SELECT text FROM items WHERE session_id = ? AND item_id = ?",
                                 (sid, item_id)).fetchone()
                stored = row[0] if row else ""
                shown_text = seen[-1][1]
                if not shown_text.startswith(stored):
                    stored = ""  # a stored text that is not what was shown counts as nothing kept
                unsaved = [when for when, text in seen if len(text) > len(stored)]
                # the seconds of tokens lost: from the first delta the store lacks to the kill
                self.lost_text.append((len(shown_text) - len(stored), killed - unsaved[0] if unsaved else 0.0))

    async def sample_rss(self) -> None:
        while not self.stop:
            await asyncio.sleep(15)
            if self.up.is_set():
                try:
                    self.rss.append((self.minute(), self.d.rss_mib()))
                except Exception:  # noqa: BLE001 - a restart under way
                    pass

    def lost_items(self) -> int:
        with sqlite3.connect(self.d.db) as db:
            stored = {r[0] for r in db.execute("SELECT item_id FROM items")}
        return sum(len(ids - stored) for ids in self.acked.values())


async def _until(ws, kind: str, errors, event_id: str | None = None) -> dict | None:
    """The first event of `kind`; None if an error answers the client event `event_id` first (a refusal:
    the daemon sends nothing more for it). Errors are counted by code."""
    while True:
        e = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
        if e["type"] == kind:
            return e
        if e["type"] == "error":
            errors[e["error"]["code"]] += 1
            if event_id is not None and e["error"].get("event_id") == event_id:
                return None


_event_ids = itertools.count(1)


def _event_id() -> str:
    return f"evt_soak_{next(_event_ids)}"


async def run(args) -> None:
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    d = Daemon(folder / "s.db", ["--checkpoint-idle-s", "2", "--send-timeout-s", "5"])
    d.start()
    seeds: list = [None] * args.chats
    if args.chat_history:
        started = time.monotonic()
        seeds = await save_sessions(f"ws://127.0.0.1:{d.port}/v1/realtime", histories(args.chats, args.chat_history))
        print(f"  {args.chats} chats brought ~{args.chat_history} tokens of history each in "
              f"{time.monotonic() - started:.1f} s; the clock starts now", flush=True)
    soak = Soak(d, args, seeds)
    tasks = [asyncio.create_task(soak.chat(i)) for i in range(args.chats)]
    tasks += [asyncio.create_task(c()) for c in (soak.http, soak.feed, soak.stalled, soak.bad, soak.sample_rss)]
    killer = asyncio.create_task(soak.killer())
    await asyncio.sleep(args.minutes * 60)
    soak.stop = True
    killer.cancel()
    await asyncio.wait(tasks, timeout=150)
    for t in tasks:
        t.cancel()
    lost = soak.lost_items()
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(60)
    report(soak, lost, args)


def report(soak: Soak, lost: int, args) -> None:
    def gaps(lo, hi):
        g = [x for m, x in soak.gaps if lo <= m < hi]
        return percentile(g, 50), percentile(g, 99)

    first, last = gaps(0, 1), gaps(args.minutes - 1, args.minutes + 1)
    rss = soak.rss
    print(f"\nsoak of {args.minutes} min, {args.chats} chats from ~{args.chat_history} tokens of history, "
          f"a kill every {args.kill_every_s:.0f} s")
    print(f"  acknowledged items lost     {lost} of {sum(len(v) for v in soak.acked.values())}")
    worst = max(soak.lost_text, default=(0, 0.0))
    print(f"  streamed text lost per kill max {worst[0]} characters, ~{worst[1]:.2f} s of tokens "
          f"({len(soak.lost_text)} streams cut)")
    if rss:
        at1 = next((r for m, r in rss if m >= 1), rss[0][1])
        print(f"  RSS (front + core)          {at1:.0f} MiB at minute 1, {rss[-1][1]:.0f} MiB at the end "
              f"({(rss[-1][1] / at1 - 1) * 100:+.1f}%)")
    fmt = lambda p: "n/a" if p[0] is None else f"{p[0] * 1000:.0f}/{p[1] * 1000:.0f} ms"  # noqa: E731
    print(f"  inter-token p50/p99         first minute {fmt(first)}, last minute {fmt(last)}")
    by_minute = [gaps(m, m + 1)[0] for m in range(int(args.minutes + 0.999))]
    print("  inter-token p50 by minute   " + " ".join("n/a" if g is None else f"{g * 1000:.0f}" for g in by_minute))
    print(f"  errors by code              {dict(sorted(soak.errors.items()))}")
    print(f"  internal errors             {soak.errors.get('internal', 0)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-history", type=int, default=2100,
                   help="tokens of history each chat starts with (default 2100: past the 2,048-token window)")
    p.add_argument("--kill-every-s", type=float, default=120.0)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
