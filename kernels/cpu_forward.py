"""A decode step's layers in one C call (cpu_forward.c, built into `cpu`'s library).

`DecodeStack` holds a Llama-family model's layers as the C function reads
them (norm weights, the grouped projections, each layer's pool) and runs
them over a decode step's rows: the same kernels the Python path calls
layer by layer, without the Python between them. It takes only what those
kernels take: float32 activations, every projection in groups (`cpu.Groups`)
without a bias, float pools or int8 ones with their scales, at most
`max_rows` rows (MAX_ROWS or fewer), no attention mass; `LlamaModel` runs the Python path
otherwise. Knows nothing about models or steps beyond those arrays.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from streamchat.kernels import cpu

MAX_ROWS = 32  # cpu_linear.h MAX_ROWS: the grouped products' rows at most

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Grouped(ctypes.Structure):
    _fields_ = [("q", _p), ("bits", _i), ("scale", _p), ("zero", _p), ("n", _i), ("k", _i)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _Grouped), ("o", _Grouped),
                ("gate_up", _Grouped), ("down", _Grouped), ("key", _p), ("value", _p),
                ("k_scale", _p), ("v_scale", _p)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i), ("hidden", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i),
                ("inter", _i), ("eps", _f), ("scale", _f), ("pool_dtype", _i), ("x8", _i),
                ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("slots", _p), ("tables", _p), ("table_stride", ctypes.c_int64), ("seq_lens", _p),
                ("cos", _p), ("sin", _p), ("bs", _i), ("max_blocks", _i), ("chunk", _i)]


class LayerWeights(NamedTuple):
    """One layer as the C function takes it: float32 norm weights and four grouped projections."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: "cpu.Groups"
    o: "cpu.Groups"
    gate_up: "cpu.Groups"
    down: "cpu.Groups"


def _grouped(g: "cpu.Groups") -> _Grouped:
    return _Grouped(g.q.data_ptr(), g.bits, g.scale.data_ptr(), None if g.zero is None else g.zero.data_ptr(),
                    g.n, g.k)


def pool_dtype(key: torch.Tensor, k_scale: torch.Tensor | None, head_dim: int) -> int | None:
    """The C code of a pool the stack writes and reads (a float pool, or int8 with scales); None otherwise."""
    if not (cpu.writes(key, k_scale, head_dim) and cpu.supports(key, k_scale, head_dim)):
        return None
    return cpu.DTYPES[key.dtype] if k_scale is None else cpu.SCALED[key.dtype]


X8_BITS = (1, 2, 4, 8)  # x8's bit per product: qkv, o, gate_up, down (cpu_forward.c X8_*)


def x8_mask(qkv: bool, o: bool, gate_up: bool, down: bool) -> int:
    """The stack's `x8`: which of a layer's products round their rows to 8 bits."""
    return sum(bit for bit, on in zip(X8_BITS, (qkv, o, gate_up, down)) if on)


class DecodeStack:
    """The layers of one model for `decode_stack`; the pools are bound per step (`run`), cached while the
    same tensors are passed."""

    def __init__(self, layers: list[LayerWeights], hidden: int, heads: int, kv_heads: int, head_dim: int,
                 inter: int, eps: float, scale: float, x8: int, max_rows: int = MAX_ROWS) -> None:
        self.layers, self.head_dim, self.max_rows = layers, head_dim, min(max_rows, MAX_ROWS)
        self.shape = (len(layers), hidden, heads, kv_heads, head_dim, inter, eps, scale)
        self.x8 = int(x8)  # x8_mask: 0 none, 15 all four products
        self._bound: tuple | None = None  # (pool pointers, _Stack, its layer array)

    @staticmethod
    def usable() -> bool:
        return cpu.library() is not None and hasattr(cpu.library(), "decode_stack")

    def _bind(self, pools: list) -> _Stack | None:
        """The stack over these pools (one per layer: LayerKV-like key, value, k_scale, v_scale)."""
        # Every pointer, and the pools' dtype: pools freed and others made at the same addresses (another
        # runner over the same model) must bind afresh, or the stack would write through stale pointers.
        key = (pools[0].key.dtype, *(0 if t is None else t.data_ptr() for p in pools
                                    for t in (p.key, p.value, p.k_scale, p.v_scale)))
        if self._bound is not None and self._bound[0] == key:
            return self._bound[1]
        dtypes = {pool_dtype(p.key, p.k_scale, self.head_dim) for p in pools}
        dtypes |= {pool_dtype(p.value, p.v_scale, self.head_dim) for p in pools}
        if len(dtypes) != 1 or None in dtypes or len(pools) != len(self.layers):
            return None
        array = (_Layer * len(self.layers))()
        for slot, w, p in zip(array, self.layers, pools):
            slot.input_norm, slot.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            slot.qkv, slot.o, slot.gate_up, slot.down = (_grouped(g) for g in (w.qkv, w.o, w.gate_up, w.down))
            slot.key, slot.value = p.key.data_ptr(), p.value.data_ptr()
            if p.k_scale is not None:
                slot.k_scale, slot.v_scale = p.k_scale.data_ptr(), p.v_scale.data_ptr()
        stack = _Stack(*self.shape, dtypes.pop(), self.x8, array)
        self._bound = (key, stack, array)
        return stack

    def run(self, h: torch.Tensor, pools: list, slots: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block_size: int) -> bool:
        """Every layer over h (m, hidden) float32 contiguous, in place; False (nothing done) where the
        stack does not take this step: the caller runs the layers itself."""
        m = h.shape[0]
        if (m > self.max_rows or h.dtype != torch.float32 or not h.is_contiguous() or tables.dtype != torch.int32
                or tables.stride(1) != 1 or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()
                or slots.dtype != torch.int64 or not slots.is_contiguous()
                or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()):
            return False
        stack = self._bind(pools)
        if stack is None or not cpu.fits(self.shape[2], self.shape[3], self.head_dim, block_size):
            return False
        step = _Step(slots.data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), block_size, tables.shape[1], cpu.chunk_blocks(block_size))
        rc = cpu.library().decode_stack(h.data_ptr(), m, ctypes.byref(stack), ctypes.byref(step))
        if rc == -1:
            return False
        if rc != 0:
            raise RuntimeError("the CPU decode stack failed part-way (out of memory, or a layer's attention "
                               "refused its shape)")
        return True
