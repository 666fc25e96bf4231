"""A fleet's failover and its proxy's cost: three daemons, HAProxy (deploy/haproxy.cfg), one PostgreSQL.

    python bench/fleet.py                          # 8 sessions on the daemon that dies, lease 3 s
    python bench/fleet.py --sessions 4 --repeats 2 # a smoke run

The same real parts as tests/fleet/test_failover.py (its helpers are used):
a throwaway PostgreSQL cluster, three `streamchat serve` daemons sharing it
and one data folder, and Debian's haproxy with the shipped config.

Failover: --sessions sessions are opened directly on daemon d1, each with
one greedy turn, and left idle until d1 has checkpointed them; then half of
them get one more user item (stored, so their saved file no longer matches
their transcript). d1 is killed with SIGKILL; every client reconnects
through the proxy with `?session_id=`, resumes (retrying `session_leased`
until d1's lease runs out) and asks for a reply. Reported per way the KV
came back (`disk`: the saved file, `transcript`: rebuilt): the time from the
kill to the reply's first token, p50 and p99 over those sessions, with the
part of it spent waiting for the lease (`--lease-s`).

Proxy overhead: one session at a time on d2, --repeats greedy replies of
--reply-tokens tokens each through the proxy and directly, interleaved:
TTFT (from response.create to the first delta, as the client sees it) and
tokens/s (the daemon's own `response.usage.timing`), medians.

Prints a table, then one JSON line. Never asserts; exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fleet")]

import pgcluster  # noqa: E402
from fleetparts import Chat, FleetDaemon, Proxy, wait_for  # noqa: E402

from streamchat.tiers.datadir import MARKER  # noqa: E402
from streamchat.tiers.disk import file_name  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=8, help="sessions on the daemon that is killed")
    p.add_argument("--lease-s", type=float, default=3.0)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="replies each way for the proxy's overhead")
    p.add_argument("--reply-tokens", type=int, default=32)
    return p.parse_args(argv)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def timed_reply(chat: Chat, max_tokens: int) -> tuple[float, float]:
    """(TTFT ms as the client sees it, the daemon's tokens/s) of one greedy reply."""
    await chat.send({"type": "response.create", "response": {"temperature": 0, "max_output_tokens": max_tokens}})
    t0 = time.monotonic()
    ttft = None
    while True:
        event = await chat.recv()
        if event["type"] == "response.output_text.delta" and ttft is None:
            ttft = (time.monotonic() - t0) * 1000
        elif event["type"] == "response.done":
            timing = (event["response"].get("usage") or {}).get("timing") or {}
            return ttft or float("nan"), timing.get("output_tokens_per_s") or float("nan")


async def proxy_overhead(args, proxy: Proxy, direct: FleetDaemon) -> dict:
    figures = {"proxy": ([], []), "direct": ([], [])}
    for way, url in (("proxy", proxy.url), ("direct", direct.url)):  # warm both paths once
        chat = await Chat().open(url)
        await chat.say("Hello.")
        await timed_reply(chat, 4)
        await chat.close()
    for i in range(args.repeats):
        for way in (("proxy", "direct") if i % 2 == 0 else ("direct", "proxy")):
            chat = await Chat().open(proxy.url if way == "proxy" else direct.url)
            await chat.say(f"Describe a river in a few words ({i}).")
            ttft, tps = await timed_reply(chat, args.reply_tokens)
            figures[way][0].append(ttft)
            figures[way][1].append(tps)
            await chat.close()
    return {way: {"ttft_ms": statistics.median(t), "tokens_per_s": statistics.median(s)}
            for way, (t, s) in figures.items()}


async def failover(args, victim: FleetDaemon, proxy: Proxy, shared: Path) -> dict:
    chats = [await Chat().open(victim.url) for _ in range(args.sessions)]
    for i, chat in enumerate(chats):
        await chat.say(f"One word about the number {i}?")
        await timed_reply(chat, 8)
    for chat in chats:
        wait_for(lambda c=chat: (shared / file_name(c.session_id)).exists(), "checkpoints", 60)
    stale = chats[: args.sessions // 2]
    for chat in stale:  # acknowledged after the checkpoint: their file no longer matches
        await chat.say("And now?")
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()

    async def come_back(chat: Chat) -> tuple[str, float, float]:
        await chat.close()
        answer, _ = await chat.resume_until_served(proxy.url, args.lease_s + 60)
        resumed = time.monotonic() - killed
        ttft, _ = await timed_reply(chat, 4)
        return answer["restored_from"], resumed, resumed + ttft / 1000

    results = await asyncio.gather(*(come_back(c) for c in chats))
    out = {}
    for way in ("disk", "transcript"):
        firsts = [first for w, _, first in results if w == way]
        resumes = [r for w, r, _ in results if w == way]
        out[way] = {"sessions": len(firsts), "first_token_p50_s": pct(firsts, 0.5),
                    "first_token_p99_s": pct(firsts, 0.99), "resumed_p50_s": pct(resumes, 0.5)}
    for chat in chats:
        await chat.close()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    cluster = pgcluster.start_cluster()
    daemons, proxy = [], None
    try:
        url = cluster.url(cluster.create_database())
        shared = Path(tempfile.mkdtemp(prefix="streamchat-fleet-kv-"))
        (shared / MARKER).touch()
        flags = ["--lease-s", str(args.lease_s), "--heartbeat-s", str(args.heartbeat_s), "--checkpoint-idle-s", "1"]
        daemons = [FleetDaemon(f"d{i}", url, shared, *flags).spawn() for i in (1, 2, 3)]
        for d in daemons:
            d.wait()
        proxy = Proxy(daemons)
        overhead = asyncio.run(proxy_overhead(args, proxy, daemons[1]))
        moved = asyncio.run(failover(args, daemons[0], proxy, shared))
    finally:
        if proxy is not None:
            proxy.stop()
        for d in daemons:
            d.stop()
        cluster.stop()
    print(f"failover (lease {args.lease_s:g} s, heartbeat {args.heartbeat_s:g} s): kill -9 -> first token")
    print(f"{'from':<11}{'sessions':>9}{'p50 s':>8}{'p99 s':>8}{'resumed p50 s':>15}")
    for way, f in moved.items():
        print(f"{way:<11}{f['sessions']:>9}{f['first_token_p50_s']:>8.2f}{f['first_token_p99_s']:>8.2f}"
              f"{f['resumed_p50_s']:>15.2f}")
    print(f"proxy overhead ({args.repeats} replies of {args.reply_tokens} tokens each way, medians)")
    for way, f in overhead.items():
        print(f"{way:<8} TTFT {f['ttft_ms']:8.1f} ms  {f['tokens_per_s']:6.1f} tok/s")
    print(json.dumps({"failover": moved, "proxy_overhead": overhead, "lease_s": args.lease_s,
                      "sessions": args.sessions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
