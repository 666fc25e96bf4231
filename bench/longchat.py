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

Every reply is greedy on every side (temperature 0: the same work per token).
streamchat is its daemon on its defaults, driven over its websocket
protocol (history as `streamchat.input_text.append`, committed);
llama-server over `/v1/chat/completions` with `--parallel N` slots and its
prompt cache, the same GGUF, the same thread count; transformers in this
process as one left-padded batch (the histories in one forward, then the
question and T-1 single-token steps with its KV cache; no eviction, so its
context keeps growing), in --hf-dtype. Ratios against each peer are printed
last; the targets: 0 failed responses, prefill rate >= 1.5x llama-server's,
aggregate decode >= 1.0x llama-server's.

    python bench/longchat.py --llama-server "$(../shared/tools/build-llama-server.sh)"

`--skip-streamchat`, `--skip-transformers`, or no `--llama-server` leave a side out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import common
import orjson
from peers import HOST, LlamaServer, Reply, Server, stream_chat

QUESTION = "In one sentence, what happened in the passage above?"
CHARS_PER_TOKEN = 4.1  # Botchan under the bundled tokenizer, measured


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


async def send(ws, event: dict) -> None:
    await ws.send(orjson.dumps(event).decode())  # a text frame: the protocol refuses binary ones


async def ws_respond(ws, reply: Reply, max_tokens: int) -> None:
    reply.started = time.perf_counter()
    # greedy, as llama-server is asked (peers.stream_chat): the daemon's default sampling (temperature 0.7,
    # top-p 0.9, repetition penalty 1.1) costs about 1 ms a step that llama-server's greedy replies do not pay
    await send(ws, ({"type": "response.create", "response": {"max_output_tokens": max_tokens, "temperature": 0}}))
    while True:
        e = orjson.loads(await ws.recv())
        if e["type"] == "response.output_text.delta":
            reply.stamps.append(time.perf_counter())
        elif e["type"] == "error":
            print(f"  streamchat error: {e['error']}", file=sys.stderr, flush=True)
            reply.status = "failed"
            return
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
            await send(ws, ({"type": "streamchat.input_text.append", "text": history[i:i + 4000]}))
        await send(ws, ({"type": "streamchat.input_text.commit"}))
        await ws_respond(ws, first, 1)
        ready.append(time.perf_counter())
        await go.wait()
        await send(ws, ({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}}))
        await ws_respond(ws, second, tokens)


async def run_streamchat(args, texts: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp, StreamchatDaemon(Path(tmp), args) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1/realtime")
        steps = []  # step counters (step_counters) when the questions go out and when the replies are done
        row = await drive("streamchat", texts, args,
                          lambda t, f, s, g, r: streamchat_session(d.url, t, f, s, g, args.tokens, r),
                          on_go=lambda: steps.append(step_counters(base)))
        steps.append(step_counters(base))
        (n0, s0, dn0, ds0), (n1, s1, dn1, ds1) = steps
        row["step_ms"] = 1000 * (s1 - s0) / (n1 - n0) if n1 > n0 else None  # the daemon's own, from /metrics
        # the steps of decode rows only: what bench/step.py times (the above includes the questions' prefill)
        row["decode_step_ms"] = 1000 * (ds1 - ds0) / (dn1 - dn0) if dn1 > dn0 else None
        return row


def step_counters(base: str) -> tuple[float, float, float, float]:
    """(steps, seconds in steps, decode-only steps, seconds in them) from the daemon's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    value = {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
             for name in ("streamchat_steps_total", "streamchat_step_seconds_total", "streamchat_decode_steps_total",
                          "streamchat_decode_step_seconds_total")}
    return (value["streamchat_steps_total"], value["streamchat_step_seconds_total"],
            value["streamchat_decode_steps_total"], value["streamchat_decode_step_seconds_total"])


async def drive(name: str, texts: list[str], args, session, on_go=None) -> dict:
    firsts, seconds = [Reply() for _ in texts], [Reply() for _ in texts]
    go, ready = asyncio.Event(), []
    started = time.perf_counter()
    tasks = [asyncio.create_task(session(t, f, s, go, ready)) for t, f, s in zip(texts, firsts, seconds)]
    while len(ready) < len(texts) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    prefill_s = max(ready, default=started) - started
    print(f"  {name}: {len(ready)} histories in {prefill_s:.1f} s; asking all at once", file=sys.stderr, flush=True)
    if on_go is not None:
        on_go()
    go.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return summarize(name, prefill_s, firsts, seconds)


# -- llama-server ------------------------------------------------------------------------------


async def llama_session(port: int, history: str, first: Reply, second: Reply, go: asyncio.Event,
                        tokens: int, ready: list) -> None:
    messages = [{"role": "user", "content": history}]
    await stream_chat(port, messages, 1, first)
    ready.append(time.perf_counter())
    await go.wait()
    messages += [{"role": "assistant", "content": getattr(first, "text", "")}, {"role": "user", "content": QUESTION}]
    await stream_chat(port, messages, tokens, second)


async def run_llama(args, texts: list[str]) -> dict:
    ctx = args.sessions * (args.history + args.tokens + 256)
    with tempfile.TemporaryDirectory() as tmp, LlamaServer(args.llama_server, Path(tmp), slots=args.sessions,
                                                          context=ctx, threads=args.threads, port=args.llama_port):
        return await drive("llama-server", texts, args,
                           lambda t, f, s, g, r: llama_session(args.llama_port, t, f, s, g, args.tokens, r))


# -- transformers ------------------------------------------------------------------------------


def run_transformers(args, texts: list[str]) -> dict:
    """One left-padded batch: all histories in one forward (1 token each), then question + T-1 steps."""
    import torch

    from streamchat.model.loader import resolve
    from streamchat.model.runner import pick_dtype
    from streamchat.text.chat import ChatFormat
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    source = resolve(None)
    dtype = pick_dtype(args.hf_dtype, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(source.folder)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype).eval()
    chat = ChatFormat.of(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows = [chat.bos_ids + chat.message("user", t) + chat.reply_prompt() for t in texts]
    question = chat.reply_end() + chat.message("user", QUESTION) + chat.reply_prompt()
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        prefill_s = time.perf_counter() - started
        past, n = out.cache, len(rows)
        print(f"  transformers: {n} histories ({width} tokens padded) in {prefill_s:.1f} s; asking all at once",
              file=sys.stderr, flush=True)
        # the first reply token (discarded, as the 1-token replies are), then the question: one forward
        step_ids = torch.cat([out.logits[:, -1].argmax(-1, keepdim=True), torch.tensor([question] * n)], dim=1)
        stamps = []
        for _ in range(args.tokens):
            mask = torch.cat([mask, torch.ones(n, step_ids.shape[1], dtype=mask.dtype)], dim=1)
            out = model(input_ids=step_ids, attention_mask=mask, cache=past, use_cache=True)
            past = out.cache
            step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            stamps.append(time.perf_counter())
    replies = [Reply(stamps=list(stamps), tokens=len(stamps), status="completed") for _ in rows]
    firsts = [Reply(status="completed") for _ in rows]
    return summarize("transformers", prefill_s, firsts, replies)


def print_ratios(rows: list[dict], sessions: int, history_tokens: int) -> None:
    """Ours against each peer: prefill rate (histories per second) and aggregate decode."""
    ours = next((r for r in rows if r["server"] == "streamchat"), None)
    for peer in (r for r in rows if r is not ours):
        if ours is None:
            return
        prefill = common.ratio(peer["prefill_s"], ours["prefill_s"])  # time ratio inverted: a rate ratio
        decode = common.ratio(ours["decode_tok_s"], peer["decode_tok_s"])
        target = " (targets: prefill >= 1.5x, decode >= 1.0x)" if peer["server"] == "llama-server" else ""
        print(f"streamchat / {peer['server']}: prefill rate {common.fmt(prefill, 0, 2)}x, "
              f"decode {common.fmt(decode, 0, 2)}x{target}")
    if ours is not None:
        print(f"streamchat: {ours['failed']} failed of {ours['responses']} (target 0); prefill "
              f"{common.fmt(common.ratio(sessions * history_tokens, ours['prefill_s']), 0, 0)} tok/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--history", type=int, default=2300, help="tokens of history per session (about)")
    p.add_argument("--tokens", type=int, default=32, help="tokens each simultaneous reply asks for")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", help="path of llama.cpp's llama-server binary (the peer)")
    p.add_argument("--llama-port", type=int, default=18089)
    p.add_argument("--skip-streamchat", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--hf-dtype", default="auto", help="transformers' dtype (auto: as the daemon picks)")
    p.add_argument("--daemon-arg", action="append", default=[], help="extra `streamchat serve` flag (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    common.passive_omp()
    texts = histories(args.sessions, args.history)
    rows = []
    if not args.skip_streamchat:
        rows.append(asyncio.run(run_streamchat(args, texts)))
        print(json.dumps(common.rounded(rows[-1])), file=sys.stderr, flush=True)
    if args.llama_server:
        rows.append(asyncio.run(run_llama(args, texts)))
        print(json.dumps(common.rounded(rows[-1])), file=sys.stderr, flush=True)
    if not args.skip_transformers:
        rows.append(run_transformers(args, texts))
    print(f"{args.sessions} sessions x ~{args.history} tokens of history, then {args.tokens} tokens each at once")
    print(f"{'server':14}{'prefill s':>10}{'failed':>8}{'decode tok/s':>14}{'itl p50 ms':>12}{'itl p99 ms':>12}")
    for r in rows:
        print(f"{r['server']:14}{common.fmt(r['prefill_s'])}{r['failed']:>5}/{r['responses']:<2}"
              f"{common.fmt(r['decode_tok_s'], 14)}{common.fmt(r['itl_p50_ms'], 12)}{common.fmt(r['itl_p99_ms'], 12)}")
    print_ratios(rows, args.sessions, args.history)
    ours = next((r for r in rows if r["server"] == "streamchat"), None)
    if ours is not None and ours.get("step_ms"):
        decode = ours.get("decode_step_ms")
        print(f"streamchat: {ours['step_ms']:.1f} ms a step while the replies decode, "
              f"{'-' if decode is None else f'{decode:.1f}'} ms a step of decode rows only (the daemon's "
              f"/metrics; compare bench/step.py --sessions {args.sessions} --cached <context>)")
    if args.json:
        print(json.dumps([common.rounded(r) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
