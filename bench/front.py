"""The HTTP front against the one it replaced: TTFT and tokens/s through each, interleaved in one run.

Starts two daemons on loopback, one from this tree and one from an older
commit (`--old-ref`, default the last commit with the hand-written HTTP/1.1
front), the same model and flags, and runs each scenario on one daemon then
the other, round after round, so load on the machine falls on both alike:

    http x1    one streaming chat completion at a time (SSE)
    http x16   sixteen at once
    ws x1      one Realtime response at a time over the websocket
    ws x16     sixteen websockets at once

TTFT is from sending the request to the first text delta, measured by the
client; tokens/s is completion tokens over the whole reply's time, summed
over concurrent clients. Prints each figure for old and new and new/old.

    python bench/front.py [--rounds 3] [--max-tokens 48] [--old-ref REF]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import orjson
from common import PROMPTS, fmt, median, ratio
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parent.parent
OLD_REF = "0c085cb"  # main before the uvicorn front: streamchat/server/http.py, hand-written
FLAGS = ["--num-blocks", "2000", "--window-tokens", "1024", "--num-threads", "2", "--max-running", "64"]


def start(src: Path, db: Path) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "streamchat", "serve", "--port", "0", "--database-url", f"sqlite:///{db}", *FLAGS]
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"listening on ws://[\d.]+:(\d+)/", line)
        if m:
            subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.DEVNULL)  # keep its pipe drained
            return proc, int(m.group(1))
    raise RuntimeError(f"the daemon from {src} did not start")


def old_tree(ref: str, into: Path) -> Path:
    """The files of `ref` (git archive), to run the old front from."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


async def http_reply(port: int, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft s, total s, completion tokens) of one streamed chat completion over raw HTTP/1.1."""
    body = orjson.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                         "max_tokens": max_tokens, "stream": True, "temperature": 0,
                         "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    ttft, tokens = None, 0
    async for line in reader:
        if line.startswith(b"data: {"):
            doc = orjson.loads(line[6:])
            if ttft is None and doc["choices"] and doc["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
        elif line.startswith(b"data: [DONE]"):
            break
    writer.close()
    return ttft or 0.0, time.perf_counter() - t0, tokens


async def ws_reply(port: int, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft s, total s, output tokens) of one Realtime response on a fresh websocket."""
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
        await ws.recv()
        await ws.send(orjson.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}}).decode())
        t0 = time.perf_counter()
        await ws.send(orjson.dumps({"type": "response.create", "response": {
            "max_output_tokens": max_tokens, "temperature": 0}}).decode())
        ttft = None
        while True:
            event = orjson.loads(await ws.recv())
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - t0
            elif event["type"] == "response.done":
                usage = event["response"].get("usage") or {}
                return ttft or 0.0, time.perf_counter() - t0, usage.get("output_tokens", 0)


async def scenario(kind: str, port: int, clients: int, max_tokens: int) -> dict:
    reply = http_reply if kind == "http" else ws_reply
    t0 = time.perf_counter()
    done = await asyncio.gather(*(reply(port, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(clients)))
    wall = time.perf_counter() - t0
    return {"ttft_ms": median([d[0] * 1000 for d in done]), "tok_s": sum(d[2] for d in done) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--old-ref", default=OLD_REF)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fronts = {"old": old_tree(args.old_ref, tmp / "old"), "new": ROOT}
        procs = {name: start(src, tmp / f"{name}.db") for name, src in fronts.items()}
        try:
            results = run(procs, args)
        finally:
            for proc, _ in procs.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    print(f"{'scenario':<10} {'ttft old':>10} {'ttft new':>10} {'new/old':>8} {'tok/s old':>10} {'tok/s new':>10} "
          f"{'new/old':>8}   (medians of {args.rounds} rounds, {args.max_tokens} tokens a reply)")
    for name, r in results.items():
        t_old, t_new = median(r["old"]["ttft_ms"]), median(r["new"]["ttft_ms"])
        s_old, s_new = median(r["old"]["tok_s"]), median(r["new"]["tok_s"])
        print(f"{name:<10} {fmt(t_old)} {fmt(t_new)} {fmt(ratio(t_new, t_old), 8, 2)} {fmt(s_old)} {fmt(s_new)} "
              f"{fmt(ratio(s_new, s_old), 8, 2)}")


def run(procs: dict, args) -> dict:
    scenarios = [("http", 1), ("http", 16), ("ws", 1), ("ws", 16)]
    results = {f"{k} x{n}": {f: {"ttft_ms": [], "tok_s": []} for f in procs} for k, n in scenarios}

    async def go() -> None:
        for _, port in procs.values():  # warm-up: the first reply of a daemon pays for lazy set-up
            await scenario("http", port, 1, 4)
        for _ in range(args.rounds):
            for kind, clients in scenarios:
                for name, (_, port) in procs.items():
                    r = await scenario(kind, port, clients, args.max_tokens)
                    print(f"{name} {kind} x{clients}: ttft {r['ttft_ms']:.0f} ms, {r['tok_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)
                    for key in ("ttft_ms", "tok_s"):
                        results[f"{kind} x{clients}"][name][key].append(r[key])
    asyncio.run(go())
    return results


if __name__ == "__main__":
    main()
