"""What one step computes, as plain lists: the scheduler's output, the runner's input.

Torch-free. The runner is the one place that turns these lists into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqChunk:
    """Tokens of one sequence computed this step, and where their K/V goes."""

    token_ids: list[int]
    positions: list[int]  # cache positions
    slots: list[int]  # physical slots: block_id * block_size + offset
    block_ids: list[int]  # the sequence's block table after this chunk is placed
    want_logits: bool  # sample after the chunk's last token

    @property
    def seq_len(self) -> int:
        return self.positions[-1] + 1


@dataclass
class StepBatch:
    """Decode rows first (one token each), then prefill chunks."""

    decode: list[SeqChunk] = field(default_factory=list)
    prefill: list[SeqChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(len(c.token_ids) for c in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    def chunks(self) -> list[SeqChunk]:
        return self.decode + self.prefill
