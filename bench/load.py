"""The daemon under load: many websocket sessions against a real `streamchat serve` on loopback.

    python bench/load.py                                   # 64 then 256 sessions, the issue's sizes
    python bench/load.py --phases 4,8 --turns 2 --max-output-tokens 4 --duration-s 60   # a smoke run

Starts `python -m streamchat serve --port 0` in a subprocess on 127.0.0.1
with a temporary SQLite file and a deliberately small engine (--num-blocks,
--max-running, --queue-timeout-s, --window-tokens below), so that the
largest phase overloads it. Its log goes to a file in the temporary folder
(the last lines are printed if it fails to start).

For each N in --phases, in order, N websocket clients connect at once (one
session each) and each runs --turns turns: `conversation.item.create` (a
short user message that starts with the session's own number, so no two
sessions share a KV block) then `response.create` with
`max_output_tokens = --max-output-tokens`, reading events until
`response.done`. A response that fails with `overloaded` counts as an
error of that code and the client goes on with its next turn. The phase
stops at --duration-s: clients still running are closed and their
unfinished turns count as `timed_out`. Client-side timestamps
(`time.perf_counter` on arrival): time to first token = response.create
sent -> first `response.output_text.delta`; inter-token latency = gaps
between consecutive deltas. /healthz is sampled every --sample-s during
the phase for the peak KV usage.

After all sockets close: /healthz and /metrics again, the `streamchat_kv_blocks`
gauge (free / cached / used / shared), the sessions gauge (stored sessions
stay in the daemon, idle, and keep their blocks until memory pressure takes
them, by policy), and, unless --no-verify, each session is resumed on a
fresh socket (`streamchat.session.resume`, which brings it back up from
its tier) and asked for `streamchat.session.stats`. Then, the daemon idle
again: leaked blocks = used blocks - the distinct blocks in the sessions'
tables (both from /healthz; target 0). Blocks per resident idle session is
reported too.

Prints a table, then one JSON line. Never asserts; exits 0 (2 only if the
daemon cannot start). Only loopback addresses are used.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

HOST = "127.0.0.1"
TARGET_LEAKED = 0

QUESTIONS = ["What is a good name for a cat?", "Name three colors.", "Say hello in French.",
             "What is two plus two?", "Give me a fruit.", "What day comes after Monday?"]


# -- the daemon -----------------------------------------------------------------------

class Daemon:
    """`streamchat serve` on loopback, port 0, logging to a file."""

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        self.folder = folder
        self.log_path = folder / "daemon.log"
        self.cmd = [sys.executable, "-m", "streamchat", "serve", "--host", HOST, "--port", "0",
                    "--database-url", f"sqlite:///{folder / 'load.db'}",
                    "--num-blocks", str(args.num_blocks), "--max-running", str(args.max_running),
                    "--queue-timeout-s", str(args.queue_timeout_s), "--window-tokens", str(args.window_tokens),
                    "--max-output-tokens", str(max(args.max_output_tokens, 16)),
                    "--max-connections", str(max(512, max(args.phases) + 64)),
                    "--dtype", args.dtype, "--log-level", args.log_level]
        if args.model:
            self.cmd += ["--model", args.model]
        if args.num_threads:
            self.cmd += ["--num-threads", str(args.num_threads)]
        self.cmd += args.daemon_arg
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self, timeout: float) -> None:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True,
                                     cwd=self.folder)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            m = re.search(r"listening on ws://[\d.]+:(\d+)/", text)
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}")
            time.sleep(0.2)
        raise RuntimeError(f"daemon did not listen within {timeout:.0f} s")

    def tail(self, lines: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}/v1/realtime"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{HOST}:{self.port}{path}", timeout=30) as r:
            return r.read()

    def health(self) -> dict:
        return json.loads(self.get("/healthz"))

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics").decode())

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (no comments)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def gauge(metrics: dict[str, float], name: str) -> dict[str, float]:
    """{label value: value} of a one-label gauge."""
    out = {}
    for key, value in metrics.items():
        m = re.fullmatch(re.escape(name) + r'\{\w+="([^"]*)"\}', key)
        if m:
            out[m.group(1)] = value
    return out


# -- clients --------------------------------------------------------------------------

@dataclass
class Record:
    """What one client saw."""

    index: int
    session_id: str | None = None
    resume_token: str | None = None
    statuses: Counter = field(default_factory=Counter)  # response.done status
    errors: Counter = field(default_factory=Counter)  # error events by code
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    turns_done: int = 0
    failure: str | None = None  # a client-side failure (connect refused, closed, ...)


async def recv(ws, timeout: float) -> dict:
    import orjson

    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws, event: dict) -> None:
    import orjson

    await ws.send(orjson.dumps(event).decode())


async def client(url: str, rec: Record, turns: int, max_tokens: int, event_timeout: float) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=event_timeout, close_timeout=5) as ws:
        created = await recv(ws, event_timeout)
        if created.get("type") != "session.created":
            rec.failure = f"first event {created.get('type')}"
            return
        rec.session_id = created["session"]["id"]
        rec.resume_token = created["session"].get("resume_token")
        for turn in range(turns):
            text = f"Session {rec.index}, turn {turn}. {QUESTIONS[(rec.index + turn) % len(QUESTIONS)]}"
            await send(ws, {"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
            await send(ws, {"type": "response.create", "response": {"max_output_tokens": max_tokens}})
            sent = time.perf_counter()
            last = None
            while True:
                e = await recv(ws, event_timeout)
                kind = e.get("type")
                if kind == "response.output_text.delta":
                    now = time.perf_counter()
                    if last is None:
                        rec.ttfts.append(now - sent)
                    else:
                        rec.gaps.append(now - last)
                    last = now
                elif kind == "error":
                    rec.errors[e.get("error", {}).get("code", "?")] += 1
                elif kind == "response.done":
                    resp = e["response"]
                    reason = (resp.get("status_details") or {}).get("reason")
                    rec.statuses[resp["status"] + (f":{reason}" if reason else "")] += 1
                    rec.turns_done += 1
                    break


async def run_client(url: str, rec: Record, args, deadline: float) -> None:
    try:
        await asyncio.wait_for(client(url, rec, args.turns, args.max_output_tokens, args.event_timeout_s),
                               max(0.1, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        rec.failure = rec.failure or "timed_out"
    except Exception as exc:  # a refused handshake, a closed socket: counted, never raised
        rec.failure = f"{type(exc).__name__}: {exc}"[:120]


async def sampler(daemon: Daemon, every: float, out: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            out.append(await asyncio.to_thread(daemon.health))
        except Exception:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def phase(daemon: Daemon, n: int, first_index: int, args) -> tuple[dict, list[Record]]:
    recs = [Record(first_index + i) for i in range(n)]
    samples: list[dict] = []
    stop = asyncio.Event()
    watch = asyncio.create_task(sampler(daemon, args.sample_s, samples, stop))
    start = time.monotonic()
    deadline = start + args.duration_s
    await asyncio.gather(*(run_client(daemon.url, r, args, deadline) for r in recs))
    wall = time.monotonic() - start
    stop.set()
    await watch
    errors, statuses, failures = Counter(), Counter(), Counter()
    for r in recs:
        errors.update(r.errors)
        statuses.update(r.statuses)
        if r.failure:
            failures[r.failure.split(":")[0]] += 1
    ttfts = [t for r in recs for t in r.ttfts]
    gaps = [g for r in recs for g in r.gaps]
    total = samples[0]["kv_blocks"]["total"] if samples else None
    min_free = min((s["kv_blocks"]["free"] for s in samples), default=None)
    row = {
        "sessions": n, "wall_s": wall, "turns_asked": n * args.turns,
        "responses_done": sum(statuses.values()),
        # a reply cut at max_output_tokens is a whole answer here
        "completed_responses": statuses.get("completed", 0) + statuses.get("incomplete:max_output_tokens", 0),
        "statuses": dict(statuses), "errors": dict(errors),
        "errors_other_than_overloaded": sum(v for k, v in errors.items() if k != "overloaded"),
        "client_failures": dict(failures),
        "turns_unfinished": n * args.turns - sum(r.turns_done for r in recs),
        "ttft_p50_ms": common.ms(common.percentile(ttfts, 50)),
        "ttft_p99_ms": common.ms(common.percentile(ttfts, 99)),
        "itl_p50_ms": common.ms(common.percentile(gaps, 50)),
        "itl_p99_ms": common.ms(common.percentile(gaps, 99)),
        "kv_blocks_total": total, "kv_blocks_min_free": min_free,
        "kv_peak_usage": (1 - min_free / total) if total and min_free is not None else None,
        "max_connections_seen": max((s.get("connections", 0) for s in samples), default=None),
    }
    return row, recs


async def session_stats(url: str, rec: Record, timeout: float) -> dict | None:
    """Resume the stored session on a fresh socket and ask for its stats."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=timeout, close_timeout=5) as ws:
        await recv(ws, timeout)  # session.created (a fresh session, dropped when we resume)
        await send(ws, {"type": "streamchat.session.resume", "session_id": rec.session_id,
                        "resume_token": rec.resume_token})
        while True:
            e = await recv(ws, timeout)
            if e["type"] == "error":
                return None
            if e["type"] == "streamchat.session.resumed":
                break
        await send(ws, {"type": "streamchat.session.stats"})
        while True:
            e = await recv(ws, timeout)
            if e["type"] == "streamchat.session.stats":
                return e
            if e["type"] == "error":
                return None


async def verify(daemon: Daemon, recs: list[Record], args) -> dict:
    targets = [r for r in recs if r.session_id and r.resume_token and r.turns_done + sum(r.errors.values())]
    sem = asyncio.Semaphore(args.verify_concurrency)
    drops_before = daemon.metrics().get("streamchat_idle_drops_total", 0.0)

    async def one(r: Record):
        async with sem:
            try:
                return await session_stats(daemon.url, r, args.event_timeout_s)
            except Exception:
                return None

    stats = await asyncio.gather(*(one(r) for r in targets))
    await settle(daemon, args)
    drops_after = daemon.metrics().get("streamchat_idle_drops_total", 0.0)
    got = [s for s in stats if s]
    return {"sessions_checked": len(targets), "stats_answered": len(got),
            "owned_blocks": sum(s["blocks"]["owned"] for s in got),
            "shared_blocks": sum(s["blocks"]["shared"] for s in got),
            "resident_sessions": sum(1 for s in got if s["blocks"]["owned"] + s["blocks"]["shared"]),
            "idle_drops_during_check": int(drops_after - drops_before)}


async def settle(daemon: Daemon, args) -> dict:
    """Wait (bounded) until no connection is open and nothing runs; the last health."""
    deadline = time.monotonic() + args.settle_s
    while True:
        h = await asyncio.to_thread(daemon.health)
        m = gauge(await asyncio.to_thread(daemon.metrics), "streamchat_sessions")
        if (h.get("connections", 0) == 0 and not m.get("running") and not m.get("waiting")) \
                or time.monotonic() > deadline:
            return h
        await asyncio.sleep(0.2)


async def run(daemon: Daemon, args) -> dict:
    before = await asyncio.to_thread(daemon.health)
    rows, recs, index = [], [], 0
    for n in args.phases:
        print(f"  phase: {n} sessions ...", file=sys.stderr, flush=True)
        row, got = await phase(daemon, n, index, args)
        index += n
        h = await settle(daemon, args)
        row["kv_blocks_free_after"] = h["kv_blocks"]["free"]
        rows.append(row)
        recs += got
        print(f"  phase: {n} sessions: {row['responses_done']} responses, errors {row['errors']}, "
              f"{row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    after = await settle(daemon, args)
    metrics = await asyncio.to_thread(daemon.metrics)
    blocks = gauge(metrics, "streamchat_kv_blocks")
    sessions = gauge(metrics, "streamchat_sessions")
    total = after["kv_blocks"]["total"]
    used = total - after["kv_blocks"]["free"]
    resident_idle = sessions.get("idle", 0) - sessions.get("paged_out", 0)
    report = {
        "kv_blocks_total": total, "kv_blocks_free_before": before["kv_blocks"]["free"],
        "kv_blocks_free_after": after["kv_blocks"]["free"], "kv_blocks_used_after": used,
        "kv_blocks_gauge": blocks, "sessions_gauge": sessions, "stored_sessions": after.get("sessions"),
        "connections_after": after.get("connections"),
        "blocks_per_resident_idle_session": used / resident_idle if resident_idle else None,
        "kv_bytes_per_token": after.get("kv_bytes_per_token"),
        "preemptions": metrics.get("streamchat_preemptions_total"),
        "idle_drops": metrics.get("streamchat_idle_drops_total"),
        "responses_by_status": gauge(metrics, "streamchat_responses_total"),
    }
    check = None
    if args.verify:
        print(f"  verify: resuming {len(recs)} sessions for their stats ...", file=sys.stderr, flush=True)
        check = await verify(daemon, recs, args)
        h = await settle(daemon, args)
        used_now = h["kv_blocks"]["total"] - h["kv_blocks"]["free"]
        # /healthz counts the distinct blocks in the sessions' tables (exact once the engine is idle);
        # the stats answers above are taken one after another while sessions move between tiers
        held = h["kv_blocks"].get("held")
        check |= {"kv_blocks_used": used_now, "held_by_sessions": held,
                  "leaked_blocks": None if held is None else used_now - held}
    return {"phases": rows, "after": report, "verify": check}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", type=common.int_list, default=[64, 256],
                   help="concurrent sessions per phase, run in order (default 64,256)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    p.add_argument("--max-output-tokens", type=int, default=16, help="per response (default 16)")
    p.add_argument("--duration-s", type=float, default=120.0, help="time limit of each phase (default 120)")
    p.add_argument("--event-timeout-s", type=float, default=60.0, help="longest wait for one event")
    p.add_argument("--sample-s", type=float, default=1.0, help="/healthz sampling period during a phase")
    p.add_argument("--settle-s", type=float, default=30.0, help="longest wait for the daemon to go quiet")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip resuming each session for its stats after the run")
    p.add_argument("--verify-concurrency", type=int, default=16)
    g = p.add_argument_group("the daemon (small on purpose: the largest phase must overload it)")
    g.add_argument("--num-blocks", type=int, default=512, help="KV pool blocks (default 512)")
    g.add_argument("--max-running", type=int, default=16, help="sessions generating at once (default 16)")
    g.add_argument("--queue-timeout-s", type=float, default=10.0, help="wait before `overloaded` (default 10)")
    g.add_argument("--window-tokens", type=int, default=256, help="(default 256)")
    g.add_argument("--model", default=None, help="default: the bundled model")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--num-threads", type=int, default=0, help="daemon torch threads (0: one per core)")
    g.add_argument("--log-level", default="warning", help="daemon log level (its log is in the temp folder)")
    g.add_argument("--daemon-arg", action="append", default=[], help="extra flag for the daemon (repeatable)")
    g.add_argument("--start-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.turns <= 0 or args.max_output_tokens <= 0 or args.duration_s <= 0:
        p.error("--turns, --max-output-tokens and --duration-s must be positive")

    with tempfile.TemporaryDirectory(prefix="streamchat-load-") as tmp:
        daemon = Daemon(Path(tmp), args)
        try:
            daemon.start(args.start_timeout_s)
        except RuntimeError as exc:
            print(f"load: {exc}\n{daemon.tail()}", file=sys.stderr)
            daemon.stop()
            return 2
        print(f"daemon on {daemon.url} (pid {daemon.proc.pid}): {' '.join(daemon.cmd[3:])}",
              file=sys.stderr, flush=True)
        try:
            result = asyncio.run(run(daemon, args))
        finally:
            rc = daemon.stop()
        log_tail = daemon.tail(10)

    after, check = result["after"], result["verify"]
    print(f"daemon: --num-blocks {args.num_blocks} --max-running {args.max_running} --queue-timeout-s "
          f"{args.queue_timeout_s:g} --window-tokens {args.window_tokens}; {args.turns} turns x "
          f"{args.max_output_tokens} tokens per session; phase limit {args.duration_s:g} s; exit code {rc}")
    print(f"{'sessions':>8}{'ok':>7}{'errors by code':>28}{'other':>7}{'unfin':>7}{'ttft p50':>10}"
          f"{'ttft p99':>10}{'itl p50':>9}{'itl p99':>9}{'peak kv':>9}{'wall s':>8}")
    for r in result["phases"]:
        errs = ",".join(f"{k}={v}" for k, v in sorted(r["errors"].items())) or "-"
        if r["client_failures"]:
            errs += " " + ",".join(f"{k}={v}" for k, v in sorted(r["client_failures"].items()))
        peak = f"{100 * r['kv_peak_usage']:.0f}%" if r["kv_peak_usage"] is not None else "-"
        print(f"{r['sessions']:>8d}{r['completed_responses']:>7d}{errs:>28}{r['errors_other_than_overloaded']:>7d}"
              f"{r['turns_unfinished']:>7d}{common.fmt(r['ttft_p50_ms'])}{common.fmt(r['ttft_p99_ms'])}"
              f"{common.fmt(r['itl_p50_ms'], 9)}{common.fmt(r['itl_p99_ms'], 9)}{peak:>9}{r['wall_s']:>8.1f}")
    print(f"KV blocks: {after['kv_blocks_total']} total; free before {after['kv_blocks_free_before']}, "
          f"after {after['kv_blocks_free_after']}; gauge {after['kv_blocks_gauge']}")
    print(f"sessions after: stored {after['stored_sessions']}, gauge {after['sessions_gauge']}; "
          f"blocks per resident idle session {common.fmt(after['blocks_per_resident_idle_session'], 0, 1)}; "
          f"idle drops {after['idle_drops']}, preemptions {after['preemptions']}")
    if check:
        print(f"leak check: {check['kv_blocks_used']} blocks used, {check['held_by_sessions']} in session "
              f"tables ({check['stats_answered']}/{check['sessions_checked']} sessions resumed and answered "
              f"stats): leaked {check['leaked_blocks']} (target {TARGET_LEAKED})")
    if rc not in (0, None):
        print(f"daemon exited with {rc}; its last log lines:\n{log_tail}")
    errors_other = sum(r["errors_other_than_overloaded"] for r in result["phases"])
    print(json.dumps(common.rounded({
        "bench": "load", "daemon_exit_code": rc,
        "daemon": {"num_blocks": args.num_blocks, "max_running": args.max_running,
                   "queue_timeout_s": args.queue_timeout_s, "window_tokens": args.window_tokens},
        "turns": args.turns, "max_output_tokens": args.max_output_tokens, "duration_s": args.duration_s,
        **result, "errors_other_than_overloaded": errors_other,
        "leaked_blocks": check["leaked_blocks"] if check else None,
        "targets": {"errors_other_than_overloaded": 0, "leaked_blocks": TARGET_LEAKED}})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
