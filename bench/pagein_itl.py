"""Does resuming sessions from disk slow a reply that is streaming? Through the daemon, interleaved rounds.

    python bench/pagein_itl.py                        # 3 rounds, 3 sessions of ~1,000 tokens each
    python bench/pagein_itl.py --rounds 1 --sessions 2 --history 300   # a smoke run

The daemon runs on its defaults plus `--session-idle-release-s 1 --checkpoint-idle-s 0`,
so a session whose client leaves is saved to disk and leaves memory a second
later. Each round, --sessions sessions bring about --history tokens of the
shipped Botchan text and leave; once /healthz counts none in memory, two
new sessions each stream one greedy reply of --tokens tokens to the same
prompt, in turn (the same context and the same tokens, so only what happens
beside them differs; until 2026-12-07 one session streamed both, and its
second reply, over the first one's context, ran 7.5% slower by itself:
median of 6 pairs, ad hoc, against 1.01x for a second new session):

    quiet     nothing else happens
    resumes   after its 20th token, the saved sessions are resumed one after
              another (`streamchat.session.resume`, each `restored_from: disk`)
              and closed again, by a client process of their own (started
              before the quiet reply), as other users' clients would be;
              `--same-loop` resumes from the streaming client's event loop
              instead, as this benchmark did before 2026-12-06

The disk files are read and checked on the engine core's I/O thread, never
inside a step, so the gaps between the second reply's tokens while the
resumes run should be those of the first (target: median within 20%).
Both sessions stay connected (in memory) until the round ends.
Printed per round and pooled: the median and p90 gap of the quiet reply
(after its 5th token), of the resumed one while the resumes ran, their ratio,
and the resumes' wall time. The host's speed drifts between the two replies
(a round's ratio has read 0.8 for unchanged code), so the second reply's own
gaps before the resumes and from SETTLE_S after them are printed too, as a
baseline taken around the window (`around`, not the target's), with the CPU
time each process took in the window (Linux), and the stream's delay per
resume: the gaps that overlap the window or the SETTLE_S after it, beyond
the median around it, summed (it does not depend on how long the window is,
which the ratio does).

On two cores the step's two threads take both, so any client's work beside it
slows the stream, a page-in or not. Two ways to tell the page-in's own cost:

    --bare         the control: the same clients only open and close as many
                   connections (no resume, no page-in); compare the delays
    --threads 1    the step on one thread, so the resumes' work (front, store,
                   clients, reader) has a core of its own

Never asserts; exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common
import orjson
from longchat import StreamchatDaemon, histories, send

REPLY_PROMPT = "Write the numbers from 1 to 500, one per line."  # greedy: counts on to max_output_tokens
RESUME_AFTER = 20  # tokens of the second reply before the resumes start
SETTLE_S = 0.05  # the second reply's gaps this long after the resumes count as around them again


def healthz(url: str) -> dict:
    base = url.replace("ws://", "http://").removesuffix("/v1/realtime")
    return orjson.loads(urllib.request.urlopen(base + "/healthz", timeout=10).read())


async def connect(url: str):
    from websockets.asyncio.client import connect as ws_connect

    ws = await ws_connect(url, max_size=None, open_timeout=60, ping_timeout=None)
    return ws, orjson.loads(await ws.recv())


async def until(ws, type_: str) -> dict:
    while True:
        e = orjson.loads(await ws.recv())
        if e["type"] == "error":
            raise RuntimeError(f"daemon error: {e['error']}")
        if e["type"] == type_:
            return e


async def save_sessions(url: str, texts: list[str]) -> list[tuple[str, str]]:
    """Sessions with a history and a one-token reply, left; (id, resume token) each."""
    saved = []
    for text in texts:
        ws, created = await connect(url)
        for i in range(0, len(text), 4000):
            await send(ws, {"type": "streamchat.input_text.append", "text": text[i:i + 4000]})
        await send(ws, {"type": "streamchat.input_text.commit"})
        await send(ws, {"type": "response.create", "response": {"max_output_tokens": 1, "temperature": 0}})
        await until(ws, "response.done")
        saved.append((created["session"]["id"], created["session"]["resume_token"]))
        await ws.close()
    return saved


async def stream(ws, tokens: int, stamps: list[float]) -> dict:
    await send(ws, {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": REPLY_PROMPT}]}})
    await send(ws, {"type": "response.create", "response": {"max_output_tokens": tokens, "temperature": 0}})
    while True:
        e = orjson.loads(await ws.recv())
        if e["type"] == "response.output_text.delta":
            stamps.append(time.perf_counter())
        elif e["type"] == "response.done":
            return e["response"]


async def resume_all(url: str, saved: list[tuple[str, str]], bare: bool = False) -> list[str]:
    """Resume each saved session on a connection of its own and close it; `bare`: only open and close
    as many connections (the control: a client's work without a page-in), each origin "none"."""
    origins = []
    for sid, token in saved:
        ws, _ = await connect(url)
        if bare:
            origins.append("none")
        else:
            await send(ws, {"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
            origins.append((await until(ws, "streamchat.session.resumed"))["restored_from"])
        await ws.close()
    return origins


class Resumer:
    """The resuming clients in a process of their own, as other users' would be: the streaming
    client's event loop then takes its timestamps without waiting on their handshakes. Started
    before the round's quiet reply; `run` sends the sessions and reads back (origins, t0, t1),
    taken on the same monotonic clock as the stream's stamps."""

    async def __aenter__(self):
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--resumer", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        if await self.proc.stdout.readline() != b"ready\n":  # started and imported before the quiet reply
            raise RuntimeError("the resuming client process did not start")
        return self

    async def run(self, url: str, saved: list[tuple[str, str]], bare: bool) -> tuple[list[str], float, float]:
        self.proc.stdin.write(orjson.dumps({"url": url, "saved": saved, "bare": bare}) + b"\n")
        await self.proc.stdin.drain()
        got = orjson.loads(await self.proc.stdout.readline())
        return got["origins"], got["t0"], got["t1"]

    async def __aexit__(self, *exc) -> None:
        self.proc.stdin.close()
        await self.proc.wait()


def resumer_main() -> int:
    """`--resumer`: says ready; then one JSON line in (url, saved), resume them all, one JSON line out."""
    import websockets.asyncio.client  # noqa: F401 - imported now, not while the stream runs

    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    job = orjson.loads(sys.stdin.buffer.readline())
    t0 = time.perf_counter()
    origins = asyncio.run(resume_all(job["url"], [tuple(x) for x in job["saved"]], job["bare"]))
    t1 = time.perf_counter()
    sys.stdout.buffer.write(orjson.dumps({"origins": origins, "t0": t0, "t1": t1}) + b"\n")
    sys.stdout.flush()
    return 0


def gaps(stamps: list[float], start: float = float("-inf"), end: float = float("inf"), skip: int = 5) -> list[float]:
    return [b - a for a, b in list(zip(stamps, stamps[1:]))[skip:] if start <= b <= end]


def cpu_ms(pids: dict[str, int]) -> dict[str, float]:
    """CPU time each named process's threads have run so far (ms; /proc schedstat; {} off Linux)."""
    out = {}
    for name, pid in pids.items():
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # the thread ended
                continue
        out[name] = total / 1e6
    return out


def daemon_pids(front: int) -> dict[str, int]:
    """The front and its engine core (the child with the most threads: not the resource tracker)."""
    try:
        with open(f"/proc/{front}/task/{front}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return {}
    core = max(kids, key=lambda pid: len(os.listdir(f"/proc/{pid}/task")), default=None)
    return {"front": front} if core is None else {"front": front, "core": core}


async def one_round(url: str, texts: list[str], tokens: int, same_loop: bool = False,
                    pids: dict[str, int] | None = None, bare: bool = False) -> dict:
    saved = await save_sessions(url, texts)
    deadline = time.monotonic() + 120
    while (h := healthz(url))["sessions"] or h["sessions_in_engine"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the idle sessions did not leave memory in 120 s")
        await asyncio.sleep(0.2)
    async with Resumer() as resumer:
        ws, _ = await connect(url)
        quiet: list[float] = []
        await stream(ws, tokens, quiet)
        ws2, _ = await connect(url)  # a session of its own: the quiet reply's context, not twice as long
        busy: list[float] = []
        task = asyncio.create_task(stream(ws2, tokens, busy))
        while len(busy) < RESUME_AFTER and not task.done():
            await asyncio.sleep(0.005)
        pids = {**(pids or {}), "resumer": os.getpid() if same_loop else resumer.proc.pid}
        cpu0 = cpu_ms(pids)
        if same_loop:
            t0 = time.perf_counter()
            origins = await resume_all(url, saved, bare)
            t1 = time.perf_counter()
        else:
            origins, t0, t1 = await resumer.run(url, saved, bare)
        cpu1 = cpu_ms(pids)
        done = await task
    await ws.close()
    await ws2.close()
    during = gaps(busy, t0, t1, skip=0)
    if done["status"] not in ("completed", "incomplete") or not busy or busy[-1] < t1:
        print("  the reply ended before the resumes did: raise --tokens", file=sys.stderr)
    around = gaps(busy, end=t0) + gaps(busy, t1 + SETTLE_S, skip=0)
    cpu = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1}
    a50 = common.median(around)
    hit = [b - a for a, b in zip(busy, busy[1:]) if b > t0 and a < t1 + SETTLE_S]  # gaps the window touches
    stall = sum(g - a50 for g in hit) if hit and a50 is not None else None
    return {"quiet": gaps(quiet), "during": during, "around": around, "resume_s": t1 - t0, "origins": origins,
            "cpu_ms": cpu, "stall_s": stall}


def summary(quiet: list[float], during: list[float]) -> dict:
    q50, d50 = common.median(quiet), common.median(during)
    return {"quiet_p50_ms": common.ms(q50), "quiet_p90_ms": common.ms(common.percentile(quiet, 90)),
            "during_p50_ms": common.ms(d50), "during_p90_ms": common.ms(common.percentile(during, 90)),
            "gaps_during": len(during), "ratio_p50": common.ratio(d50, q50)}


async def run(args) -> list[dict]:
    texts = histories(args.sessions * args.rounds, args.history)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, StreamchatDaemon(Path(tmp), args) as d:
        pids = daemon_pids(d.proc.pid)
        for r in range(args.rounds):
            got = await one_round(d.url, texts[r * args.sessions:(r + 1) * args.sessions], args.tokens,
                                  args.same_loop, pids, args.bare)
            rows.append(got)
            s = summary(got["quiet"], got["during"])
            cpu = ", ".join(f"{name} {ms:.0f}" for name, ms in got["cpu_ms"].items())
            print(f"  round {r + 1}: quiet p50 {s['quiet_p50_ms']:.1f} ms, around "
                  f"{common.fmt(common.ms(common.median(got['around'])), 0)} ms, during {len(got['during'])} gaps "
                  f"p50 {common.fmt(s['during_p50_ms'], 0)} ms; {len(got['origins'])} resumes in "
                  f"{got['resume_s']:.2f} s from {sorted(set(got['origins']))}, the stream delayed "
                  f"{common.fmt(common.ms(got['stall_s']), 0)} ms; CPU ms in the window: {cpu}",
                  file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=3, help="sessions resumed from disk each round")
    p.add_argument("--history", type=int, default=1000, help="tokens of history per saved session (about)")
    p.add_argument("--tokens", type=int, default=160, help="tokens of each streamed reply")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--daemon-arg", action="append", default=[], help="extra `streamchat serve` flag (repeatable)")
    p.add_argument("--same-loop", action="store_true",
                   help="resume from the streaming client's own event loop (before 2026-12-06: its handshakes "
                        "then delay the stream's timestamps)")
    p.add_argument("--bare", action="store_true",
                   help="the control: open and close as many connections instead, no resume and no page-in")
    p.add_argument("--resumer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resumer:
        return resumer_main()
    args.daemon_arg = ["--session-idle-release-s", "1", "--checkpoint-idle-s", "0", *args.daemon_arg]
    common.passive_omp()
    rows = asyncio.run(run(args))
    quiet = [g for r in rows for g in r["quiet"]]
    during = [g for r in rows for g in r["during"]]
    around = [g for r in rows for g in r["around"]]
    s = summary(quiet, during)
    a50 = common.median(around)
    origins = [o for r in rows for o in r["origins"]]
    what = "bare connections (the control)" if args.bare else f"disk resumes of ~{args.history} tokens"
    print(f"{args.rounds} rounds x {args.sessions} {what} while a reply streams")
    print(f"{'':10}{'p50 ms':>10}{'p90 ms':>10}{'gaps':>8}")
    print(f"{'quiet':10}{common.fmt(s['quiet_p50_ms'])}{common.fmt(s['quiet_p90_ms'])}{len(quiet):>8}")
    print(f"{'around':10}{common.fmt(common.ms(a50))}{common.fmt(common.ms(common.percentile(around, 90)))}"
          f"{len(around):>8}")
    print(f"{'resumes':10}{common.fmt(s['during_p50_ms'])}{common.fmt(s['during_p90_ms'])}{len(during):>8}")
    print(f"median gap while resuming / quiet: {common.fmt(s['ratio_p50'], 0, 3)} "
          f"({'the control' if args.bare else 'target <= 1.2'}); "
          f"{origins.count('disk')} of {len(origins)} resumes from disk")
    print(f"median gap while resuming / around the resumes (same reply): "
          f"{common.fmt(common.ratio(common.median(during), a50), 0, 3)}")
    stalls = [r["stall_s"] for r in rows if r["stall_s"] is not None]
    stall_ms = common.ms(sum(stalls) / max(1, len(origins))) if stalls else None
    print(f"the stream's delay per {'connection' if args.bare else 'resume'} (the gaps touching the window "
          f"beyond the median around it, summed): {common.fmt(stall_ms, 0)} ms")
    cpu = {name: sum(r["cpu_ms"].get(name, 0.0) for r in rows) / max(1, len(origins)) for name in rows[0]["cpu_ms"]}
    print("CPU time in the resume windows, per resume (ms, every thread; the core's includes the stream's steps): "
          + ", ".join(f"{name} {ms:.1f}" for name, ms in cpu.items()))
    print(json.dumps(common.rounded({**s, "around_p50_ms": common.ms(a50),
                                     "ratio_around_p50": common.ratio(common.median(during), a50),
                                     "resumes": len(origins), "from_disk": origins.count("disk"),
                                     "stall_ms_per_resume": stall_ms,
                                     "resume_s": [r["resume_s"] for r in rows], "cpu_ms_per_resume": cpu})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
