"""Prefix sharing: time to first token and KV bytes of sessions that share a long system prompt.

    python bench/prefix.py                                     # the issue's sizes
    python bench/prefix.py --prompt-tokens 200 --sessions 4 --repeats 1 --tokens 4   # a smoke run

The system prompt is the first --prompt-tokens tokens of the shipped Botchan
(streamchat/data/botchan.txt), decoded to text; with the chat framing it is
a few tokens longer (printed). Everything runs through `LLM(...).engine`,
stepped in this thread, exactly as the daemon's engine thread steps it.

1. Time to first token. Per repeat, a fresh variant of the prompt (a
   "(k) " prefix, so nothing of it is in the pool yet): a first session
   opens with it, adds a user item and asks for one token (cold: the whole
   prompt is computed); then a second session with the same prompt and
   another question does the same (served from the first one's blocks).
   TTFT = wall time from `open_session` to the finished one-token response
   (the engine's own `usage.ttft_ms` is shown too). Medians over
   --repeats; ratio cold / shared (target >= 10). Also the ref counts of the
   prompt's full blocks while both sessions are open (2 each when shared).
2. KV bytes. --sessions sessions with the same prompt, each with a user
   item and a greedy reply of --tokens tokens (EOS off, so every reply has
   the same length), once with prefix sharing (the default) and once with
   `CacheConfig(prefix_sharing=False)`, each in its own pool. By default the
   first session is served alone and the others then arrive together (the
   prompt is "in use"); --burst opens all at once instead (then sessions
   that start before the first one's blocks are written compute their own).
   Reported: the pool's used blocks and bytes, the sum of the sessions'
   `kv_bytes`, how many physical copies of the prompt's full blocks exist
   (target: 1, the prompt's bytes counted once), the ref counts of the
   first session's prompt blocks, and the used blocks after all sessions
   close (0: nothing leaked).

Prints a table, then one JSON line. Never asserts; exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

TARGET_TTFT = 10.0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def make_llm(loaded, model_cfg, num_blocks: int, sharing: bool, args):
    from streamchat.config import CacheConfig, Config
    from streamchat.llm import LLM

    cache = CacheConfig(num_blocks=num_blocks, prefix_sharing=sharing, kv_dtype=args.kv_dtype,
                        **({"window_tokens": args.window_tokens} if args.window_tokens else {}))
    llm = LLM(Config(model=model_cfg, cache=cache), loaded=loaded)
    common.disable_eos(llm.engine)
    return llm


def one_token(llm, sid: str, system: str, question: str) -> tuple[float, dict]:
    """Open a session, add a question, run a one-token response; (wall seconds, usage)."""
    eng = llm.engine
    start = time.perf_counter()
    eng.open_session(sid, system)
    eng.add_item(sid, "user", question)
    [reply] = llm.respond([sid], max_tokens=1)
    common.sync(llm.loaded.model.device)
    elapsed = time.perf_counter() - start
    llm.drain()  # the reply's end-of-turn tokens, so the next measurement starts from an idle engine
    return elapsed, reply.usage


def prompt_blocks(llm, sid: str, num_full: int) -> list[int]:
    return list(llm.engine.sessions[sid].seq.block_ids[:num_full])


def bench_ttft(llm, prompt: str, args) -> dict:
    eng = llm.engine
    bs = llm.config.cache.block_size
    one_token(llm, "warm-up", "(warm-up) " + prompt, "Hello!")
    eng.close_session("warm-up")
    cold, warm, cold_engine, warm_engine, cached, refs = [], [], [], [], [], Counter()
    for k in range(args.repeats):
        system = f"({k}) {prompt}"
        full = len(eng._system_tokens(system)) // bs
        t, u = one_token(llm, f"cold-{k}", system, common.PROMPTS[0])
        cold.append(t)
        cold_engine.append(u.ttft_ms)
        t, u = one_token(llm, f"shared-{k}", system, common.PROMPTS[1])
        warm.append(t)
        warm_engine.append(u.ttft_ms)
        cached.append(u.cached_tokens)
        refs.update(eng.pool.ref_counts[b] for b in prompt_blocks(llm, f"cold-{k}", full))
        eng.close_session(f"cold-{k}")
        eng.close_session(f"shared-{k}")
        print(f"  repeat {k}: cold {cold[-1]:.3f} s, shared {warm[-1]:.3f} s", file=sys.stderr, flush=True)
    c, w = common.median(cold), common.median(warm)
    return {"cold_ms": common.ms(c), "shared_ms": common.ms(w), "ratio": common.ratio(c, w),
            "cold_engine_ttft_ms": common.median(cold_engine), "shared_engine_ttft_ms": common.median(warm_engine),
            "shared_cached_tokens": common.median(cached),
            "prompt_block_ref_counts": {str(k): v for k, v in sorted(refs.items())}}


def bench_kv(loaded, model_cfg, prompt: str, sharing: bool, args) -> dict:
    from streamchat.config import CacheConfig

    bs = CacheConfig().block_size
    n = args.sessions
    # every session unshared, with its reply, plus slack: nothing is ever dropped for room
    per_session = blocks_for(args.prompt_tokens + 64 + args.tokens + 16, bs) + 2
    probe = CacheConfig(**({"window_tokens": args.window_tokens} if args.window_tokens else {}))
    num_blocks = max(n * per_session, probe.max_blocks_per_session(args.prompt_tokens + 64)) + 32
    llm = make_llm(loaded, model_cfg, num_blocks, sharing, args)
    eng, pool = llm.engine, llm.engine.pool
    system_tokens = len(eng._system_tokens(prompt))
    full = system_tokens // bs
    sids = [f"kv-{i}" for i in range(n)]
    start = time.perf_counter()
    groups = [sids] if args.burst else [sids[:1], sids[1:]]
    for group in filter(None, groups):
        for sid in group:
            eng.open_session(sid, prompt)
            eng.add_item(sid, "user", common.PROMPTS[int(sid.split("-")[1]) % len(common.PROMPTS)])
        llm.respond(group, max_tokens=args.tokens)
        llm.drain()  # each reply's end-of-turn tokens: every session ends in the same state
    setup_s = time.perf_counter() - start
    used = pool.num_used
    tables = [eng.sessions[sid].seq.block_ids for sid in sids]
    prompt_copies = len({b for t in tables for b in t[:full]}) / full if full else None
    refs = Counter(pool.ref_counts[b] for b in tables[0][:full])
    stats = [eng.session_stats(sid) for sid in sids]
    row = {
        "sharing": sharing, "sessions": n, "system_tokens": system_tokens, "prompt_full_blocks": full,
        "pool_blocks": pool.num_usable, "used_blocks": used, "used_bytes": used * llm.runner.bytes_per_block,
        "shared_blocks": sum(1 for c in pool.ref_counts if c > 1),
        "sum_session_kv_bytes": sum(s.kv_bytes for s in stats),
        "blocks_per_session": common.median(len(t) for t in tables),
        "prompt_copies": prompt_copies,
        "prompt_block_ref_counts": {str(k): v for k, v in sorted(refs.items())},
        "setup_s": setup_s,
    }
    for sid in sids:
        eng.close_session(sid)
    row["used_blocks_after_close"] = pool.num_used
    eng.check()
    bpb = llm.runner.bytes_per_block
    print(f"  {'shared' if sharing else 'not shared'}: {used} blocks used ({setup_s:.1f} s)",
          file=sys.stderr, flush=True)
    del llm, eng, pool
    gc.collect()
    return row | {"bytes_per_block": bpb}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2000, help="system prompt length (default 2000)")
    p.add_argument("--sessions", type=int, default=32, help="sessions in the KV-bytes part (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="cold/shared TTFT pairs; medians (default 3)")
    p.add_argument("--tokens", type=int, default=8, help="reply tokens per session in the KV part (default 8)")
    p.add_argument("--burst", action="store_true", help="KV part: all sessions arrive at once")
    p.add_argument("--window-tokens", type=int, default=0, help="default: CacheConfig's")
    p.add_argument("--kv-dtype", default="auto", help="KV pool storage: auto (the model's dtype), int8, fp8, int4")
    p.add_argument("--skip-unshared", action="store_true", help="KV part: only the shared pool")
    common.add_model_flags(p)
    args = p.parse_args(argv)
    if min(args.prompt_tokens, args.sessions, args.repeats, args.tokens) <= 0:
        p.error("--prompt-tokens, --sessions, --repeats and --tokens must be positive")

    from streamchat.model.runner import load_model

    model_cfg = common.model_config(args)
    loaded = load_model(model_cfg)
    print(common.describe(loaded), file=sys.stderr, flush=True)
    prompt = common.botchan_prefix(loaded.tokenizer, args.prompt_tokens)

    from streamchat.config import CacheConfig

    bs = CacheConfig().block_size
    per = blocks_for(args.prompt_tokens + 64, bs) + 4
    probe = CacheConfig(**({"window_tokens": args.window_tokens} if args.window_tokens else {}))
    llm = make_llm(loaded, model_cfg, max(4 * per, probe.max_blocks_per_session(args.prompt_tokens + 64)) + 32,
                   True, args)
    ttft = bench_ttft(llm, prompt, args)
    del llm
    gc.collect()
    kv = [bench_kv(loaded, model_cfg, prompt, True, args)]
    if not args.skip_unshared:
        kv.append(bench_kv(loaded, model_cfg, prompt, False, args))
    shared = kv[0]
    unshared = kv[1] if len(kv) > 1 else None
    saved = common.ratio(unshared and unshared["used_bytes"], shared["used_bytes"])

    print(f"{common.describe(loaded)}; system prompt {shared['system_tokens']} tokens "
          f"({shared['prompt_full_blocks']} full blocks of {bs})")
    print(f"{'time to first token':36}{'wall ms':>10}{'engine ms':>11}")
    print(f"{'cold (prompt not in the pool)':36}{common.fmt(ttft['cold_ms'])}"
          f"{common.fmt(ttft['cold_engine_ttft_ms'], 11)}")
    print(f"{'shared (second session, same prompt)':36}{common.fmt(ttft['shared_ms'])}"
          f"{common.fmt(ttft['shared_engine_ttft_ms'], 11)}   ratio {common.fmt(ttft['ratio'], 0, 1)}x "
          f"(target >= {TARGET_TTFT:g}); cached tokens {ttft['shared_cached_tokens']}; "
          f"prompt block ref counts {ttft['prompt_block_ref_counts']}")
    print(f"{f'{args.sessions} sessions, same prompt':36}{'used blk':>10}{'MiB':>9}{'sum kv MiB':>12}"
          f"{'blk/sess':>10}{'copies':>8}{'after close':>13}   prompt block ref counts")
    for r in kv:
        print(f"{'prefix sharing ' + ('on' if r['sharing'] else 'off'):36}{r['used_blocks']:>10d}"
              f"{r['used_bytes'] / 2**20:>9.1f}{r['sum_session_kv_bytes'] / 2**20:>12.1f}"
              f"{common.fmt(r['blocks_per_session'], 10, 0)}{common.fmt(r['prompt_copies'], 8, 2)}"
              f"{r['used_blocks_after_close']:>13d}   {r['prompt_block_ref_counts']}")
    if saved:
        print(f"KV bytes not shared / shared: {saved:.2f}x (prompt copies with sharing: "
              f"{common.fmt(shared['prompt_copies'], 0, 2)}, target 1)")
    print(json.dumps(common.rounded({
        "bench": "prefix", "model": loaded.source.name, "dtype": str(loaded.model.dtype),
        "device": str(loaded.model.device), "kv_dtype": args.kv_dtype, "prompt_tokens": args.prompt_tokens,
        "burst": args.burst,
        "ttft": ttft, "kv": kv, "ttft_cold_over_shared": ttft["ratio"], "kv_bytes_unshared_over_shared": saved,
        "prompt_copies_shared": shared["prompt_copies"],
        "prompt_counted_once": shared["prompt_copies"] == 1.0 if shared["prompt_copies"] is not None else None,
        "targets": {"ttft_cold_over_shared": TARGET_TTFT, "prompt_copies_shared": 1}})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
