"""Prefix reuse over the stateless HTTP API: TTFT of turn N of a chat re-sent whole every turn.

    python bench/http_prefix.py                      # 10 turns, ~60-token user messages
    python bench/http_prefix.py --turns 4 --tokens 8 # a smoke run

Starts the daemon twice (`--prefix-sharing true`, then `false`), each on a
fresh database, and holds the same chat through `POST /v1/chat/completions`
with `stream: true`: every turn sends the system prompt and all earlier
messages again, as an OpenAI client does. The user messages are slices of
the shipped Botchan text; replies are greedy, --tokens long. TTFT is the
wall time from sending the request to the first content chunk; the usage
chunk gives prompt and cached tokens. Prints one row per turn and one JSON
line. Never asserts; exits 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from long_sessions import HOST, StreamchatDaemon  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a patient reader who answers questions about a novel in two sentences."


def turn(port: int, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """(ttft seconds, reply text, usage) of one streamed chat completion."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft, parts, usage = None, [], {}
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            if choice["delta"].get("content"):
                ttft = ttft or time.perf_counter() - started
                parts.append(choice["delta"]["content"])
        usage = chunk.get("usage") or usage
    conn.close()
    return ttft or time.perf_counter() - started, "".join(parts), usage


def run_chat(port: int, args) -> list[dict]:
    words = common.botchan_text().split()
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for n in range(args.turns):
        excerpt = " ".join(words[n * args.words:(n + 1) * args.words])
        messages.append({"role": "user", "content": f"About this passage: {excerpt} -- who speaks here?"})
        ttft, text, usage = turn(port, messages, args.tokens)
        messages.append({"role": "assistant", "content": text})
        rows.append({"turn": n + 1, "ttft_ms": ttft * 1000, "prompt_tokens": usage.get("prompt_tokens"),
                     "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=16, help="reply tokens per turn")
    p.add_argument("--words", type=int, default=45, help="words of Botchan per user message")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--daemon-arg", action="append", default=[], help="extra flag for the daemon")
    args = p.parse_args()
    results = {}
    for sharing in ("true", "false"):
        with tempfile.TemporaryDirectory() as tmp:
            args_run = argparse.Namespace(**{**vars(args), "daemon_arg": [
                *args.daemon_arg, "--prefix-sharing", sharing, "--window-tokens", "4096"]})
            with StreamchatDaemon(Path(tmp), args_run) as d:
                port = int(d.url.split(":")[2].split("/")[0])
                results[sharing] = run_chat(port, args)
    print(f"{'turn':>4} {'prompt':>7} | {'cached':>7} {'ttft ms':>9} (reuse) | {'cached':>7} {'ttft ms':>9} (no reuse)")
    for on, off in zip(results["true"], results["false"]):
        print(f"{on['turn']:>4} {on['prompt_tokens']:>7} | {on['cached_tokens']:>7} {on['ttft_ms']:>9.1f}         "
              f"| {off['cached_tokens']:>7} {off['ttft_ms']:>9.1f}")
    last_on, last_off = results["true"][-1], results["false"][-1]
    print(json.dumps({"bench": "http_prefix", "turns": args.turns, "threads": args.threads,
                      "last_turn": {"prompt_tokens": last_on["prompt_tokens"],
                                    "ttft_ms_reuse": round(last_on["ttft_ms"], 1),
                                    "ttft_ms_no_reuse": round(last_off["ttft_ms"], 1),
                                    "cached_tokens_reuse": last_on["cached_tokens"],
                                    "speedup": round(last_off["ttft_ms"] / last_on["ttft_ms"], 2)}}))


if __name__ == "__main__":
    main()
