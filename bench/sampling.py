"""One `sample` call over a 49,152-token vocabulary (SmolLM2's): a baseline sampler against this checkout's.

    python bench/sampling.py                          # baseline: the sampler before the fast path
    python bench/sampling.py --rows 1,16 --calls 40 --threads 2
    python bench/sampling.py --baseline main --mixes greedy,default

The baseline is `streamchat/model/sampling.py` as git holds it at
`--baseline` (default BASELINE, the last commit of the sort-based sampler),
loaded beside this checkout's under another module name; both take the
same SamplingParams. The two are timed alternately, call by call (A B A B),
so a shared machine's load falls on both alike.

The logits are synthetic and seeded, shaped like the bundled model's: a
Gaussian floor (sd 1.5) under a head of 400 tokens whose logits fall off as
1.5 log(rank), the head's top 12 to 22 above the floor, so that at the
default params (temperature 0.7, top_p 0.9) the nucleus holds 1 to ~20
tokens, as SmolLM2-135M's does on most steps. `default-flat` draws plain
N(0, 1) logits instead: the nucleus then holds tens of thousands of tokens
(the worst case). Penalized mixes get a history of 64 recent and 200
generated tokens per row. The baseline skips the mixes it cannot do
(logit_bias and logprobs are newer): n/a.

Prints, per mix and row count, the median wall time of one call divided by
the rows (ms per row) for both and their ratio (baseline / this), then one
JSON line of the medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.passive_omp()  # as the daemon does, before torch starts

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

from streamchat.model import sampling  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The last commit of the sampler that sorted the whole row for top-p and drew with multinomial.
BASELINE = "4f892c3"
VOCAB = 49152
DEFAULT = dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
# name -> (SamplingParams fields, with a history, flat logits, whether the baseline can do it)
MIXES = {
    "greedy": ({}, False, False, True),
    "greedy+penalty": ({"repetition_penalty": 1.1}, True, False, True),
    "default": (DEFAULT, True, False, True),
    "temperature": ({"temperature": 0.7}, False, False, True),
    "top_k": ({"temperature": 0.7, "top_k": 40}, False, False, True),
    "min_p": ({"temperature": 0.7, "min_p": 0.05}, False, False, True),
    "seeded": ({**DEFAULT, "seed": 1}, True, False, True),
    "freq+presence": ({**DEFAULT, "frequency_penalty": 0.5, "presence_penalty": 0.5}, True, False, True),
    "default-flat": (DEFAULT, True, True, True),
    "logit_bias": ({**DEFAULT, "logit_bias": tuple((i * 97, -5.0) for i in range(300))}, True, False, False),
    "logprobs 5": ({**DEFAULT, "logprobs": 5}, True, False, False),
}


def load_baseline(ref: str) -> types.ModuleType:
    """streamchat/model/sampling.py at git `ref`, as a module of its own (its imports resolve to this checkout)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:streamchat/model/sampling.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"sampling_at_{ref}")
    module.__file__ = f"{ref}:streamchat/model/sampling.py"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def histories(rows: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [sampling.TokenHistory(torch.randint(0, VOCAB, (64,), generator=gen).tolist(),
                                  torch.randint(0, VOCAB, (200,), generator=gen).tolist()) for _ in range(rows)]


def sampler_call(module: types.ModuleType, fields: dict, rows: int, with_history: bool, flat: bool):
    """A no-argument call of `module`'s sampler for this mix (logprobs through sample_with_logprobs)."""
    params = [sampling.SamplingParams(**{**fields, **({"seed": i} if "seed" in fields else {})}).validate()
              for i in range(rows)]
    fn = module.sample_with_logprobs if fields.get("logprobs") is not None else module.sample
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) if flat \
        else common.model_like_logits(rows, VOCAB, 7)
    history = histories(rows, 8) if with_history else None
    generators = [module.make_generator(p) for p in params]
    return lambda: fn(logits, params, generators, history)


def time_calls(calls: list, num_calls: int) -> list[float]:
    """The median wall time of each call (ms), timed in turn, one call of each per round, after three
    warm-up rounds."""
    times: list[list[float]] = [[] for _ in calls]
    for round_idx in range(3 + num_calls):
        for call, samples in zip(calls, times):
            started = time.perf_counter()
            call()
            if round_idx >= 3:
                samples.append(time.perf_counter() - started)
    return [common.ms(common.median(samples)) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=common.int_list, default=[1, 16], help="row counts, e.g. 1,16")
    parser.add_argument("--calls", type=int, default=40, help="timed calls per mix, row count and sampler")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", default=BASELINE, help="git ref of the sampler to compare against")
    parser.add_argument("--mixes", default=",".join(MIXES), help="comma-separated names of MIXES")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in args.mixes.split(",") if n]
    unknown = set(names) - set(MIXES)
    if unknown:
        parser.error(f"unknown mixes: {', '.join(sorted(unknown))}")
    baseline = load_baseline(args.baseline)
    print(f"baseline {args.baseline}, this checkout {Path(sampling.__file__).resolve()}; "
          f"{args.threads} threads, vocab {VOCAB}; ms per row (median call / rows)")
    print(f"{'mix':16}{'rows':>5}{'baseline':>10}{'this':>10}{'ratio':>8}")
    medians: dict[str, dict[int, dict[str, float | None]]] = {}
    for name in names:
        fields, with_history, flat, in_baseline = MIXES[name]
        medians[name] = {}
        for rows in args.rows:
            calls = [sampler_call(sampling, fields, rows, with_history, flat)]
            if in_baseline:
                calls.append(sampler_call(baseline, fields, rows, with_history, flat))
            new, old = (time_calls(calls, args.calls) + [None])[:2]
            medians[name][rows] = {"baseline": old, "this": new}
            per_row = [None if t is None else t / rows for t in (old, new)]
            print(f"{name:16}{rows:>5}{common.fmt(per_row[0], 10, 3)}{common.fmt(per_row[1], 10, 3)}"
                  f"{common.fmt(common.ratio(old, new), 7, 1)}x", flush=True)
    print(json.dumps({"threads": args.threads, "baseline": args.baseline, "median_ms": medians}))


if __name__ == "__main__":
    main()
