"""Helpers the benchmarks share: percentiles, the shipped text, model flags, transformers baselines.

Not a benchmark itself. Every bench script puts `bench/` on `sys.path` by
being run as `python bench/NAME.py`, so `import common` finds this file.
Imports torch lazily: `bench/load.py` (a websocket client) never loads it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

BOTCHAN = Path(__file__).resolve().parent.parent / "streamchat" / "data" / "botchan.txt"

PROMPTS = ["Tell me a story about a dragon.", "Explain how a rainbow forms.", "Write a poem about autumn.",
           "Describe the city of Paris.", "What is machine learning?", "Give advice for a job interview.",
           "Summarize the plot of Hamlet.", "How do airplanes fly?"]


def passive_omp() -> None:
    """What the daemon does before torch starts: OpenMP workers spin briefly, then sleep
    (streamchat.config.OMP_WAIT). Must run before torch is imported; what the environment
    already sets wins."""
    from streamchat.config import omp_wait_defaults

    omp_wait_defaults()


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"give positive integers, e.g. 1,4,16: {text!r}")
    return values


def percentile(samples, q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no samples."""
    xs = sorted(samples)
    if not xs:
        return None
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def median(samples) -> float | None:
    xs = list(samples)
    return float(statistics.median(xs)) if xs else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def fmt(value, width: int = 10, digits: int = 1) -> str:
    """A right-aligned number, or '-' for None."""
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, int):
        return f"{value:>{width}d}"
    return f"{value:>{width}.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def rounded(d: dict, digits: int = 3) -> dict:
    """Floats rounded for the JSON line (nested dicts and lists too)."""
    def r(v):
        if isinstance(v, float):
            return round(v, digits)
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        if isinstance(v, list):
            return [r(x) for x in v]
        return v
    return r(d)


def model_like_logits(rows: int, vocab: int, seed: int):
    """(rows, vocab) float32 logits shaped like a small language model's (SmolLM2-135M at temperature 0.7,
    top_p 0.9 keeps 1 to ~20 tokens): a Gaussian floor (sd 1.5) under a head of 400 random tokens whose
    logits fall off as 1.5 log(rank), the head's top 12 to 22 above the floor. Seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 1.5
    head = 400
    falloff = 1.5 * torch.log(torch.arange(1, head + 1, dtype=torch.float32))
    for r in range(rows):
        ids = torch.randperm(vocab, generator=gen)[:head]
        top = 12 + 10 * torch.rand((), generator=gen)
        x[r, ids] = top - falloff + torch.randn(head, generator=gen)
    return x


def botchan_text() -> str:
    return BOTCHAN.read_text(encoding="utf-8-sig")


def botchan_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the shipped Botchan (repeated if it is too short)."""
    ids = tokenizer(botchan_text(), add_special_tokens=False, verbose=False)["input_ids"]
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def botchan_prefix(tokenizer, num_tokens: int) -> str:
    """Text of about `num_tokens` tokens from Botchan (decoded, so re-encoding may differ by a few)."""
    return tokenizer.decode(botchan_ids(tokenizer, num_tokens))


# -- the model ------------------------------------------------------------------

def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype (default auto), --device, --attention-backend, --num-threads, --cache-dir."""
    from streamchat import settings

    settings.add_flags(parser, ("model",))


def model_config(args: argparse.Namespace):
    """The ModelConfig the flags (then STREAMCHAT_* variables) describe."""
    from streamchat import settings

    return settings.load(args).model


def describe(loaded) -> str:
    import torch

    m = loaded.model
    return (f"{loaded.source.name}: dtype={m.dtype} device={m.device} attention={m.backend.name} "
            f"threads={torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')} "
            f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}")


def disable_eos(engine) -> None:
    """Responses run to max_tokens, as `min_new_tokens` makes transformers do: same work on both sides."""
    engine.eos_ids = set()


def sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


# -- transformers baselines -------------------------------------------------------

def load_transformers(loaded):
    """The same weights and dtype through transformers, on our device."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(loaded.source.folder, dtype=loaded.model.dtype)
    return model.to(loaded.model.device).eval()


def chat_inputs(chat, prompts: list[str], system: str = "") -> list[list[int]]:
    """The token ids our engine computes for a new session with one user item and a reply prompt."""
    head = chat.bos_ids + (chat.message("system", system) if system else [])
    return [head + chat.message("user", p) + chat.reply_prompt() for p in prompts]


def spread_lengths(num: int, mean: int) -> list[int]:
    """Response lengths for `num` requests, evenly spread over [mean/4, 7*mean/4] (their mean is `mean`).

    Chat replies differ in length; a padded batch runs to its longest and
    throws the rest away, continuous batching does not. Deterministic, so
    both sides of a comparison get the same list.
    """
    if num == 1:
        return [mean]
    return [max(1, round(mean * (0.25 + 1.5 * i / (num - 1)))) for i in range(num)]


def _lengths(tokens, num: int) -> list[int]:
    return list(tokens) if isinstance(tokens, (list, tuple)) else [tokens] * num


def hf_sequential(model, inputs: list[list[int]], tokens) -> int:
    """One `generate` per prompt, one after another; returns new tokens.

    `tokens`: new tokens per prompt, one int for all or a list (exactly that many each).
    """
    import torch

    total = 0
    with torch.inference_mode():
        for ids, n in zip(inputs, _lengths(tokens, len(inputs))):
            out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)
            total += out.shape[1] - len(ids)
    return total


def hf_padded(model, inputs: list[list[int]], tokens, pad_id: int) -> int:
    """One left-padded `generate` over all prompts; returns the new tokens that were asked for.

    With per-prompt lengths the batch runs to the longest; rows past their
    own length are wasted work and not counted.
    """
    import torch

    lengths = _lengths(tokens, len(inputs))
    width = max(len(i) for i in inputs)
    ids = torch.tensor([[pad_id] * (width - len(i)) + i for i in inputs], device=model.device)
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in inputs], device=model.device)
    longest = max(lengths)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                             do_sample=False, pad_token_id=pad_id)
    assert out.shape[1] - width == longest
    return sum(lengths)


# -- versions of the CPU kernels, timed side by side ----------------------------

def kernel_version(decode_source: Path):
    """The CPU kernels with `decode_source` as cpu_decode.c, beside this checkout's other sources (an
    older cpu_decode.c that still holds the weight products itself leaves cpu_linear*.c out), loaded
    as a library of their own. Entry points it lacks (a newer kernel's) are missing from it."""
    from streamchat.kernels import cpu

    text = Path(decode_source).read_text()
    own_products = "group_linear(" in text
    # the decode stack calls these of cpu_decode.c; an older version without them leaves it out
    stack = all(f"{name}(" in text for name in ("rms_norm", "write_kv_int8", "paged_decode_quantized"))
    others = [s for s in cpu.cpu_build.SOURCES[1:] if not (own_products and s.name.startswith("cpu_linear"))
              and (stack or s.name != "cpu_forward.c")]
    return cpu.build_library([Path(decode_source).resolve(), *others])


def use_library(lib) -> None:
    """Make `lib` the process's kernel library (what every kernel call goes through) until the next call."""
    from streamchat.kernels import cpu

    cpu._tried, cpu._lib = True, lib
