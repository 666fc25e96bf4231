"""`streamchat eval`: perplexity of the model over a long text under each cache policy.

Owns the text (the shipped *Botchan* by default), the command line, checking
its inputs before the model loads, and the report (a table, or one JSON
object per line). How each policy feeds the model lives in
`streamchat.evaluate_policies`. One result per (weights, kv_dtype, policy):
a new KV storage format only has to join `config.KV_DTYPES` and the runner's
pool, a new weight format `config.WEIGHTS` and `model.weights`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from streamchat.config import KV_DTYPES, WEIGHTS, ConfigError
from streamchat.text.corpus import DEFAULT_TEXT, read_text, tokenize  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

POLICIES = ("full", "window", "sink", "h2o", "recompute")  # = evaluate_policies.POLICIES, torch-free here


@dataclass
class EvalResult:
    """One (weights, kv_dtype, policy): mean NLL over `tokens` predicted tokens.

    `sample_*` is the same policy scored only on the recompute oracle's
    strided sample (present when `recompute` ran too): the like-for-like
    comparison with the oracle.
    """

    policy: str
    kv_dtype: str
    sink_tokens: int
    window_tokens: int | None  # None: `full` keeps everything
    block_size: int
    tokens: int
    nll: float
    seconds: float
    stride: int | None = None
    sample_tokens: int | None = None
    sample_nll: float | None = None
    note: str | None = None
    weights: str = "bf16"  # the served weight format (`auto` resolved)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def to_json(self) -> dict:
        out = {"policy": self.policy, "weights": self.weights, "kv_dtype": self.kv_dtype,
               "sink_tokens": self.sink_tokens,
               "window_tokens": self.window_tokens, "block_size": self.block_size, "tokens": self.tokens,
               "nll": self.nll, "ppl": self.ppl, "seconds": round(self.seconds, 3)}
        if self.stride is not None:
            out["stride"] = self.stride
        if self.sample_nll is not None:
            out.update(sample_tokens=self.sample_tokens, sample_nll=self.sample_nll,
                       sample_ppl=math.exp(self.sample_nll))
        if self.note:
            out["note"] = self.note
        return out


def check_args(args, default_weights: str = "bf16") -> tuple[list[str], list[str], list[str]]:
    """Validate sizes and names before anything heavy loads; (policies, kv_dtypes, weights)."""
    for flag in ("sink_tokens", "window_tokens", "block_size", "tokens", "recompute_stride"):
        value = getattr(args, flag)
        if value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.tokens < 2:
        raise ConfigError(f"--tokens must be at least 2 (one to read, one to predict), got {args.tokens}")
    if args.block_size & (args.block_size - 1):
        raise ConfigError(f"--block-size must be a power of two, got {args.block_size}")
    if args.window_tokens < 2 * args.block_size:
        raise ConfigError(f"--window-tokens ({args.window_tokens}) must hold at least two blocks "
                          f"of {args.block_size} tokens")
    if not 0 <= args.h2o_recent_tokens <= args.window_tokens - 2 * args.block_size:
        raise ConfigError(f"--h2o-recent-tokens must be in [0, window_tokens - 2 * block_size] "
                          f"(= {args.window_tokens - 2 * args.block_size}), got {args.h2o_recent_tokens}")
    if not 0 < args.h2o_decay <= 1:
        raise ConfigError(f"--h2o-decay must be in (0, 1], got {args.h2o_decay}")
    policies = _names(args.policies, POLICIES, "--policy") or list(POLICIES)
    kv_dtypes = _names(args.kv_dtypes, KV_DTYPES, "--kv-dtype") or ["auto"]
    weights = _names(args.weights, WEIGHTS, "--weights") or [default_weights]
    return policies, kv_dtypes, weights


def _names(values: list[str] | None, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for v in values or [] for n in v.split(",") if n.strip()]
    for n in names:
        if n not in known:
            raise ConfigError(f"{flag}: unknown {n!r}; choose from {', '.join(known)}")
    return list(dict.fromkeys(names))  # repeated names run once


def evaluate(loaded, token_ids: list[int], spec, policies: list[str], kv_dtypes: list[str],
             progress: bool = False) -> Iterator[EvalResult]:
    """One EvalResult per (kv_dtype, policy), in that order, as each finishes."""
    import dataclasses

    from tqdm import tqdm

    from streamchat import evaluate_policies as ep

    sample = ep.recompute_targets(len(token_ids), spec.recompute_stride) if "recompute" in policies else None
    for kv_dtype in kv_dtypes:
        kv_spec = dataclasses.replace(spec, kv_dtype=kv_dtype)
        for policy in policies:
            total = ep.work_units(loaded, policy, len(token_ids), kv_spec)
            with tqdm(total=total, desc=f"{policy} ({kv_dtype})", unit="tok", leave=False,
                      disable=not progress, file=sys.stderr) as bar:
                scored = ep.run_policy(loaded, policy, token_ids, kv_spec, bar)
            yield _result(policy, kv_spec, scored, sample, loaded.weights)


def _result(policy: str, spec, scored, sample, weights: str) -> EvalResult:
    r = EvalResult(policy, spec.kv_dtype, spec.sink_tokens if policy in ("sink", "h2o") else 0,
                   None if policy == "full" else spec.window_tokens, spec.block_size,
                   len(scored.nll), float(scored.nll.double().mean()), scored.seconds, note=scored.note,
                   weights=weights)
    if policy == "recompute":
        r.stride = spec.recompute_stride
    elif sample is not None:
        picked = scored.nll[sample[sample < len(scored.nll)]]
        r.sample_tokens, r.sample_nll = len(picked), float(picked.double().mean())
    return r


def format_row(r: EvalResult) -> str:
    window = "-" if r.window_tokens is None else str(r.window_tokens)
    sample = "" if r.sample_nll is None else f"{math.exp(r.sample_nll):.3f}"
    return (f"{r.policy:<10} {r.weights:<7} {r.kv_dtype:<8} {r.sink_tokens:>5} {window:>7} {r.tokens:>7} "
            f"{r.nll:>8.4f} {r.ppl:>10.3f} {sample:>11} {r.seconds:>9.1f}  {r.note or ''}").rstrip()


HEADER = (f"{'policy':<10} {'weights':<7} {'kv_dtype':<8} {'sink':>5} {'window':>7} {'tokens':>7} "
          f"{'nll':>8} {'ppl':>10} {'sample_ppl':>11} {'seconds':>9}  note")


def add_parser(subparsers) -> None:
    """Register `streamchat eval`."""
    from streamchat import settings

    p = subparsers.add_parser("eval", help="perplexity over a long text under each KV cache policy",
                              description="Streaming perplexity (StreamingLLM-style) under the policies "
                                          "full, window, sink, h2o and recompute.")
    p.add_argument("text_file", nargs="?", default=None,
                   help="UTF-8 text to evaluate (default: the shipped Botchan, Project Gutenberg #8868)")
    p.add_argument("--sink-tokens", type=int, default=4, help="sink tokens, rounded up to blocks (default 4)")
    p.add_argument("--window-tokens", type=int, default=1024, help="window tokens (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--tokens", type=int, default=4096, help="evaluate the first N tokens of the text "
                                                            "(default 4096)")
    p.add_argument("--policy", action="append", dest="policies", metavar="POLICY",
                   help=f"repeatable (or comma-separated): {', '.join(POLICIES)} (default: all)")
    p.add_argument("--kv-dtype", action="append", dest="kv_dtypes", metavar="KV_DTYPE",
                   help=f"KV storage, repeatable: {', '.join(KV_DTYPES)} (default auto)")
    p.add_argument("--weights", action="append", dest="weights", metavar="WEIGHTS",
                   help=f"weight format, repeatable: {', '.join(WEIGHTS)} (default: the model setting, bf16; "
                        "auto reports the format it chose)")
    p.add_argument("--recompute-stride", type=int, default=61,
                   help="the oracle scores every Nth token only (default 61)")
    p.add_argument("--h2o-recent-tokens", type=int, default=256,
                   help="h2o: recent tokens never evicted, rounded up to blocks (default 256)")
    p.add_argument("--h2o-decay", type=float, default=1.0,
                   help="h2o: older attention mass decays by this per query token (default 1: plain sum)")
    p.add_argument("--json", action="store_true", help="one JSON object per line per result")
    settings.add_flags(p, ("model",), skip=("weights",))
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args) -> int:
    import dataclasses

    from streamchat import settings
    from streamchat.evaluate_policies import EvalSpec
    from streamchat.autotune import measure_weights
    from streamchat.model.runner import load_model

    config = settings.load(args)
    policies, kv_dtypes, weights = check_args(args, config.model.weights)
    text = read_text(args.text_file)
    spec = EvalSpec(args.sink_tokens, args.window_tokens, args.block_size, args.recompute_stride,
                    h2o_recent_tokens=args.h2o_recent_tokens, h2o_decay=args.h2o_decay)
    for i, fmt in enumerate(weights):  # one model at a time
        loaded = load_model(dataclasses.replace(config.model, weights=fmt), measure=measure_weights)
        token_ids = tokenize(loaded.tokenizer, text, args.tokens)
        if i == 0 and not args.json:
            print(f"{loaded.source.name} ({loaded.model.dtype}), {len(token_ids)} tokens of "
                  f"{args.text_file or DEFAULT_TEXT.name}; sink region {-(-spec.sink_tokens // spec.block_size)} "
                  f"block(s) of {spec.block_size}", flush=True)
            print(HEADER, flush=True)
        for r in evaluate(loaded, token_ids, spec, policies, kv_dtypes, progress=sys.stderr.isatty()):
            print(json.dumps(r.to_json()) if args.json else format_row(r), flush=True)
    return 0
