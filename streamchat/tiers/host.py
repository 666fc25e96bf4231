"""The host tier: idle sessions' blocks in host memory, a block pool of its own.

Owns a second `BlockPool` over per-layer host tensors laid out by the same
per-layer KV specs as the device pool (model/kv_spec.py; pinned memory when
the device is CUDA, so copies are DMA-able; plain CPU tensors otherwise,
where it still lets a fixed device pool hold more sessions' worth of KV) and
which session holds which host blocks. Full
blocks of a pristine session keep their prefix hash here too, so sessions
sharing a system prompt hold one host copy of it. Knows nothing about the
policy or about sessions but their ids: the engine's scheduler decides who
comes and goes, the pager copies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from streamchat.cache.block_pool import BlockPool
from streamchat.tiers.kvfile import WORD_ROWS, SeqState, byte_view, copy_rows, words


@dataclass
class HostEntry:
    session_id: str
    block_ids: list[int]  # host block ids, table order
    state: SeqState
    block_hashes: list[int]  # prefix hashes of the leading full blocks (pristine only)


def copy_blocks(src_caches, src_ids: list[int], dst_caches, dst_ids: list[int], stream=None) -> None:
    """Copy blocks between two pools of the same specs (on any devices).

    `stream`: a CUDA side stream (the host tier's) for copies between host
    and device. It first waits for the work queued on the current stream
    (the blocks' last writes); copies go through pinned staging buffers,
    non_blocking; and it is waited for before the copied data is used: by
    the host (synchronize) after a copy down, by the current stream
    (wait_stream, no host block) after a copy up. None: plain copies, as on CPU.
    """
    if not src_ids:
        return
    if stream is None:
        few, si, di = len(src_ids) < WORD_ROWS, None, None
        for src, dst in zip(src_caches, dst_caches):
            for s, d in zip(src, dst):
                if s is None or (few and copy_rows(d, dst_ids, s, src_ids)):
                    continue
                if si is None:  # one device a side for every layer; built only if a copy needs them
                    si = torch.tensor(src_ids, dtype=torch.long, device=s.device)
                    di = torch.tensor(dst_ids, dtype=torch.long, device=d.device)
                src_rows, dst_rows = words(s, d, copied=len(src_ids))
                dst_rows.index_copy_(0, di, src_rows.index_select(0, si).to(d.device))
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    landed = []  # copies down: (host pool tensor, host ids, staged rows), placed once the stream is done
    with torch.cuda.stream(stream):
        for src, dst in zip(src_caches, dst_caches):
            si = torch.tensor(src_ids, dtype=torch.long).to(src[0].device)
            di = torch.tensor(dst_ids, dtype=torch.long).to(dst[0].device)
            for s, d in zip(src, dst):
                if s is None:
                    continue
                s, d = byte_view(s), byte_view(d)
                staged = torch.empty((len(src_ids), *s.shape[1:]), dtype=s.dtype, pin_memory=True)
                if s.is_cuda:
                    staged.copy_(s.index_select(0, si), non_blocking=True)
                    landed.append((d, di, staged))
                else:
                    torch.index_select(s, 0, si, out=staged)
                    d.index_copy_(0, di, staged.to(d.device, non_blocking=True))
    if landed:
        stream.synchronize()
        for d, di, staged in landed:
            d.index_copy_(0, di, staged)
    else:
        current.wait_stream(stream)


class HostTier:
    def __init__(self, kv_specs, num_blocks: int, device: torch.device) -> None:
        """kv_specs: the device pool's, one per layer; device: the device pool's (CUDA: pinned memory)."""
        pin = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if pin else None  # side stream of copies (copy_blocks)
        self.block_size = kv_specs[0].block_size
        self.pool = BlockPool(num_blocks + 1)  # + the null block
        self.caches = [spec.allocate(num_blocks + 1, torch.device("cpu"), pin_memory=pin, fill=False)
                       for spec in kv_specs]
        self.entries: OrderedDict[str, HostEntry] = OrderedDict()  # least recently paged out first

    @property
    def capacity(self) -> int:
        return self.pool.num_usable

    def blocks_needed(self, state: SeqState, block_hashes: list[int]) -> int:
        """Free host blocks `put` would consume: new copies, plus cached blocks it revives."""
        need = 0
        for idx in range(state.num_blocks(self.block_size)):
            block_id = self._cached(state, block_hashes, idx)
            need += block_id is None or self.pool.ref_counts[block_id] == 0
        return need

    def put(self, session_id: str, state: SeqState, block_hashes: list[int], device_caches,
            device_ids: list[int]) -> HostEntry:
        """Copy the session's device blocks in; blocks already here by prefix hash are shared."""
        ids, src, dst = [], [], []
        bs = self.block_size
        for idx, device_id in enumerate(device_ids):
            block_id = self._cached(state, block_hashes, idx)
            if block_id is not None:
                self.pool.touch(block_id)
            else:
                block_id = self.pool.allocate()
                src.append(device_id)
                dst.append(block_id)
                if idx < len(block_hashes):
                    self.pool.register(block_id, block_hashes[idx], tuple(state.token_ids[idx * bs:(idx + 1) * bs]))
            ids.append(block_id)
        copy_blocks(device_caches, src, self.caches, dst, self.stream)
        entry = HostEntry(session_id, ids, state, list(block_hashes))
        self.entries[session_id] = entry
        return entry

    def _cached(self, state: SeqState, block_hashes: list[int], idx: int) -> int | None:
        if idx >= len(block_hashes):
            return None
        bs = self.block_size
        return self.pool.lookup(block_hashes[idx], tuple(state.token_ids[idx * bs:(idx + 1) * bs]))

    def oldest(self) -> HostEntry | None:
        return next(iter(self.entries.values()), None)

    def release(self, entry: HostEntry) -> None:
        """Forget the entry and drop its block references (tail first; hashed blocks stay findable)."""
        self.entries.pop(entry.session_id, None)
        for block_id in reversed(entry.block_ids):
            self.pool.free(block_id)

    def gather(self, entry: HostEntry, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
        """The entry's blocks (or some rows of its table) as snapshot tensors."""
        ids = entry.block_ids if rows is None else [entry.block_ids[r] for r in rows]
        idx = torch.tensor(ids, dtype=torch.long)
        return {f"{name}.{layer}": t.index_select(0, idx)
                for layer, kv in enumerate(self.caches) for name, t in zip(kv._fields, kv) if t is not None}

    def check(self) -> None:
        """Assert the pool holds and the entries reference the same blocks."""
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        for entry in self.entries.values():
            assert len(entry.block_ids) == entry.state.num_blocks(self.block_size)
            for block_id in entry.block_ids:
                refs[block_id] += 1
        assert refs == self.pool.ref_counts, "host entries and host ref counts disagree"
