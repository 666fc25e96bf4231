"""A GGUF file's linear-layer weights as stored (still quantized), under Hugging Face names.

Owns the GGUF tensor names of the Llama family (blk.N.attn_q.weight ->
model.layers.N.self_attn.q_proj.weight, ...) and the one reordering that
transformers' GGUF conversion applies, so that rows here are in the order of
the converted safetensors folder: for architecture "llama", llama.cpp's
converter permuted the rows of q and k (each head's two rotary halves
interleaved) and transformers un-permutes them. Rows of a block-quantized
tensor are whole blocks along in_features, so permuting rows moves blocks
intact. The tensors wanted are cached in the converted folder
(gguf-blocks/linear.safetensors). Decoding blocks is `qlinear`'s job; parsing GGUF is the `gguf`
package's. Knows nothing about kernels or layers.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# In a subfolder: the converted folder's own *.safetensors are its weights and its fingerprint. One file
# per set of stored types read (linear-Q4_0-Q4_1.safetensors, ...).
CACHE_FILE = Path("gguf-blocks") / "linear.safetensors"


@dataclass(frozen=True)
class RawTensor:
    """One weight matrix as the file stores it: GGML type name and bytes, rows = out_features."""

    qtype: str  # "Q4_1", "Q4_0", "Q8_0", "F16", "F32", ...
    data: torch.Tensor  # (out_features, bytes or elements per row), rows in the converted order


def hf_name(gguf_name: str) -> str | None:
    """The converted folder's name of a linear-layer weight; None for anything else."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def unpermute_rows(data: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of llama.cpp's q/k order back to Hugging Face's (what transformers' conversion does).

    Within each head of 2 * half rows, HF row a * half + j is GGUF row 2 * j + a.
    """
    half = data.shape[0] // num_heads // 2
    order = torch.arange(data.shape[0]).view(num_heads, half, 2).transpose(1, 2).reshape(-1)
    return data[order]


def linear_weights(gguf: Path, folder: Path, hf_config, qtypes: Iterable[str]) -> dict[str, RawTensor]:
    """`read_linear_weights`, kept in `folder` (the converted model) after the first read.

    GGUFReader parses all metadata, the vocabulary included: 12 s for the
    bundled file here, against a fraction of a second for the cached copy.
    """
    qtypes = sorted(set(qtypes))
    cached = folder / CACHE_FILE.with_name(f"{CACHE_FILE.stem}-{'-'.join(qtypes)}{CACHE_FILE.suffix}")
    if cached.is_file():
        return _load(cached)
    raw = read_linear_weights(gguf, hf_config, qtypes)
    _save(raw, cached)
    return raw


def _save(raw: dict[str, RawTensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".raw-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: r.data.contiguous() for k, r in raw.items()}, tmp, metadata={k: r.qtype for k, r in raw.items()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> dict[str, RawTensor]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        qtypes = f.metadata() or {}
        return {k: RawTensor(qtypes[k], f.get_tensor(k)) for k in f.keys()}


def read_linear_weights(path: Path, hf_config, qtypes: Iterable[str]) -> dict[str, RawTensor]:
    """The linear-layer weights of a GGUF file stored as one of `qtypes`, keyed by converted name."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    wanted, out = set(qtypes), {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or t.tensor_type.name not in wanted:
            continue
        data = torch.from_numpy(np.array(t.data)).view(int(t.shape[-1]), -1)  # (out_features, row)
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:
            data = unpermute_rows(data, heads[proj])
        out[name] = RawTensor(t.tensor_type.name, data)
    return out
