"""Weight formats of the model's linear layers: dense, int8 per output channel, int4 in groups of 32.

Owns how one weight matrix W (out_features N, in_features K) is stored and
multiplied. Each format is a small class whose call returns x @ W.T (+ bias)
in x's dtype. Dense and int8 are built from dense tensors; int4 from codes,
scales and zeros (`Int4Codes`), which come from a dense tensor (asymmetric
min/max groups of 32) or from GGUF 4-bit blocks decoded as they are (Q4_1:
w = d * q + m, Q4_0: w = d * (q - 8)). Knows nothing about layers, files,
configs or which format to choose.

The CPU kernels are torch's packed weight-only matmuls (torch 2.13, checked
numerically, see tests/model/test_qlinear.py):

    _weight_int8pack_mm(x, q, scale)                 W[n, k] = q[n, k] * scale[n]
        x (M, K); q int8 (N, K); scale (N,) in x's dtype
    _convert_weight_to_int4pack_for_cpu(q, 1)        q int32 (N, K), values 0..15 -> uint8 (N, K/2)
        in an opaque layout blocked by output channel (innerKTiles is ignored on CPU)
    _weight_int4pack_mm_for_cpu(x, packed, 32, sz)   W[n, k] = (q[n, k] - 8) * sz[g, n, 0] + sz[g, n, 1]
        x (M, K) 2-D; sz (K/32, N, 2) in x's dtype, g = k // 32; N % 16 == 0

So Q4_1's (d, m) is (scale = d, zero = m + 8 d) and Q4_0's d is (d, 0):
exact in float32 (d, m are float16; 8 d and the sum are exact in float32).
Both kernels vectorize only bfloat16 activations on an AVX2 CPU: with float32
or float16 they ran 10-20x slower than a dense float32 matmul (measured), so
the quantized formats run in `compute_dtype`, bfloat16 by default, and cast
back: the activations and the int4 scales and zeros are rounded to bfloat16.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from streamchat.kernels import cpu

GROUP = 32  # int4 group size along in_features: Q4_0/Q4_1 blocks and the kernel's qGroupSize
INT4_ROWS = 16  # the int4 packer wants out_features in multiples of this
COMPUTE_DTYPE = torch.bfloat16


# Decode rows up to here multiply a bfloat16 model's GGUF groups in float32 (DenseLinear); more go to the
# bf16 GEMM (W reordered once: `packed_bf16`). The crossover, python bench/step.py --sessions N --cached
# 200 --kv-dtype int8 on a 2-core EPYC with avx512_bf16, each N alternating: 3 rows 19.8, 22.4 ms a step on
# the groups against 33.8, 26.4 on the GEMM; 4 rows 28.9, 37.8 against 26.2, 25.1 (1 row 8.1-9.0 against
# 24.1-33.2). Before the reordering the GEMM lost at 4 rows too (LLM.chat: 99.1 against 100.0 tok/s).
BF16_GROUP_ROWS = 3


class Linear(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# A bf16 weight on CPU is also kept in oneDNN's blocked layout, reordered once at load: F.linear reorders
# W on every call, which at a decode step's 5-32 rows cost as much as the product (the bundled model's
# products at 16 rows: 48.2 -> 29.2 ms, the output head 9.0 -> 4.1 ms; 2-core EPYC, avx512_bf16). The
# same oneDNN kernel runs on either layout, so the results are the same bits as F.linear's. Only the
# reordered copy is kept (`DenseLinear.weight` rebuilds W from it when asked).
PACK_ROWS_HINT = 16  # the batch size oneDNN picks the layout for (16 and 64 timed the same here)


def packed_bf16(weight: torch.Tensor):
    """`weight` reordered for oneDNN's bf16 GEMM (an opaque mkldnn tensor), or None where that does not
    apply (not bf16, not on CPU, a torch without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):  # an op this torch build lacks: F.linear serves
        return None


class DenseLinear:
    """W as it is, in the model's dtype: F.linear. On CPU in float32 a decode step's few rows go to
    the C kernels instead (MKL's sgemm read W at a third of memory speed there): `groups`, when
    given, holds the same W as the GGUF stores it (4- or 8-bit groups that decode to exactly this
    weight), a quarter to an eighth of the bytes; otherwise `skinny_linear` streams W itself."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 groups: "cpu.Groups | None" = None, x8: bool = False) -> None:
        self.bias, self.groups, self.x8 = bias, groups, x8
        # A decode step's few rows (up to `few_rows`) go to the C kernels. float32: the groups, or W itself
        # streamed. bfloat16: oneDNN's bf16 GEMM is fast on a batch but reads W slowly for a row or two, where
        # the groups (W unrounded, a quarter of the bytes) multiply in float32 and the result is rounded back.
        self.few_rows = 0
        if weight.device.type == "cpu" and bias is None:
            if weight.dtype == torch.float32:
                self.few_rows = cpu.SKINNY_MAX_ROWS
            elif weight.dtype == torch.bfloat16 and groups is not None:
                self.few_rows = BF16_GROUP_ROWS
        self.packed = packed_bf16(weight)
        self._dense = weight if self.packed is None else None  # held once: reordered, or as it is

    @property
    def weight(self) -> torch.Tensor:
        """W (out, in) as given; rebuilt from the reordered copy when that is what is kept."""
        return self._dense if self._dense is not None else self.packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.few_rows:
            y = self.groups.matmul(x.float(), self.x8) if self.groups is not None else cpu.skinny_linear(x, self.weight)
            if y is not None:
                return y.to(x.dtype)  # no copy in float32
        if self.packed is not None and x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        dense = self._dense.nbytes if self._dense is not None else self.packed.numel() * self.packed.element_size()
        return dense + (self.groups.nbytes if self.groups is not None else 0)


class GroupLinear:
    """W as the GGUF stores it in groups (`cpu.Groups`), on CPU: the int4 format's head when the
    file's Q8_0 blocks decode to exactly the dense weight."""

    def __init__(self, groups: "cpu.Groups", bias: torch.Tensor | None = None, x8: bool = False) -> None:
        self.groups, self.bias, self.x8 = groups, bias, x8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _finish(_grouped(self.groups, x, self.x8), x, self.groups.n, self.bias)

    @property
    def nbytes(self) -> int:
        return self.groups.nbytes


def q8_0_groups(raw: torch.Tensor) -> "cpu.Groups":
    """GGUF Q8_0 rows (N, K/32 * 34) uint8 -> groups: block = d f16, 32 int8, w = d * q."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, 34)  # (N, G, 34)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)  # (N, K)
    return cpu.Groups(q, 8, _f16(blocks[..., 0:2]), None)


Q4_BLOCKS = {"Q4_1": (20, 4), "Q4_0": (18, 2)}  # GGUF block bytes, and where its 16-byte payload starts


def q4_groups(raw: torch.Tensor, qtype: str) -> "cpu.Groups":
    """GGUF Q4_0/Q4_1 rows (N, K/32 * block bytes) -> groups, the payloads as stored (already the
    kernels' nibble order): scale d, zero m + 8d (Q4_1) or 0 (Q4_0), as `q4_1_codes`/`q4_0_codes` give."""
    size, payload = Q4_BLOCKS[qtype]
    n = raw.shape[0]
    blocks = raw.view(n, -1, size)  # (N, G, size)
    d = _f16(blocks[..., 0:2])
    zero = _f16(blocks[..., 2:4]) + 8 * d if qtype == "Q4_1" else torch.zeros_like(d)
    return cpu.Groups(blocks[..., payload:].reshape(n, -1), 4, d, zero)


def _grouped(groups: "cpu.Groups", x: torch.Tensor, x8: bool) -> torch.Tensor:
    """x (..., K) @ W.T in float32 (M, N) by the C kernels: a decode step's few rows multiply the
    grouped codes directly (x8: with x rounded to 8 bits); a longer chunk widens W once into a
    reused buffer and runs sgemm."""
    xf = x.reshape(-1, x.shape[-1]).float()
    y = groups.matmul(xf, x8)
    if y is None:
        y = F.linear(xf, groups.dequantize(cpu.dense_scratch(groups.n * groups.k)))
    return y


def _finish(y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Kernel output (M, >= N) back to x's leading shape and dtype, plus the bias."""
    y = y[:, :out_features].to(x.dtype).view(*x.shape[:-1], out_features)  # (..., N)
    return y if bias is None else y + bias


class Int8Linear:
    """Symmetric int8 per output channel: W[n] = q[n] * scale[n], q in -127..127."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE, x8: bool = False) -> None:
        assert q.dtype == torch.int8 and q.dim() == 2 and scale.shape == (q.shape[0],)
        self.q, self.scale = q.contiguous(), scale.to(compute_dtype)
        self.bias, self.compute_dtype, self.x8 = bias, compute_dtype, x8
        self.groups = None  # on CPU with the C kernels: as Int4Linear's, in float32 with float32 scales
        if q.device.type == "cpu" and q.shape[1] % GROUP == 0 and cpu.library() is not None:
            per_group = scale.float()[:, None].expand(-1, q.shape[1] // GROUP)
            self.groups = cpu.Groups(self.q, 8, per_group, None)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE, x8: bool = False) -> "Int8Linear":
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, bias, compute_dtype, x8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups is not None:
            return _finish(_grouped(self.groups, x, self.x8), x, self.q.shape[0], self.bias)
        x2 = x.reshape(-1, x.shape[-1]).to(self.compute_dtype).contiguous()  # (M, K)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)  # (M, N)
        return _finish(y, x, self.q.shape[0], self.bias)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (self.groups.scale.nbytes if self.groups is not None else 0)


class Int4Codes(NamedTuple):
    """W[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32], all float32 but codes."""

    codes: torch.Tensor  # (N, K) uint8, 0..15
    scale: torch.Tensor  # (N, K / 32)
    zero: torch.Tensor  # (N, K / 32)

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)  # (N, G, 32)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(n, k)


def cat_codes(parts: list[Int4Codes]) -> Int4Codes:
    """Stack several matrices' codes along out_features (a fused projection)."""
    return Int4Codes(*(torch.cat(t) for t in zip(*parts)))


def minmax_codes(weight: torch.Tensor) -> Int4Codes:
    """Asymmetric round-to-nearest per group of 32: the group's min and max are representable."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
    w = weight.float().view(n, k // GROUP, GROUP)  # (N, G, 32)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Codes(codes.view(n, k), scale, lo + 8 * scale)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGML 4-bit block payload (..., 16) bytes -> (..., 32) codes: low nibbles first, then high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes (..., 2) -> float32 (...) of the float16 they hold."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def q4_1_codes(raw: torch.Tensor) -> Int4Codes:
    """GGUF Q4_1 rows (N, K/32 * 20) uint8 -> codes: block = d f16, m f16, 16 bytes of nibbles."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, 20)  # (N, G, 20)
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    codes = _nibbles(blocks[..., 4:]).reshape(n, -1)  # (N, K)
    return Int4Codes(codes, d, m + 8 * d)


def q4_0_codes(raw: torch.Tensor) -> Int4Codes:
    """GGUF Q4_0 rows (N, K/32 * 18) uint8 -> codes: block = d f16, 16 bytes of nibbles, w = d (q - 8)."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, 18)  # (N, G, 18)
    d = _f16(blocks[..., 0:2])
    codes = _nibbles(blocks[..., 2:]).reshape(n, -1)  # (N, K)
    return Int4Codes(codes, d, torch.zeros_like(d))


class Int4Linear:
    """Asymmetric int4 in groups of 32 along in_features.

    On CPU with the C kernels (kernels/cpu.py): the codes two to a byte, as GGUF stores them; a decode
    step's few rows multiply them directly (`group_linear`), a longer chunk widens the matrix into a
    reused float32 buffer (exactly the dense weight) and runs sgemm, so prefill goes at dense speed.
    Elsewhere: torch's packed int4 kernel for every row count.
    """

    def __init__(self, c: Int4Codes, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE, x8: bool = False) -> None:
        n, k = c.codes.shape
        if k % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
        self.out_features, self.bias, self.compute_dtype, self.x8 = n, bias, compute_dtype, x8
        self.groups = None
        if c.codes.device.type == "cpu" and cpu.library() is not None:
            self.groups = cpu.Groups.from_codes(c.codes, c.scale, c.zero)
            return
        pad = -n % INT4_ROWS  # zero rows, sliced off the output
        codes = F.pad(c.codes.to(torch.int32), (0, 0, 0, pad))  # (N + pad, K)
        sz = torch.stack([c.scale, c.zero], dim=-1)  # (N, G, 2)
        sz = F.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1)  # (G, N + pad, 2)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        self.scale_zero = sz.to(compute_dtype).contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE, x8: bool = False) -> "Int4Linear":
        return cls(minmax_codes(weight), bias, compute_dtype, x8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups is not None:
            return _finish(_grouped(self.groups, x, self.x8), x, self.out_features, self.bias)
        x2 = x.reshape(-1, x.shape[-1]).to(self.compute_dtype).contiguous()  # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scale_zero)  # (M, N + pad)
        return _finish(y, x, self.out_features, self.bias)

    @property
    def nbytes(self) -> int:
        if self.groups is not None:
            return self.groups.nbytes
        return self.packed.nbytes + self.scale_zero.nbytes
