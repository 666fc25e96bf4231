"""What each `--weights` format means, tensor by tensor, and where it may run.

Owns the rules that turn a format name into the model's linear layers
(`LinearBuilder`), the device check, and the served fingerprint. The formats
themselves live in `qlinear`; `auto`'s measured choice in `weights_auto`.

    format  q/k/v, o, gate/up, down                       lm_head (tied: the embedding)
    bf16    dense in the model's --dtype                  dense
    int8    int8 per output channel                       int8 per output channel
    int4    GGUF Q4_0/Q4_1 tensors: their own blocks,     the GGUF's Q8_0 blocks exactly
            exactly; anything else (F32, F16, Q8_0, K-quants, (CPU), else int8 per output
            a Hugging Face folder): min/max groups of 32     channel
            from the dense weight

On CPU in float32 (the C kernels built), `bf16` also keeps the GGUF's own Q4/Q8_0 blocks beside each
dense weight they decode to exactly: a decode step's few rows multiply those (a quarter or an eighth of
the bytes), longer chunks the dense weight, so the served values are the dense ones either way.

Decode rows through the groups multiply float32 activations by default; `activations="int8"`
(`--decode-activations int8`) rounds them to 8 bits per group of 32 and multiplies in integers as
llama.cpp does (kernels/cpu_linear_x8.c): faster, and not exact, so the served fingerprint says so.
`mixed` does so in the products of MIXED_X8 only (o, down and the head: each reads a vector whose
rounding the measured perplexity tolerated best) and keeps q/k/v and gate/up in float32.

"bf16" is the issue's name for dense: the weights stay in whatever `--dtype`
the model runs in (float32 on a CPU without bf16 instructions). The head is
int8, not int4, under int4: the bundled GGUF stores the tied embedding as
Q8_0, and 4 bits there cost more perplexity than all the layers together
(measured, docs/bench.md). A GGUF block is used only if it decodes to exactly
the converted folder's weight; otherwise (a naming or row-order surprise) the
dense weight is quantized instead and a warning logged.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from streamchat.config import ConfigError
from streamchat.model.gguf_raw import RawTensor
from streamchat.kernels import cpu
from streamchat.model.qlinear import (COMPUTE_DTYPE, DenseLinear, GroupLinear, Int4Codes, Int4Linear, Int8Linear,
                                      Linear, cat_codes, minmax_codes, q4_0_codes, q4_1_codes, q4_groups, q8_0_groups)

log = logging.getLogger(__name__)

FORMATS = ("bf16", "int8", "int4")  # what `auto` chooses among, densest first
QUANTIZED = ("int8", "int4")
GGUF_INT4 = {"Q4_1": q4_1_codes, "Q4_0": q4_0_codes}
GGUF_GROUPS = (*GGUF_INT4, "Q8_0")  # the stored types the CPU kernels read as they are
HEAD_FORMAT = {"bf16": "bf16", "int8": "int8", "int4": "int8"}
ACTIVATIONS = ("float32", "mixed", "int8")  # what decode rows multiply the grouped weights with
MIXED_X8 = ("o_proj", "down_proj", "head")  # the products `mixed` gives 8-bit rows


def check_device(weights: str, device: torch.device) -> None:
    """Quantized formats run torch's CPU kernels only; refuse them elsewhere before loading."""
    if weights in QUANTIZED and device.type != "cpu":
        raise ConfigError(f"--weights {weights} runs on CPU only (torch's packed CPU kernels); "
                          f"on {device.type} use --weights bf16 (dense in --dtype) or auto")


def served_fingerprint(fingerprint: str, weights: str, activations: str = "float32") -> str:
    """Names the weights as served: quantized K/V differ, so prefix blocks and KV files must too (and
    so do those of 8-bit decode activations)."""
    served = fingerprint if weights == "bf16" else f"{fingerprint}+{weights}"
    return served if activations == "float32" else f"{served}+x{activations}"


def served_source(source, weights: str, activations: str = "float32"):
    return dataclasses.replace(source, fingerprint=served_fingerprint(source.fingerprint, weights, activations))


class LinearBuilder:
    """Makes a LlamaModel's projections and head in one format.

    `raw`: the GGUF's stored tensors under their converted names (int4 uses
    4-bit blocks from it as they are); None for a Hugging Face folder.
    `head`: the head's format when not HEAD_FORMAT's (tests pin exactness with it).
    `activations`: what decode rows multiply grouped weights with (ACTIVATIONS).
    `checked`: an earlier load of the same files found every GGUF block decoding to its converted
    weight (`model/card.py`), so the comparison is skipped; `mismatches` counts the blocks that did not.
    """

    def __init__(self, weights: str, raw: dict[str, RawTensor] | None = None,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE, head: str | None = None,
                 activations: str = "float32", checked: bool = False) -> None:
        for fmt in (weights, head or weights):
            if fmt not in FORMATS:
                raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"unknown decode activations {activations!r}; known: {', '.join(ACTIVATIONS)}")
        self.weights, self.raw, self.compute_dtype = weights, raw or {}, compute_dtype
        self.head_format = head or HEAD_FORMAT[weights]
        self.activations = activations
        self.checked, self.mismatches = checked, 0

    def layer(self, w: dict[str, torch.Tensor], names: list[str], bias: torch.Tensor | None = None) -> Linear:
        """The projection of `names` fused along out_features, as `w` (dense, model dtype) holds them."""
        return self._make(self.weights, w, names, bias, self.x8(names[0].split(".")[-2]))

    def head(self, w: dict[str, torch.Tensor], name: str) -> Linear:
        return self._make(self.head_format, w, [name], None, self.x8("head"))

    def x8(self, part: str) -> bool:
        """Whether decode rows into `part` (a projection's name, e.g. "o_proj", or "head") are rounded
        to 8 bits."""
        return self.activations == "int8" or (self.activations == "mixed" and part in MIXED_X8)

    def _make(self, fmt: str, w: dict[str, torch.Tensor], names: list[str], bias, x8: bool) -> Linear:
        if fmt == "int4":
            return Int4Linear(cat_codes([self._codes(w, n) for n in names]), bias, self.compute_dtype, x8)
        weight = torch.cat([w[n] for n in names]) if len(names) > 1 else w[names[0]]
        if fmt == "int8":
            groups = self._groups(w, names) if self.weights == "int4" and bias is None else None
            if groups is not None and groups.bits == 8:  # int4's head: the file's own Q8_0, exactly
                return GroupLinear(groups, x8=x8)
            return Int8Linear.quantize(weight, bias, self.compute_dtype, x8)
        return DenseLinear(weight, bias, self._groups(w, names) if bias is None else None, x8)

    def _groups(self, w: dict[str, torch.Tensor], names: list[str]) -> "cpu.Groups | None":
        """The fused projection as the GGUF stores it, for the CPU kernels: every part 4-bit, or one
        Q8_0 matrix, each decoding to exactly its dense float32 weight (in bfloat16: to it once rounded);
        None otherwise."""
        raws = [self.raw.get(n) for n in names]
        if (any(r is None for r in raws) or w[names[0]].device.type != "cpu"
                or w[names[0]].dtype not in (torch.float32, torch.bfloat16) or cpu.library() is None):
            return None
        if all(r.qtype in GGUF_INT4 for r in raws):
            parts = [q4_groups(r.data, r.qtype) for r in raws]
        elif len(raws) == 1 and raws[0].qtype == "Q8_0":
            parts = [q8_0_groups(raws[0].data)]
        else:
            return None
        if self.checked or all(p.decodes_to(w[n]) for p, n in zip(parts, names)):
            return parts[0] if len(parts) == 1 else cpu.Groups.cat(parts)
        self.mismatches += 1
        log.warning("%s: the GGUF's blocks do not decode to the converted weight; not using them",
                    ", ".join(names))
        return None

    def _codes(self, w: dict[str, torch.Tensor], name: str) -> Int4Codes:
        raw = self.raw.get(name)
        decode = GGUF_INT4.get(raw.qtype) if raw is not None else None
        if decode is None:
            return minmax_codes(w[name])
        codes = decode(raw.data)
        if self.checked or torch.equal(codes.dequantize().to(device=w[name].device, dtype=w[name].dtype), w[name]):
            return codes
        self.mismatches += 1
        log.warning("%s: the GGUF's %s blocks do not decode to the converted weight; quantizing it instead",
                    name, raw.qtype)
        return minmax_codes(w[name])
