"""Sampling parameters: what each may be, where defaults come from, and which setting wins.

Owns `SamplingParams` and its admitted ranges, the defaults a model serves
with (its `generation_config.json`, else `DEFAULT_PARAMS`, chosen with
`bench/replies.py`), and `resolve_params`, the one rule that merges model
defaults, session defaults and a response's own fields. Torch-free, so the
server, the CLI and their tests use it without loading torch;
`streamchat.model.sampling` applies the params to logits. Knows nothing of
the wire: the protocol parser repeats the ranges, and a test keeps the two
copies equal.

Ranges, all refused with ValueError outside them (NaN, infinities and bools
included): temperature [0, 2], top_p (0, 1], top_k an int in [0, 2^63-1]
(0: off), seed None or an int in [-2^63, 2^63-1], frequency_penalty and
presence_penalty [-2, 2] (OpenAI's), repetition_penalty (0, 10] (1: off),
min_p [0, 1] (0: off).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TEMPERATURE_MAX = 2.0
# Below 1e-4 a logit gap of 0.01 already scales to a factor under e^-100
# (~4e-44, at the bottom of float32's subnormals): sampling would be argmax
# except among exact near-ties, so it is argmax, which is also deterministic.
# It also keeps 1/temperature a normal float32 (a float32 of 1e-300 is 0).
TEMPERATURE_FLOOR = 1e-4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Signed 64 bits, so a seed fits an int64 anywhere it is kept. manual_seed
# also takes [2^63, 2^64), but those alias the negative seeds. The CPU
# generator (mt19937) keeps only the low 32 bits: seeds equal modulo 2^32
# draw the same tokens.
SEED_MIN, SEED_MAX = INT64_MIN, INT64_MAX
TOP_K_MAX = INT64_MAX  # fits an int64 tensor or column; larger is pointless anyway
PENALTY_MAX = 2.0  # |frequency_penalty|, |presence_penalty|: OpenAI's range
REPETITION_PENALTY_MAX = 10.0  # 10 already divides a seen token's logit tenfold
# repetition_penalty looks at the last REPETITION_WINDOW tokens of context and
# reply: long enough to hold the loop a small model falls into (a sentence or
# two), short enough that the words of the question itself (the user's
# "cat") are not punished for the whole reply.
REPETITION_WINDOW = 64


@dataclass(frozen=True)
class SamplingParams:
    """How one response picks its tokens. The class defaults are plain greedy decoding.

    New fields go after `seed`, so positional callers keep their meaning.
    """

    temperature: float = 0.0  # below TEMPERATURE_FLOOR: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    frequency_penalty: float = 0.0  # logit -= f * count in the reply so far
    presence_penalty: float = 0.0  # logit -= p if in the reply so far
    repetition_penalty: float = 1.0  # seen in the last REPETITION_WINDOW tokens: logit / r if > 0, else * r
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0: off

    def validate(self) -> "SamplingParams":
        """Returns self, or raises ValueError for a value outside the admitted ranges."""
        _check_range(self.temperature, "temperature", 0.0, TEMPERATURE_MAX)
        _check_range(self.top_p, "top_p", 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be an integer in [0, 2^63-1], got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2^63, 2^63-1], got {self.seed!r}")
        _check_range(self.frequency_penalty, "frequency_penalty", -PENALTY_MAX, PENALTY_MAX)
        _check_range(self.presence_penalty, "presence_penalty", -PENALTY_MAX, PENALTY_MAX)
        _check_range(self.repetition_penalty, "repetition_penalty", 0.0, REPETITION_PENALTY_MAX, low_open=True)
        _check_range(self.min_p, "min_p", 0.0, 1.0)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def penalized(self) -> bool:
        """Whether the tokens already seen change the logits (greedy rows included)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))

# The serving default when the model's folder says nothing (the bundled GGUF
# never does). Chosen with bench/replies.py on the bundled SmolLM2-135M-Instruct,
# 16 open prompts x 200 tokens (docs/bench.md): greedy loops in 7 of 16
# replies (distinct-2 0.56); temperature 0.7 and top_p 0.9 alone in 3; with
# repetition_penalty 1.1 in 0 of 16 (0 of 48 over three seeds), distinct-2 0.90.
DEFAULT_PARAMS = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)

# generation_config.json keys we read, all optional; HF's names and meanings.
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_range(value: object, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    """ValueError unless value is a finite int or float in the interval (bools refused)."""
    if not _is_real(value) or not (low < value if low_open else low <= value) or not value <= high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def resolve_params(model_defaults: SamplingParams, session_defaults: Mapping[str, Any],
                   response_fields: Mapping[str, Any]) -> SamplingParams:
    """The params one response samples with: its own fields, else the session's, else the model's.

    Both mappings take SamplingParams field names; a None value means unset.
    Returns validated params; ValueError for a value out of range, TypeError
    for a name that is not a sampling field (a caller's mistake).
    """
    merged: dict[str, Any] = {}
    for layer in (session_defaults, response_fields):
        unknown = set(layer) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"not sampling fields: {', '.join(sorted(unknown))}")
        merged.update((k, v) for k, v in layer.items() if v is not None)
    return dataclasses.replace(model_defaults, **merged).validate()


def load_model_defaults(folder: Path) -> SamplingParams:
    """The params a model serves with when nobody asks otherwise.

    From the folder's generation_config.json when it sets any of temperature,
    top_p, top_k, repetition_penalty, min_p or do_sample: the keys it sets, HF's
    neutral values for the others (temperature 1 when it samples), and greedy
    when it says `"do_sample": false`. A key outside our range is skipped with
    a warning. No file, an unreadable one, or none of those keys:
    DEFAULT_PARAMS.
    """
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return DEFAULT_PARAMS
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return DEFAULT_PARAMS
    if not isinstance(config, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return DEFAULT_PARAMS
    values = {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}
    do_sample = config.get("do_sample")
    if not values and do_sample is None:
        return DEFAULT_PARAMS
    params = SamplingParams(temperature=1.0)
    for key, value in values.items():
        try:
            params = dataclasses.replace(params, **{key: value}).validate()
        except ValueError as exc:
            log.warning("%s: skipping %s", path, exc)
    if do_sample is False:
        params = dataclasses.replace(params, temperature=0.0)
    return params
