"""The model runner: loads a model, owns the KV pool tensors, executes step batches.

The one module that turns the scheduler's lists into tensors. Knows nothing
about scheduling or sessions: it is handed a `StepBatch` and returns logits.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from streamchat.config import CacheConfig, ConfigError, ModelConfig
from streamchat.model.batch import StepBatch
from streamchat.model.attention import AttentionMetadata, DecodeGroup, PrefillGroup, make_backend
from streamchat.model import card, kv_spec, registry, weights_auto
from streamchat.model.llama import load_state
from streamchat.model.loader import ModelLoadError, ModelSource, default_cache_dir, resolve
from streamchat.model.static_decode import StaticDecode
from streamchat.model.weights import GGUF_GROUPS, LinearBuilder, check_device, served_source
from streamchat.text.chat import Frames

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 matrix products run natively."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


@dataclass
class LoadedModel:
    source: ModelSource  # its fingerprint names the weights as served (format included)
    hf_config: object
    tokenizer: object
    model: object  # the registry's class for its model_type (LlamaModel, DeepseekModel)
    weights: str = "bf16"  # the served weight format (auto resolved)


def load_model(cfg: ModelConfig, measure=None, use_card: bool = False) -> LoadedModel:
    """Resolve, read and place the model the config names, its weights in the configured format.

    `measure(build, tokenizer)`: how `--weights auto` measures the formats when no earlier decision is
    cached (`streamchat.autotune.measure_weights`); without it, auto refuses to measure. `use_card`
    (the engine core): config and tokenizer from the model's cached card (`model/card.py`) when there
    is one, else read through transformers and the card written; the tokenizer is then the
    `tokenizers`-only one, not transformers'.
    """
    device = pick_device(cfg.device)
    check_device(cfg.weights, device)  # before anything slow
    source = resolve(cfg.path, cfg.cache_dir)
    dtype = pick_dtype(cfg.dtype, device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    card_file = card.card_path(Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(), source.folder,
                               source.fingerprint) if use_card else None  # stats the folder's files
    hf_config, tokenizer = _config_and_tokenizer(source, card_file, use_card)
    backend = make_backend(cfg.attention_backend, device)
    model_class = registry.model_class(hf_config.model_type)
    state, raw = load_state(source.folder), _gguf_raw(source, hf_config, cfg.weights, device, dtype)

    def build(weights: str) -> LoadedModel:
        checked = use_card and card.blocks_checked(card_file, weights)
        make = LinearBuilder(weights, raw, activations=cfg.decode_activations, checked=checked)
        model = model_class(hf_config, state, dtype, device, backend, make)
        if use_card and not checked and raw and not make.mismatches:
            card.mark_blocks_checked(card_file, weights)
        return LoadedModel(served_source(source, weights, cfg.decode_activations), hf_config, tokenizer, model, weights)

    weights = cfg.weights
    if weights == "auto":
        weights = _auto(cfg, source, device, dtype, lambda: _measured(measure, build, tokenizer))
    loaded = build(weights)
    del state, raw, build
    _return_freed_memory()
    log.debug("loaded %s (%s, %s weights, %s, %s attention)", source.name, dtype, weights, device, backend.name)
    return loaded


def _return_freed_memory() -> None:
    """Give the memory freed while loading (the file's tensors, dense weights once reordered) back to the
    system: glibc keeps freed heap memory for reuse, and the bundled model's process held 140-210 MB more
    than it used (RSS 1,087 -> 876 MB in bf16). Nothing where malloc_trim is missing (not glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _config_and_tokenizer(source: ModelSource, path: Path | None, use_card: bool):
    found = card.read(path) if use_card else None
    if found is not None:
        return found
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(source.folder)
        tokenizer = AutoTokenizer.from_pretrained(source.folder)
    except Exception as exc:
        raise ModelLoadError(f"cannot read model folder {source.folder}: {exc}") from exc
    if tokenizer.chat_template is None:
        raise ModelLoadError(f"{source.folder} has no chat template; streamchat serves chat models")
    if not use_card:
        return hf_config, tokenizer
    from streamchat.text.tokenizer import export_tokenizer

    tokenizer_json, frames = export_tokenizer(tokenizer), Frames.from_template(tokenizer)
    card.write(path, hf_config, tokenizer_json, frames, tokenizer.eos_token_id)
    return hf_config, card.CardTokenizer(tokenizer_json, frames, tokenizer.eos_token_id)


def _gguf_raw(source: ModelSource, hf_config, weights: str, device: torch.device, dtype: torch.dtype):
    """The GGUF's stored tensors when a format may use its blocks (int4; dense on CPU in float32 or
    bfloat16, for decode rows); None otherwise."""
    from streamchat.kernels import cpu

    dense_groups = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu.library() is not None
    if source.gguf is None or not (weights in ("int4", "auto") or dense_groups):
        return None
    if hf_config.model_type not in registry.LLAMA_FAMILY:  # gguf_raw knows the Llama family's tensor names only
        return None
    from streamchat.model.gguf_raw import linear_weights

    return linear_weights(source.gguf, source.folder, hf_config, GGUF_GROUPS)


def _auto(cfg: ModelConfig, source: ModelSource, device, dtype, measure) -> str:
    """auto's format: cached beside the converted models, else measured on the shipped text."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    path = weights_auto.decision_path(cache_dir, source.fingerprint, device, dtype)
    return weights_auto.choose(path, device, measure)


def _measured(measure, build, tokenizer):
    if measure is None:
        raise ConfigError("--weights auto has no decision cached for this model and this caller cannot measure "
                          "one; run `streamchat serve` or `streamchat eval` with --weights auto once")
    return measure(build, tokenizer)


AUTO_KV_SHARE = 8  # --kv-memory-gib 0: an eighth of the device's memory ...
AUTO_KV_MIN_GIB = 1.0  # ... but at least this


def auto_kv_bytes(device: torch.device) -> int:
    """The pool's size when none is given: an eighth of the machine's memory (CPU) or of the GPU's
    (CUDA), at least 1 GiB. A fixed 1 GiB held 16 sessions of a 2,048-token window in bfloat16 but
    not in float32 (a CPU without bf16 arithmetic): 1,456 blocks for 2,100 needed, so sessions took
    turns in the pool and 16 long chats decoded at a third of the rate they do when all fit."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(int(AUTO_KV_MIN_GIB * (1 << 30)), total // AUTO_KV_SHARE)


def num_blocks_for(cache: CacheConfig, bytes_per_token: int, device: torch.device) -> int:
    if cache.num_blocks:
        return cache.num_blocks
    size = int(cache.kv_memory_gib * (1 << 30)) if cache.kv_memory_gib else auto_kv_bytes(device)
    return max(2, size // (bytes_per_token * cache.block_size))


class ModelRunner:
    """Owns the per-layer pool tensors, laid out by the model's per-layer KV specs (`kv_spec`), and the
    static decode inputs (`StaticDecode`: replayed as CUDA graphs on CUDA with the Triton backend)."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig, max_batch: int = 64,
                 cuda_graphs: bool = True, kv_dtype_reason: str | None = None) -> None:
        """max_batch: the most decode rows the static buffers (and the largest graph) hold; bigger
        steps, and steps with prefill, take the plain path. cuda_graphs: off, or ignored off CUDA.
        kv_dtype_reason: why the pool stores cache.kv_dtype (streamchat.autotune.resolve_kv_dtype)."""
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = cache.block_size
        self.kv_dtype = cache.kv_dtype  # a name: float, int8, fp8, int4 (auto, unresolved: float's storage)
        self.kv_dtype_reason = kv_dtype_reason or (
            "auto, not measured by this caller: the model's dtype" if cache.kv_dtype == "auto" else "as configured")
        if cache.kv_dtype == "int4" and self.model.backend.name == "triton":
            raise ConfigError("--kv-dtype int4 runs on the torch (or cpu) attention backend only, not triton")
        try:
            self.kv_specs = self.model.kv_specs(cache.block_size, cache.kv_dtype)  # one per layer
            for spec in self.kv_specs:
                spec.tensors()  # raises for a storage format the layer's shape does not take
        except ValueError as exc:
            raise ConfigError(f"--kv-dtype {cache.kv_dtype}: {exc}") from None
        self.bytes_per_token = kv_spec.bytes_per_token(self.kv_specs)
        self.num_blocks = num_blocks_for(cache, self.bytes_per_token, self.model.device)
        self.kv_caches = [spec.allocate(self.num_blocks, self.model.device) for spec in self.kv_specs]
        graphs = (cuda_graphs and self.model.device.type == "cuda" and self.model.backend.name == "triton"
                  and self.model.captures_graphs)
        self.static = StaticDecode(self.model, self.kv_caches, self.block_size, max_batch,
                                   cache.max_blocks_per_session(), graphs)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def execute(self, batch: StepBatch) -> torch.Tensor | None:
        """Run one step; float32 logits (N, vocab) for the chunks that want them, in order.

        Decode-only steps go through the static buffers; their logits (a graph's output on CUDA) are
        valid until the next step.
        """
        if self.static.fits(batch):
            return self.static.run(batch)
        ids, positions, meta, logits_idx = self.prepare(batch)
        return self.model.forward(ids, positions, meta, self.kv_caches, logits_idx)

    def execute_with_mass(self, batch: StepBatch) -> tuple[torch.Tensor | None, list[list[float]]]:
        """`execute`, and each chunk's attention mass per table index (the h2o scores' input):
        probabilities summed over heads, layers and the chunk's queries, divided by heads x layers,
        so each query token adds 1 in all. Torch attention backend only."""
        ids, positions, meta, logits_idx = self.prepare(batch)
        chunks = batch.chunks()
        width = max(len(c.block_ids) for c in chunks)
        mass = torch.zeros(len(chunks), width, dtype=torch.float32, device=self.model.device)
        logits = self.model.forward(ids, positions, meta, self.kv_caches, logits_idx, mass)
        s = self.model.shape
        rows = mass.div_(s.num_heads * s.num_layers).tolist()
        return logits, [row[:len(c.block_ids)] for row, c in zip(rows, chunks)]

    def prepare(self, batch: StepBatch):
        dev = self.model.device
        chunks = batch.chunks()
        flat_ids = [t for c in chunks for t in c.token_ids]
        flat_pos = [p for c in chunks for p in c.positions]
        flat_slots = [s for c in chunks for s in c.slots]
        ends, total = [], 0
        for c in chunks:
            total += len(c.token_ids)
            ends.append(total - 1)
        logits_rows = [end for c, end in zip(chunks, ends) if c.want_logits]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(flat_slots, dtype=torch.int64, device=dev),
            block_size=self.block_size,
            decode=self._decode_group(batch) if batch.decode else None,
            prefill=self._prefill_group(batch) if batch.prefill else None,
        )
        logits_idx = torch.tensor(logits_rows, dtype=torch.int64, device=dev) if logits_rows else None
        return (torch.tensor(flat_ids, dtype=torch.int64, device=dev),
                torch.tensor(flat_pos, dtype=torch.int64, device=dev), meta, logits_idx)

    def _tables(self, chunks) -> torch.Tensor:
        width = max(len(c.block_ids) for c in chunks)
        rows = [c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks]
        return torch.tensor(rows, dtype=torch.int32, device=self.model.device)

    def _decode_group(self, batch: StepBatch) -> DecodeGroup:
        lens = [c.seq_len for c in batch.decode]
        return DecodeGroup(self._tables(batch.decode),
                           torch.tensor(lens, dtype=torch.int32, device=self.model.device))

    def _prefill_group(self, batch: StepBatch) -> PrefillGroup:
        query_lens = [len(c.token_ids) for c in batch.prefill]
        key_lens = [c.seq_len for c in batch.prefill]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        dev = self.model.device
        return PrefillGroup(torch.tensor(cu, dtype=torch.int32, device=dev), self._tables(batch.prefill),
                            torch.tensor(key_lens, dtype=torch.int32, device=dev), query_lens, key_lens)

