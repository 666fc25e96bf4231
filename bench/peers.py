"""llama.cpp's `llama-server` as a peer to measure against, and the servers the benchmarks start.

`Server` runs a server subprocess logging to a file (started on enter once
`ready()` says so, stopped on exit). `LlamaServer` runs the peer on the
bundled GGUF; `stream_chat` drives its `/v1/chat/completions` with
`stream: true`, stamping each content piece as it arrives, and
`llama_rates` runs N such streams at once for the throughput benchmarks.

Build the peer once with `../shared/tools/build-llama-server.sh` (it prints
the binary's path) and pass it as `--llama-server PATH`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from streamchat.model.loader import bundled_gguf

HOST = "127.0.0.1"


@dataclass
class Reply:
    started: float = 0.0
    stamps: list[float] = field(default_factory=list)  # arrival of each streamed piece
    tokens: int = 0
    status: str = ""
    text: str = ""


class Server:
    """A server subprocess logging to a file: started on enter (polling `ready`), stopped on exit."""

    name = "server"

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log

    def ready(self) -> bool:
        raise NotImplementedError

    def exit_hint(self, returncode: int) -> str:
        return f"exit status {returncode}"

    def __enter__(self):
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.ready():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.exit_hint(self.proc.returncode)}):\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.out.close()


class LlamaServer(Server):
    """`llama-server` on the bundled GGUF with `slots` parallel slots sharing a `context`-token cache."""

    name = "llama-server"

    def exit_hint(self, returncode: int) -> str:
        import signal

        if returncode in (-signal.SIGILL, -signal.SIGSEGV):
            # a Xeon VM that lists AMX the guest may not use: ggml's AMX Q4_1 kernel (GGML_NATIVE=ON) raises
            # SIGILL in its start-up warm-up decode (seen under gdb; the process itself ends with SIGSEGV)
            return (f"killed by signal {-returncode}; if the log ends at model loading on a CPU that lists AMX, "
                    "rebuild llama.cpp with -DGGML_NATIVE=OFF and the CPU's other extensions on (README, 'Measured')")
        return super().exit_hint(returncode)

    def __init__(self, binary: str, folder: Path, *, slots: int, context: int, threads: int, port: int) -> None:
        self.port = port
        super().__init__([binary, "-m", str(bundled_gguf()), "--host", HOST, "--port", str(port),
                          "-np", str(slots), "-c", str(context), "-t", str(threads), "-tb", str(threads)],
                         folder / "llama-server.log")

    def ready(self) -> bool:
        """Polled from sync code or from inside a running event loop alike: a blocking request."""
        import http.client

        conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()


async def stream_chat(port: int, messages: list[dict], max_tokens: int, reply: Reply, *,
                      ignore_eos: bool = False) -> None:
    """POST /v1/chat/completions with stream: true, greedy; one stamp per content piece.

    `ignore_eos` makes the reply run to `max_tokens`, as the benchmarks do on
    our side, so both sides produce the same number of tokens.
    """
    body = orjson.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                         "cache_prompt": True, "ignore_eos": ignore_eos})
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


def llama_rates(binary: str, prompts: list[str], tokens: int, *, threads: int, port: int = 18089,
                repeats: int = 1) -> list[dict]:
    """Each prompt as one user message, all streams at once, `tokens` each (EOS ignored), `repeats` rounds.

    Per round: `tok_s`, all pieces over the wall time from the first request
    to the last piece (prefill included, as the engine benchmarks count);
    `decode_tok_s`, pieces after each reply's first over the span from the
    earliest first piece to the latest last one; `ttft_s` per reply.
    One piece is one token for this model's streamed text (llama-server
    sends a chunk per token).
    """
    context = len(prompts) * (max(len(p) for p in prompts) // 2 + tokens + 256)
    with tempfile.TemporaryDirectory() as tmp, \
            LlamaServer(binary, Path(tmp), slots=len(prompts), context=context, threads=threads, port=port):
        return [asyncio.run(_round(port, prompts, tokens)) for _ in range(repeats)]


async def _round(port: int, prompts: list[str], tokens: int) -> dict:
    replies = [Reply() for _ in prompts]
    started = time.perf_counter()
    await asyncio.gather(*(stream_chat(port, [{"role": "user", "content": p}], tokens, r, ignore_eos=True)
                           for p, r in zip(prompts, replies)))
    done = [r for r in replies if r.stamps]
    pieces = sum(r.tokens for r in done)
    first = min((r.stamps[0] for r in done), default=started)
    last = max((r.stamps[-1] for r in done), default=started)
    after_first = sum(r.tokens - 1 for r in done)
    return {"tok_s": pieces / (last - started) if last > started else None,
            "decode_tok_s": after_first / (last - first) if last > first else None,
            "ttft_s": [r.stamps[0] - r.started for r in done], "tokens": pieces, "replies": len(done)}
