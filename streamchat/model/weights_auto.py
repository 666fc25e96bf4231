"""`--weights auto`: the fastest weight format whose perplexity is within 1% of dense.

Owns the decision and its cache. Measured once per (model fingerprint,
device, dtype) on a short slice of the shipped text by the caller's
`measure` (`streamchat.autotune`: each format's perplexity over the first
AUTO_TOKENS tokens and its decode step time, interleaved across the formats
so that other load on the machine falls on all of them alike). The decision is
a small JSON file beside the converted models
(`$XDG_CACHE_HOME/streamchat/models/weights-auto/`); delete it to measure
again. Off the CPU the quantized formats do not run, so auto is dense there.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from streamchat.model.weights import FORMATS

log = logging.getLogger(__name__)

AUTO_TOKENS = 512  # perplexity slice: the paired difference between formats is what counts
DECODE_STEPS = 12  # timed single-token steps per format (after 2 untimed)
PPL_TOLERANCE = 0.01


@dataclass(frozen=True)
class Measured:
    ppl: float
    decode_ms: float  # median single-token step


def pick(measured: dict[str, Measured], tolerance: float = PPL_TOLERANCE) -> str:
    """The fastest format whose perplexity is at most (1 + tolerance) x dense ("bf16")."""
    limit = measured["bf16"].ppl * (1 + tolerance)
    fit = [name for name, m in measured.items() if m.ppl <= limit]
    return min(fit, key=lambda name: measured[name].decode_ms)


def decision_path(cache_dir: Path, fingerprint: str, device: torch.device, dtype: torch.dtype) -> Path:
    return cache_dir / "weights-auto" / f"{fingerprint}-{device.type}-{str(dtype).removeprefix('torch.')}.json"


def read_decision(path: Path) -> str | None:
    """A cached choice, or None when absent or unreadable (then auto measures again)."""
    try:
        choice = json.loads(path.read_text())["choice"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return choice if choice in FORMATS else None


def write_decision(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".auto-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def choose(path: Path, device: torch.device, measure: Callable[[], dict[str, Measured]]) -> str:
    """The cached decision at `path`, else `measure()` once, decide, cache and log."""
    if device.type != "cpu":
        log.info("weights auto: bf16 (quantized formats run on CPU only)")
        return "bf16"
    cached = read_decision(path)
    if cached is not None:
        log.info("weights auto: %s (decided earlier, %s)", cached, path)
        return cached
    started = time.perf_counter()
    measured = measure()
    choice = pick(measured)
    write_decision(path, {"choice": choice, "tolerance": PPL_TOLERANCE, "tokens": AUTO_TOKENS,
                          "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "measured": {k: asdict(m) for k, m in measured.items()}})
    dense = measured["bf16"]
    log.info("weights auto: %s in %.0f s (%s); cached in %s", choice, time.perf_counter() - started,
             ", ".join(f"{k} ppl {m.ppl / dense.ppl - 1:+.2%} decode {m.decode_ms:.1f} ms"
                       for k, m in measured.items()), path)
    return choice
