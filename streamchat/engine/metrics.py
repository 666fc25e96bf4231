"""Live engine figures: counters and recent latencies, read by the daemon's /metrics.

The engine thread writes, scrapes read; every field is a plain number or a
bounded deque, so a torn read is at worst one sample stale. Torch-free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    steps: int = 0
    tokens: int = 0
    decode_tokens: int = 0
    step_seconds: float = 0.0
    decode_steps: int = 0  # steps whose every token was a decode row: what bench/step.py times
    decode_step_seconds: float = 0.0
    failed_steps: int = 0
    ttft: deque = field(default_factory=lambda: deque(maxlen=4096))
    itl: deque = field(default_factory=lambda: deque(maxlen=16384))
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=4096))
    observers: list = field(default_factory=list)  # callables(kind, value), e.g. histograms

    def on_step(self, num_tokens: int, num_decode: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += num_tokens
        self.decode_tokens += num_decode
        self.step_seconds += seconds
        if num_decode and num_decode == num_tokens:
            self.decode_steps += 1
            self.decode_step_seconds += seconds
        self.batch_sizes.append(num_tokens)
        self._notify("step_tokens", num_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.append(seconds)
        self._notify("ttft", seconds)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.append(seconds)
        self._notify("itl", seconds)

    def _notify(self, kind: str, value: float) -> None:
        for observe in self.observers:
            observe(kind, value)
