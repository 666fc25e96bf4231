"""Decode steps through static input buffers, replayed as one CUDA graph per batch-size bucket.

Owns the persistent inputs of a decode-only step (token ids, positions,
slots, block tables, lengths, logits rows), allocated once for the largest
batch, and on CUDA one captured graph per bucket (1, 2, 4, ..., max_batch)
with its output. A step of n sequences is copied into rows 0..n-1; rows
n..bucket-1 are padding: token 0 at position 0, written to slot 0 of the
null block (block 0, never allocated, so nothing real is overwritten),
length 1, a table of null blocks. Every layer then runs on views of the
same buffers, which is what lets a graph replay them.

    rows:    0 ........ n-1 | n ...... bucket-1 | bucket ..... max_batch-1
             this step       padding (null slot)  unused by this bucket
    tables:  (max_batch, max_blocks) int32; a graph reads all max_blocks
             columns (kernels stop at each row's length), eager steps only
             the batch's widest table

Without graphs (CPU, or `--cuda-graphs false`) the same buffers run eagerly
and a batch is not padded unless `pad` asks for it (tests do). Knows nothing
about scheduling: it is handed the decode chunks of a `StepBatch`.
"""

from __future__ import annotations

import torch

from streamchat.model.attention import AttentionMetadata, DecodeGroup
from streamchat.model.batch import StepBatch

NULL_SLOT = 0  # offset 0 of the null block


def buckets(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself."""
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return out + [max_batch] if max_batch > 1 else out


def bucket_for(num_seqs: int, sizes: list[int]) -> int:
    return next(b for b in sizes if b >= num_seqs)


class StaticDecode:
    """Static decode inputs for batches of up to max_batch sequences; tables max_blocks wide (widened
    when a sequence needs more)."""

    def __init__(self, model, kv_caches, block_size: int, max_batch: int, max_blocks: int,
                 graphs: bool, pad: bool | None = None) -> None:
        if graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        dev = model.device
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_batch, self.max_blocks, self.use_graphs = max_batch, max_blocks, graphs
        self.sizes = buckets(max_batch) if (graphs if pad is None else pad) else list(range(1, max_batch + 1))
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), NULL_SLOT, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=dev)  # logits rows
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._rope = None  # the rope table the graphs read; if the model grows a new one, they are dropped
        if graphs:
            model.rope_tables(max_blocks * block_size)

    def fits(self, batch: StepBatch) -> bool:
        """A decode-only step within the buffers, every row sampled."""
        d = batch.decode
        return not batch.prefill and 0 < len(d) <= self.max_batch and all(c.want_logits for c in d)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits (n, vocab) of a step that `fits`; a graph's output is valid until the next run."""
        assert self.fits(batch)
        n = len(batch.decode)
        size = bucket_for(n, self.sizes)
        widest = max(len(c.block_ids) for c in batch.decode)
        if widest > self.max_blocks:
            self._widen(widest)
        width = self.max_blocks if self.use_graphs else widest
        self._fill(batch, size, width)
        if not self.use_graphs:
            return self._forward(size, width)[:n]
        if self._rope is not None and self.model.rope_tables(1)[0] is not self._rope:
            self.graphs.clear()  # the rope table moved: every graph reads the old one
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def _widen(self, max_blocks: int) -> None:
        """Tables for longer sequences (a long pinned system prompt): the graphs are captured anew."""
        self.tables = torch.zeros(self.max_batch, max_blocks, dtype=torch.int32, device=self.model.device)
        self.max_blocks = max_blocks
        self.graphs.clear()
        if self.use_graphs:
            self.model.rope_tables(max_blocks * self.block_size)

    def _fill(self, batch: StepBatch, size: int, width: int) -> None:
        """Copy the step's rows into rows 0..n-1 and padding into n..size-1 (one host tensor each)."""
        chunks = batch.decode
        pad = size - len(chunks)
        columns = [[c.token_ids[0] for c in chunks] + [0] * pad, [c.positions[0] for c in chunks] + [0] * pad,
                   [c.slots[0] for c in chunks] + [NULL_SLOT] * pad, [c.seq_len for c in chunks] + [1] * pad]
        tables = [c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks] + [[0] * width] * pad
        pin = self.model.device.type == "cuda"
        host = torch.tensor(columns, dtype=torch.int64, pin_memory=pin)  # (4, size): ids, pos, slots, lens
        host_tables = torch.tensor(tables, dtype=torch.int32, pin_memory=pin)  # (size, width)
        # non_blocking from pinned memory: ordered on the current stream before the step's kernels
        # (the caching host allocator keeps `host` alive until the copies are done)
        for dst, src in zip((self.ids, self.positions, self.slots, self.seq_lens), host):
            dst[:size].copy_(src, non_blocking=pin)
        self.tables[:size, :width].copy_(host_tables, non_blocking=pin)

    def _forward(self, size: int, width: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:size], self.block_size,
                                 DecodeGroup(self.tables[:size, :width], self.seq_lens[:size]), None)
        return self.model.forward(self.ids[:size], self.positions[:size], meta, self.kv_caches, self.rows[:size])

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the step for `size` rows (its inputs already filled: a warm-up run compiles the
        kernels outside the capture; rewriting the same K/V to the same slots is harmless)."""
        self._forward(size, self.max_blocks)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(size, self.max_blocks)
        self._pool = graph.pool()
        self._rope = self.model.rope_tables(1)[0]
        return graph, out
