"""Byte buffers that saved files are read into, used again once nothing refers to them.

A page-in reads a whole file (12 MB for ~1,000 int8 tokens) into one buffer
whose views are the snapshot's tensors. Fresh memory of that size comes from
the kernel a page at a time: here ~2,000 page faults and 6.2-6.6 ms of CPU
for a 12 MB read, against 0.7 ms into memory read into before. On two cores
every millisecond of it is taken from a streaming reply's step, so the
reader keeps the buffers it has used.

A buffer goes back on the free list only when the last tensor viewing it is
freed: the tensors hold the numpy view they were made from, and a finalizer
on that view returns its base. A snapshot still in use is never written
over, however long it is kept. At most `keep_bytes` wait on the list (the
oldest leave first); a buffer larger than that is freed as usual.
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np
import torch

ROUND = 1 << 20  # buffers are made in whole MiB, so a slightly longer file fits one used before
KEEP_BYTES = 64 << 20  # free buffers kept for the next reads: two ~2,300-token int8 files


class ReadBuffers:
    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []  # oldest first
        self._returned: collections.deque[np.ndarray] = collections.deque()  # appended by finalizers
        self._lock = threading.Lock()
        self.made = self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes`, contents undefined: a free buffer if one fits, else a new one."""
        with self._lock:
            self._settle()
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
            if base is None:
                self.made += 1
            else:
                self.reused += 1
        if base is None:
            base = np.empty(-(-max(nbytes, 1) // ROUND) * ROUND, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._returned.append, base).atexit = False
        return torch.from_numpy(view)

    def free_bytes(self) -> int:
        with self._lock:
            self._settle()
            return sum(b.nbytes for b in self._free)

    def _settle(self) -> None:
        """Move the returned buffers onto the free list and trim it to `keep_bytes` (lock held).
        Finalizers only append to a deque: one may run on any thread, at any allocation."""
        while self._returned:
            self._free.append(self._returned.popleft())
        total = sum(b.nbytes for b in self._free)
        while self._free and total > self.keep_bytes:
            total -= self._free.pop(0).nbytes


READ_BUFFERS = ReadBuffers()  # the process's: every kvread.read takes its buffer here
