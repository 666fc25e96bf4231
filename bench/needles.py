"""Needle retrieval past the window: what perplexity hides about an eviction policy.

One session through the engine (`LLM(...).engine`, as the daemon runs it):
`--facts` facts stated early ("The locker code for the red door is 4817."),
then `--filler-tokens` of the shipped *Botchan* as user messages, well past
the window, then one question per fact ("What is the locker code for the red
door?"), each answered greedily before the next is asked. A fact counts as
recalled when the first four-digit number in the reply is its code (the model
tends to go on listing other facts' codes). Runs the same conversation
under each `--policy`:

    full         a window that holds the whole conversation (where it fits the model's context)
    sink_window  sinks + the most recent `--window-tokens`
    h2o          the same budget, the least attention-scored blocks evicted

    python bench/needles.py --num-threads 1
    python bench/needles.py --facts 20 --filler-tokens 1536 --window-tokens 512 --num-threads 1  # shorter

Prints a table, then one JSON line per policy: policy, recalled, facts,
accuracy, evicted_tokens, context_tokens, seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

from common import BOTCHAN

THINGS = ["red door", "blue gate", "garden shed", "north tower", "wine cellar", "boat house", "old barn",
          "east wing", "library", "kitchen", "attic", "garage", "bakery", "chapel", "laundry", "workshop",
          "greenhouse", "stable", "lighthouse", "museum", "pharmacy", "theatre", "gym", "school"]
SYSTEM = "You are a helpful assistant. You remember what the user tells you and answer briefly."


def facts(n: int, seed: int) -> list[tuple[str, str]]:
    if not 0 < n <= len(THINGS):
        raise SystemExit(f"--facts must be in 1..{len(THINGS)}, got {n}")
    rng = random.Random(seed)
    return [(thing, str(rng.randrange(1000, 10000))) for thing in THINGS[:n]]


def filler(tokenizer, num_tokens: int, piece: int = 256) -> list[str]:
    """Botchan in user messages of about `piece` tokens, `num_tokens` in all."""
    ids = tokenizer(BOTCHAN.read_text(encoding="utf-8")[5000:])["input_ids"][:num_tokens]
    return [tokenizer.decode(ids[i:i + piece]) for i in range(0, len(ids), piece)]


def run(loaded, policy: str, args, pairs, chunks) -> dict:
    from streamchat.config import CacheConfig, Config, ModelConfig
    from streamchat.llm import LLM

    window = args.window_tokens
    if policy == "full":
        window = loaded.model.shape.max_position_embeddings - 64
    cache = CacheConfig(num_blocks=window // 16 + 64, window_tokens=window, sink_tokens=args.sink_tokens,
                        eviction="h2o" if policy == "h2o" else "sink_window",
                        h2o_recent_tokens=args.h2o_recent_tokens, h2o_decay=args.h2o_decay)
    llm = LLM(Config(model=ModelConfig(dtype=args.dtype), cache=cache), loaded=loaded)
    eng = llm.engine
    started = time.perf_counter()
    eng.open_session("s", SYSTEM)
    eng.add_item("s", "user", "Please remember these facts. " + " ".join(
        f"The locker code for the {thing} is {code}." for thing, code in pairs))
    llm.respond(["s"], max_tokens=args.reply_tokens)
    for text in chunks:
        eng.add_item("s", "user", "Here is more of the story: " + text)
    llm.drain()
    recalled = 0
    for thing, code in pairs:
        eng.add_item("s", "user", f"What is the locker code for the {thing}? Answer with the number only.")
        reply = llm.respond(["s"], max_tokens=args.reply_tokens)[0]
        first = re.search(r"\d{4}", reply.text)
        recalled += first is not None and first.group() == code
        if args.show:
            print(f"{policy}: {thing} {code} -> {reply.text!r}", file=sys.stderr)
    stats = eng.session_stats("s")
    total = eng.sessions["s"].total_tokens
    note = None
    if policy == "full" and stats.evicted_tokens:
        note = "did not fit the model's context: evicted"
    return {"policy": policy, "recalled": recalled, "facts": len(pairs), "accuracy": recalled / len(pairs),
            "evicted_tokens": stats.evicted_tokens, "context_tokens": stats.context_tokens,
            "conversation_tokens": total, "window_tokens": None if policy == "full" else window,
            "seconds": round(time.perf_counter() - started, 1), "note": note}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--facts", type=int, default=20)
    p.add_argument("--filler-tokens", type=int, default=3072)
    p.add_argument("--window-tokens", type=int, default=1024)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--h2o-recent-tokens", type=int, default=256)
    p.add_argument("--h2o-decay", type=float, default=1.0)
    p.add_argument("--reply-tokens", type=int, default=24, help="the model restates the question first")
    p.add_argument("--policy", default="full,sink_window,h2o", help="comma-separated: full, sink_window, h2o")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", action="store_true", help="print each question's reply to stderr")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=0)
    args = p.parse_args()
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for name in policies:
        if name not in ("full", "sink_window", "h2o"):
            raise SystemExit(f"--policy: unknown {name!r}; choose from full, sink_window, h2o")
    import torch

    from streamchat.config import ModelConfig
    from streamchat.model.runner import load_model

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    loaded = load_model(ModelConfig(dtype=args.dtype))
    pairs = facts(args.facts, args.seed)
    chunks = filler(loaded.tokenizer, args.filler_tokens)
    rows = [run(loaded, policy, args, pairs, chunks) for policy in policies]
    print(f"{'policy':<12} {'recalled':>8} {'accuracy':>8} {'evicted':>8} {'context':>8} {'seconds':>8}")
    for r in rows:
        print(f"{r['policy']:<12} {r['recalled']:>5}/{r['facts']:<2} {r['accuracy']:>8.2f} "
              f"{r['evicted_tokens']:>8} {r['context_tokens']:>8} {r['seconds']:>8.1f}  {r['note'] or ''}")
    for r in rows:
        print(json.dumps({"bench": "needles", **r}))


if __name__ == "__main__":
    main()
