"""Serving throughput and latency through the engine's asyncio face, against transformers, in one process.

    python bench/serve.py                                    # the issue's sizes
    python bench/serve.py --llama-server "$(../shared/tools/build-llama-server.sh)"   # and the peer
    python bench/serve.py --sessions 1,2 --tokens 8 --hf-sessions 2 --append-tokens 300 \\
        --mixed-tokens 24 --repeats 1                         # a smoke run

1. Concurrency sweep. For each N in --sessions, N chat sessions run at once
   through a `CoreClient` whose engine core runs in a thread of this process (the
   daemon's core loop and messages, without a second model load): each session is an
   asyncio task that opens a session, adds a user item, starts a greedy
   response of its length (see --lengths) (`engine.call(...)` per request), opens the
   response's stream and consumes it, stamping each `TextDelta` on arrival
   (client side, `time.perf_counter`). Figures: aggregate output tokens/s
   (all output tokens / wall time from the first open to the last finish,
   prefill included), time to first token (open -> first delta) p50/p99,
   inter-token latency (gaps between consecutive deltas) p50/p99. Latency
   samples are pooled over --repeats runs; tokens/s is their median.
2. transformers `generate` on the same weights and dtype, same device, same
   prompt tokens (our chat framing), greedy, `min_new_tokens = max_new_tokens`:
   --hf-sessions prompts one after another, and as one left-padded batch.
   EOS is switched off on our side for the whole run, so both sides produce
   exactly the asked number of tokens per response (greedy replies of this
   model repeat themselves past 512 tokens without an EOS, so "natural"
   lengths would all be the cap).
   Two kinds of work (--lengths): `fixed`, one round, every response
   --tokens long (the padded batch's best case: no row waits); `spread`,
   --rounds requests per client, back to back, lengths spread evenly from
   --tokens/4 to 7/4 --tokens (same mean) and shuffled, as chat replies
   differ. transformers serves round r as its r-th padded batch, which runs
   to its longest reply (only the tokens asked for are counted); the engine
   starts a client's next request as soon as its reply ends.
   Ratios per kind: ours@16 / transformers sequential (target >= 8),
   ours@16 / transformers padded batch (target >= 1.5). (The ratio uses ours
   at the largest --sessions value not above --hf-sessions.)
3. Mixed load. Session A streams a response of --mixed-tokens tokens; after
   its --mixed-warmup-th delta, session B appends --append-tokens tokens of
   Botchan (streamchat/data/botchan.txt) with one `append_text` call. A's
   inter-token latency over the whole stream, p50 and p99, and p99/p50
   (target <= 3); also split into before / during the append (until B's
   append is fully in the cache, reported through its ticket).

Prints a table, then one JSON line. Never asserts; exits 0. Not a test:
numbers depend on the machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.passive_omp()  # as the daemon does, before torch starts

import argparse  # noqa: E402
import asyncio  # noqa: E402
import itertools  # noqa: E402
import random  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

TARGET_SEQUENTIAL = 8.0
TARGET_PADDED = 1.5
TARGET_MIXED = 3.0
TARGET_LLAMA_16 = 1.0

_ids = itertools.count()


@dataclass
class Stream:
    """What one client saw of one response."""

    started: float  # before the session was opened
    deltas: list[float] = field(default_factory=list)  # arrival time of each TextDelta
    tokens: int = 0
    status: str = ""
    reason: str | None = None
    engine_ttft_ms: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.deltas[0] - self.started if self.deltas else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.deltas, self.deltas[1:])]


async def consume(stream: asyncio.Queue, out: Stream, on_delta=None) -> None:
    from streamchat.engine.events import ResponseFinished, TextDelta

    while True:
        ev = await stream.get()
        if isinstance(ev, TextDelta):
            out.deltas.append(time.perf_counter())
            if on_delta is not None:
                on_delta(len(out.deltas))
        elif isinstance(ev, ResponseFinished):
            out.tokens = len(ev.token_ids)
            out.status, out.reason = ev.status, ev.reason
            out.engine_ttft_ms = ev.usage.ttft_ms
            return


async def chat_session(aeng, prompt: str, tokens: int, on_delta=None, keep_open: bool = False) -> Stream:
    """Open, add a user item, start a greedy response, read its stream, close."""
    from streamchat.engine import api
    from streamchat.model.sampling import SamplingParams

    n = next(_ids)
    sid, rid = f"bench-s{n}", f"bench-r{n}"
    out = Stream(time.perf_counter())
    await aeng.submit(api.OpenSession(sid, tuple(aeng.tokenizer.chat.system_prefix(""))))
    await queue(aeng, sid, aeng.tokenizer.chat.message("user", prompt))
    stream = aeng.open_stream(rid, sid)
    try:
        await aeng.submit(api.StartResponse(sid, rid, SamplingParams(), tokens))
        await consume(stream, out, on_delta)
    finally:
        aeng.close_stream(rid)
    if not keep_open:
        await aeng.submit(api.CloseSession(sid))
    return out


async def queue(aeng, sid: str, tokens: list[int], kind: str = "item", opens: bool = False,
                ticket: int | None = None) -> int:
    """Admit tokens, then queue them, as the daemon does (minus the store); their count."""
    from streamchat.engine import api

    await aeng.submit(api.CheckRoom(sid, len(tokens)))
    await aeng.submit(api.Queue(sid, tuple(tokens), kind, opens_item=opens, ticket=ticket))
    return len(tokens)


async def sweep_point(aeng, work: list[tuple[str, int]], clients: int) -> tuple[float, list[Stream]]:
    """`clients` concurrent clients serve `work` (prompt, length): client i takes i, i+N, ...

    Closed loop: a client sends its next request as soon as its reply ends.
    """
    async def client(i: int) -> list[Stream]:
        return [await chat_session(aeng, p, n) for p, n in work[i::clients]]

    start = time.perf_counter()
    per_client = await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - start
    streams = [s for got in per_client for s in got]
    return sum(s.tokens for s in streams) / wall, streams


async def mixed(aeng, prompt: str, append_text: str, tokens: int, warmup: int) -> dict:
    """A streams; B appends a long text in one call once A has produced `warmup` deltas."""
    from streamchat.engine import api

    loop = asyncio.get_running_loop()
    sid_b = f"bench-append{next(_ids)}"
    chat = aeng.tokenizer.chat
    await aeng.submit(api.OpenSession(sid_b, tuple(chat.system_prefix(""))))
    await queue(aeng, sid_b, chat.message("user", "Here is a book, in parts."))
    go = asyncio.Event()
    times: dict[str, float] = {}

    def on_delta(count: int) -> None:
        if count == warmup:
            go.set()

    async def appender() -> int:
        await go.wait()
        ticket, done = aeng.new_ticket()
        times["append_start"] = time.perf_counter()
        tokens = chat.open_message("user") + chat.encode(append_text)
        added = await queue(aeng, sid_b, tokens, "append", opens=True, ticket=ticket)
        await done
        times["append_done"] = time.perf_counter()
        return added

    task_b = asyncio.create_task(appender())
    a = await chat_session(aeng, prompt, tokens, on_delta)
    if not go.is_set():  # A finished before the warm-up count: append anyway, say so
        go.set()
    added = await task_b
    await aeng.submit(api.CloseSession(sid_b))
    t0, t1 = times["append_start"], times["append_done"]
    gaps = list(zip(a.deltas[1:], a.gaps))  # (arrival, gap) pairs
    before = [g for t, g in gaps if t <= t0]
    during = [g for t, g in gaps if t0 < t <= t1]
    after = [g for t, g in gaps if t > t1]
    p50, p99 = common.percentile(a.gaps, 50), common.percentile(a.gaps, 99)
    return {
        "append_tokens": added, "append_s": t1 - t0, "stream_tokens": a.tokens, "stream_deltas": len(a.deltas),
        "deltas_during_append": len(during), "stream_outlived_append": bool(after),
        "itl_p50_ms": common.ms(p50), "itl_p99_ms": common.ms(p99),
        "itl_max_ms": common.ms(max(a.gaps) if a.gaps else None),
        "p99_over_p50": common.ratio(p99, p50),
        "before_p50_ms": common.ms(common.percentile(before, 50)),
        "during_p50_ms": common.ms(common.percentile(during, 50)),
        "during_p99_ms": common.ms(common.percentile(during, 99)),
        "after_p50_ms": common.ms(common.percentile(after, 50)),
        # how much the append costs the stream against its unloaded pace
        "during_p99_over_before_p50": common.ratio(common.percentile(during, 99), common.percentile(before, 50)),
    }


async def run_ours(llm, args) -> tuple[list[dict], dict | None]:
    from streamchat.engine.core_client import CoreClient

    if args.num_threads_engine:
        import torch

        torch.set_num_threads(args.num_threads_engine)
    aeng = CoreClient(llm.config, engine=llm.engine)
    await aeng.start()
    try:
        await sweep_point(aeng, [(common.PROMPTS[0], 4), (common.PROMPTS[1], 4)], 2)  # warm-up
        rows = []
        for mode, n in itertools.product(args.lengths, args.sessions):
            work = make_work(mode, n, args)
            rates, streams = [], []
            for _ in range(args.repeats):
                rate, got = await sweep_point(aeng, work, n)
                rates.append(rate)
                streams += got
            ttfts = [s.ttft for s in streams if s.ttft is not None]
            gaps = [g for s in streams for g in s.gaps]
            statuses = sorted({f"{s.status}:{s.reason}" for s in streams})
            rows.append({
                "lengths": mode, "sessions": n, "tok_s": common.median(rates),
                "ttft_p50_ms": common.ms(common.percentile(ttfts, 50)),
                "ttft_p99_ms": common.ms(common.percentile(ttfts, 99)),
                "itl_p50_ms": common.ms(common.percentile(gaps, 50)),
                "itl_p99_ms": common.ms(common.percentile(gaps, 99)),
                "tokens_per_response": common.median([s.tokens for s in streams]),
                "statuses": statuses,
            })
            print(f"  ours {n:>3} sessions, {mode} lengths: {rows[-1]['tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        mix = None
        if args.append_tokens:
            text = common.botchan_prefix(llm.tokenizer, args.append_tokens)
            mix = await mixed(aeng, common.PROMPTS[0], text, args.mixed_tokens, args.mixed_warmup)
        return rows, mix
    finally:
        await aeng.stop()
        await aeng.aclose()


def timed(fn, device) -> float:
    common.sync(device)
    start = time.perf_counter()
    tokens = fn()
    common.sync(device)
    return tokens / (time.perf_counter() - start)


def make_work(mode: str, clients: int, args) -> list[tuple[str, int]]:
    """The requests of one sweep point, (prompt, response length), in the order they are served.

    fixed: one round, every response --tokens long. spread: --rounds rounds;
    lengths spread around --tokens (same mean), shuffled with a fixed seed.
    Request j goes to client j % clients, so round r is requests
    r*clients .. (r+1)*clients-1: the padded batch of transformers gets
    exactly these as its r-th batch.
    """
    rounds = 1 if mode == "fixed" else args.rounds
    num = clients * rounds
    if mode == "fixed":
        lengths = [args.tokens] * num
    else:
        lengths = common.spread_lengths(num, args.tokens)
        random.Random(0).shuffle(lengths)
    return [(common.PROMPTS[j % len(common.PROMPTS)], lengths[j]) for j in range(num)]


def run_transformers(llm, args) -> list[dict]:
    hf = common.load_transformers(llm.loaded)
    device = llm.loaded.model.device
    n = args.hf_sessions
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    warm = common.chat_inputs(llm.engine.chat, common.PROMPTS[:2])
    common.hf_sequential(hf, warm[:1], 4)  # warm-up
    common.hf_padded(hf, warm, 4, pad)
    out = []
    for mode in args.lengths:
        work = make_work(mode, n, args)
        inputs = common.chat_inputs(llm.engine.chat, [p for p, _ in work])
        lengths = [t for _, t in work]
        seq = timed(lambda: common.hf_sequential(hf, inputs, lengths), device)  # once: it is the slow one
        print(f"  transformers {n} sequential, {mode} lengths: {seq:.1f} tok/s", file=sys.stderr, flush=True)
        padded = common.median(timed(lambda: batches(hf, inputs, lengths, n, pad), device)
                                for _ in range(args.repeats))
        print(f"  transformers {n} padded, {mode} lengths: {padded:.1f} tok/s", file=sys.stderr, flush=True)
        out.append({"lengths": mode, "sessions": n, "sequential_tok_s": seq, "padded_tok_s": padded})
    return out


def run_llama(args, threads: int) -> list[dict]:
    """llama-server on the same prompts and fixed lengths, N streams on N slots, per swept N."""
    from peers import llama_rates

    out = []
    for n in args.sessions:
        prompts = [p for p, _ in make_work("fixed", n, args)]
        rounds = llama_rates(args.llama_server, prompts, args.tokens, threads=threads, repeats=args.repeats)
        ttfts = [t for r in rounds for t in r["ttft_s"]]
        out.append({"sessions": n, "tok_s": common.median([r["tok_s"] for r in rounds]),
                    "ttft_p50_ms": common.ms(common.percentile(ttfts, 50))})
        print(f"  llama-server {n:>3} slots, fixed lengths: {out[-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def batches(hf, inputs: list[list[int]], lengths: list[int], size: int, pad: int) -> int:
    """The work as consecutive padded batches of `size` (one per round); tokens asked for."""
    return sum(common.hf_padded(hf, inputs[i:i + size], lengths[i:i + size], pad)
               for i in range(0, len(inputs), size))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=common.int_list, default=[1, 4, 16, 32],
                   help="concurrent sessions, comma-separated (default 1,4,16,32)")
    p.add_argument("--tokens", type=int, default=64,
                   help="output tokens per response, the mean of them with spread lengths (default 64)")
    p.add_argument("--lengths", type=lambda t: t.split(","), default=["fixed", "spread"],
                   help="response lengths, comma-separated: fixed (all --tokens long), spread (evenly from "
                        "--tokens/4 to 7*--tokens/4, as chat replies differ); default both")
    p.add_argument("--rounds", type=int, default=3,
                   help="requests per client with spread lengths, sent back to back (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="runs per sweep point; tokens/s is their median")
    p.add_argument("--llama-server", help="path of llama.cpp's llama-server binary: the peer serves the fixed "
                   "lengths at each --sessions on as many slots (spread lengths are ours and transformers' only)")
    p.add_argument("--hf-sessions", type=int, default=16,
                   help="prompts for the transformers baselines; 0 skips them (default 16)")
    p.add_argument("--append-tokens", type=int, default=10_000,
                   help="tokens session B appends in one call in the mixed case; 0 skips it (default 10000)")
    p.add_argument("--mixed-tokens", type=int, default=256, help="session A's response length in the mixed case")
    p.add_argument("--mixed-warmup", type=int, default=16, help="A's deltas before B appends")
    p.add_argument("--kv-memory-gib", type=float, default=0.0, help="KV pool size (default 0: the daemon's auto)")
    p.add_argument("--kv-dtype", default="auto", help="KV pool storage: auto (the model's dtype), int8, fp8, int4")
    p.add_argument("--max-tokens-per-step", type=int, default=None, help="default: SchedulerConfig's")
    p.add_argument("--target-step-ms", type=float, default=None, help="default: SchedulerConfig's")
    common.add_model_flags(p)
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.repeats <= 0 or args.rounds <= 0 or args.mixed_tokens <= 1:
        p.error("--tokens, --repeats, --rounds must be positive and --mixed-tokens > 1")
    if not args.lengths or set(args.lengths) - {"fixed", "spread"}:
        p.error("--lengths takes fixed, spread or both (comma-separated)")
    args.mixed_warmup = max(1, min(args.mixed_warmup, args.mixed_tokens - 1))

    import torch

    from streamchat.config import CacheConfig, Config, SchedulerConfig
    from streamchat.llm import LLM

    model_cfg = common.model_config(args)
    sched = SchedulerConfig(**{k: v for k, v in (("max_tokens_per_step", args.max_tokens_per_step),
                                                 ("target_step_ms",
                                                  args.target_step_ms)) if v})
    cache = CacheConfig(kv_memory_gib=args.kv_memory_gib, kv_dtype=args.kv_dtype)
    llm = LLM(Config(model=model_cfg, cache=cache, scheduler=sched))
    args.num_threads_engine = model_cfg.num_threads
    common.disable_eos(llm.engine)
    print(common.describe(llm.loaded), file=sys.stderr, flush=True)

    rows, mix = asyncio.run(run_ours(llm, args))
    hf_rows = run_transformers(llm, args) if args.hf_sessions else []
    llama_rows = run_llama(args, torch.get_num_threads()) if args.llama_server else []

    # per lengths mode: ours at the largest swept N not above the transformers prompt count
    ratios: dict[str, dict] = {}
    for hf in hf_rows:
        under = [r for r in rows if r["lengths"] == hf["lengths"] and r["sessions"] <= hf["sessions"]]
        ref = max(under, key=lambda r: r["sessions"]) if under else None
        ratios[hf["lengths"]] = {
            "ours_sessions": ref and ref["sessions"],
            "ours_vs_hf_sequential": common.ratio(ref and ref["tok_s"], hf["sequential_tok_s"]),
            "ours_vs_hf_padded": common.ratio(ref and ref["tok_s"], hf["padded_tok_s"]),
        }

    print(f"{common.describe(llm.loaded)}; tokens={args.tokens} repeats={args.repeats} "
          f"max_tokens_per_step={llm.config.scheduler.max_tokens_per_step} "
          f"target_step_ms={llm.config.scheduler.target_step_ms:g}")
    print(f"{'':40}{'tok/s':>10}{'ttft p50':>10}{'ttft p99':>10}{'itl p50':>10}{'itl p99':>10}   (ms)")
    for r in rows:
        print(f"{'ours, ' + str(r['sessions']) + ' sessions, ' + r['lengths']:40}{common.fmt(r['tok_s'])}"
              f"{common.fmt(r['ttft_p50_ms'])}{common.fmt(r['ttft_p99_ms'])}"
              f"{common.fmt(r['itl_p50_ms'])}{common.fmt(r['itl_p99_ms'])}")
    for hf in hf_rows:
        n, mode, rt = hf["sessions"], hf["lengths"], ratios[hf["lengths"]]
        at = f"ours@{rt['ours_sessions']}" if rt["ours_sessions"] else "ours"
        print(f"{f'transformers, {n} sequential, {mode}':40}{common.fmt(hf['sequential_tok_s'])}"
              f"   {at} ratio {common.fmt(rt['ours_vs_hf_sequential'], 0, 2)}x (target >= {TARGET_SEQUENTIAL:g})")
        print(f"{f'transformers, {n} padded batch, {mode}':40}{common.fmt(hf['padded_tok_s'])}"
              f"   {at} ratio {common.fmt(rt['ours_vs_hf_padded'], 0, 2)}x (target >= {TARGET_PADDED:g})")
    for lr in llama_rows:
        ref = next((r for r in rows if r["lengths"] == "fixed" and r["sessions"] == lr["sessions"]), None)
        lr["ours_vs_llama"] = common.ratio(ref and ref["tok_s"], lr["tok_s"])
        target = f" (target >= {TARGET_LLAMA_16:g})" if lr["sessions"] == 16 else ""
        print(f"{'llama-server, ' + str(lr['sessions']) + ' slots, fixed':40}{common.fmt(lr['tok_s'])}"
              f"{common.fmt(lr['ttft_p50_ms'])}{'':30}   ours ratio {common.fmt(lr['ours_vs_llama'], 0, 2)}x{target}")
    if mix:
        print(f"mixed: A streams {mix['stream_tokens']} tokens while B appends {mix['append_tokens']} tokens "
              f"in one call ({mix['append_s']:.2f} s, {mix['deltas_during_append']} of A's deltas during it"
              f"{'' if mix['stream_outlived_append'] else '; A ended before the append was in'})")
        print(f"  A's inter-token latency p50 {common.fmt(mix['itl_p50_ms'], 0, 2)} ms, "
              f"p99 {common.fmt(mix['itl_p99_ms'], 0, 2)} ms, max {common.fmt(mix['itl_max_ms'], 0, 2)} ms, "
              f"p99/p50 {common.fmt(mix['p99_over_p50'], 0, 2)} (target <= {TARGET_MIXED:g}); "
              f"p50 before/during/after the append {common.fmt(mix['before_p50_ms'], 0, 2)} / "
              f"{common.fmt(mix['during_p50_ms'], 0, 2)} / {common.fmt(mix['after_p50_ms'], 0, 2)} ms, "
              f"during p99 {common.fmt(mix['during_p99_ms'], 0, 2)} ms "
              f"({common.fmt(mix['during_p99_over_before_p50'], 0, 2)}x the p50 before it)")
    print(json.dumps(common.rounded({
        "bench": "serve", "model": llm.loaded.source.name, "dtype": str(llm.loaded.model.dtype),
        "device": str(llm.loaded.model.device), "kv_dtype": args.kv_dtype, "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "repeats": args.repeats, "ours": rows, "transformers": hf_rows, "llama_server": llama_rows, "mixed": mix, "ratios": ratios,
        "mixed_p99_over_p50": mix and mix["p99_over_p50"],
        "targets": {"ours_vs_hf_sequential": TARGET_SEQUENTIAL, "ours_vs_hf_padded": TARGET_PADDED,
                    "mixed_p99_over_p50": TARGET_MIXED}})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
