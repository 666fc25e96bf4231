"""Resuming a long session: time to first token from memory, the host tier, disk, and the transcript.

    python bench/resume.py --num-threads 1                               # the issue's sizes
    python bench/resume.py --context-tokens 500 --window-tokens 1024 --repeats 1   # a smoke run

One session holds --context-tokens tokens of the shipped Botchan
(streamchat/data/botchan.txt) as one user item, plus a one-token reply. It
is then resumed four ways, each followed by a short question and a
one-token reply, through `LLM(..., tiers=True).engine` stepped in this
thread exactly as the daemon's engine thread steps it, and along the same
calls the daemon's `streamchat.session.resume` makes:

    memory      the session is resident: `prefetch` finds it on the device
    host        it was paged out to the host tier (`Scheduler.drop`): `prefetch` copies it back
    disk        it was saved (`checkpoint`) and closed, as after a restart: its file is read,
                checked (checksum, layout, transcript mark) and copied in (`restore_saved`)
    transcript  it was closed and is rebuilt from its transcript (`restore_session`): every
                token of the window is computed again

Before all but the first, the pool forgets every cached block, so nothing
comes back from the prefix cache: a restarted daemon's pool has none, and a
session paged out for room has lost its freed blocks to whoever needed them.

Reported per way: `resume ms` (bringing the KV back; for the transcript
only queueing it, the context's prefill happens before the first token),
`question ms` (the question's item and reply to their first token: the same
work every way, except the transcript's rebuild), and `TTFT ms`, their sum:
wall time from the start of the resume to the first token of the reply;
medians over --repeats (--transcript-repeats for the slow one); the saved
file's size; and transcript TTFT / disk TTFT (target >= 5 on CPU).

Prints a table, then one JSON line. Never asserts; exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from streamchat.engine import api  # noqa: E402

TARGET = 5.0
SID = "sess_" + "0" * 31 + "1"
MARK = "bench"
QUESTIONS = ["What happened next?", "Who is speaking?", "Where are they now?", "Why did he say that?"]


def make_llm(loaded, model_cfg, args, data_dir: str):
    from streamchat.config import CacheConfig, Config, TierConfig
    from streamchat.llm import LLM

    blocks = CacheConfig(window_tokens=args.window_tokens).max_blocks_per_session() + 16  # one session
    cache = CacheConfig(window_tokens=args.window_tokens, kv_dtype=args.kv_dtype, num_blocks=blocks)
    # the host tier holds the session whole (2 GiB > 8k tokens in float32)
    tiers = TierConfig(host_tier_gib=2.0, disk_tier_gib=16.0, data_dir=data_dir, checkpoint_idle_s=0)
    llm = LLM(Config(model=model_cfg, cache=cache, tiers=tiers), loaded=loaded, tiers=True)
    common.disable_eos(llm.engine)
    return llm


class Session:
    """The benchmarked session and its transcript, as the store would hold it."""

    def __init__(self, llm, text: str) -> None:
        self.llm, self.eng = llm, llm.engine
        self.messages: list[tuple[str, str, bool]] = []
        self.eng.open_session(SID, "")
        self.ask(text)

    def ask(self, question: str) -> float:
        """A user item and a one-token reply; seconds until the token (end-of-turn drained after)."""
        start = time.perf_counter()
        self.eng.add_item(SID, "user", question)
        [reply] = self.llm.respond([SID], max_tokens=1)
        common.sync(self.llm.loaded.model.device)
        elapsed = time.perf_counter() - start
        self.llm.drain()
        self.messages += [("user", question, True), ("assistant", reply.text, True)]
        return elapsed

    def resume(self, how: str, question: str) -> tuple[float, float]:
        """(resume seconds, TTFT seconds) for one way of bringing the session back."""
        eng = self.eng
        self._put_away(how)
        start = time.perf_counter()
        if how in ("memory", "host"):
            assert eng.handle(api.Prefetch(SID)) == ("device" if how == "memory" else "host")
        elif how == "disk":  # read inline: this engine's tiers read files on the caller's thread
            prefix = tuple(eng.chat.system_prefix(""))
            assert eng.handle(api.RestoreSaved(SID, prefix, MARK, False, len(self.messages))) is None
        else:
            eng.restore_session(SID, "", self.messages)
        common.sync(self.llm.loaded.model.device)
        resumed = time.perf_counter() - start
        return resumed, resumed + self.ask(question)

    def _put_away(self, how: str) -> None:
        eng = self.eng
        s = eng.sessions[SID]
        if how == "host":
            eng.placer.drop(s)
            assert s.residency == "host", s.residency
            forget_prefix_cache(eng.pool)
        elif how == "disk":
            assert eng.handle(api.Checkpoint(SID, MARK))
            eng.pager.flush()
            eng.close_session(SID, keep_saved=True)
            forget_prefix_cache(eng.pool)
        elif how == "transcript":
            eng.close_session(SID)
            forget_prefix_cache(eng.pool)


def forget_prefix_cache(pool) -> None:
    """As after a restart: no block of the closed session stays findable by hash."""
    taken = [pool.allocate() for _ in range(pool.num_free)]  # allocate() forgets a block's hash
    for block_id in reversed(taken):
        pool.free(block_id)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context-tokens", type=int, default=8000, help="tokens in the session (default 8000)")
    p.add_argument("--window-tokens", type=int, default=8192, help="must hold the context (default 8192)")
    p.add_argument("--repeats", type=int, default=3, help="resumes from memory, host, disk; medians (default 3)")
    p.add_argument("--transcript-repeats", type=int, default=1, help="rebuilds from the transcript (default 1)")
    p.add_argument("--kv-dtype", default="auto", help="KV pool storage: auto (the model's dtype), int8, fp8, int4")
    p.add_argument("--data-dir", default=None, help="where the file goes (default: a temporary directory)")
    common.add_model_flags(p)
    args = p.parse_args(argv)
    if min(args.context_tokens, args.repeats, args.transcript_repeats) <= 0:
        p.error("--context-tokens, --repeats and --transcript-repeats must be positive")
    if args.context_tokens + 64 > args.window_tokens:
        p.error("--window-tokens must hold the context plus the questions (context + 64)")

    from streamchat.model.runner import load_model

    model_cfg = common.model_config(args)
    loaded = load_model(model_cfg)
    print(common.describe(loaded), file=sys.stderr, flush=True)
    text = common.botchan_prefix(loaded.tokenizer, args.context_tokens)
    with tempfile.TemporaryDirectory(prefix="streamchat-resume-") as tmp:
        llm = make_llm(loaded, model_cfg, args, args.data_dir or tmp)
        start = time.perf_counter()
        session = Session(llm, text)
        setup_s = time.perf_counter() - start
        context = llm.engine.session_stats(SID).context_tokens
        print(f"  context of {context} tokens built in {setup_s:.1f} s", file=sys.stderr, flush=True)
        results, file_bytes = {}, None
        for how in ("memory", "host", "disk", "transcript"):
            runs = [session.resume(how, QUESTIONS[k % len(QUESTIONS)])
                    for k in range(args.transcript_repeats if how == "transcript" else args.repeats)]
            if how == "disk":
                file_bytes = llm.engine.pager.disk.path(SID).stat().st_size
            results[how] = {"resume_ms": common.ms(common.median(r[0] for r in runs)),
                            "question_ms": common.ms(common.median(r[1] - r[0] for r in runs)),
                            "ttft_ms": common.ms(common.median(r[1] for r in runs)), "runs": len(runs)}
            print(f"  {how}: {results[how]}", file=sys.stderr, flush=True)
        llm.engine.close_session(SID)
        llm.engine.check()
        llm.engine.pager.close()
    ratio = common.ratio(results["transcript"]["ttft_ms"], results["disk"]["ttft_ms"])
    print(f"{common.describe(loaded)}; a session of {context} tokens (window {args.window_tokens}), "
          f"kv dtype {args.kv_dtype}; saved file {file_bytes / 2**20:.1f} MiB")
    print(f"{'resumed from':14}{'resume ms':>11}{'question ms':>13}{'TTFT ms':>11}{'runs':>6}")
    for how, r in results.items():
        print(f"{how:14}{common.fmt(r['resume_ms'], 11)}{common.fmt(r['question_ms'], 13)}"
              f"{common.fmt(r['ttft_ms'], 11)}{r['runs']:>6d}")
    print(f"TTFT transcript / disk: {common.fmt(ratio, 0, 1)}x (target >= {TARGET:g})")
    print(json.dumps(common.rounded({
        "bench": "resume", "model": loaded.source.name, "dtype": str(loaded.model.dtype),
        "device": str(loaded.model.device), "kv_dtype": args.kv_dtype, "context_tokens": context,
        "window_tokens": args.window_tokens, "file_bytes": file_bytes, "setup_s": setup_s,
        "results": results, "ttft_transcript_over_disk": ratio, "target": TARGET})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
