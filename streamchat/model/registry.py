"""Which model class serves which architecture: config.json's `model_type` picks it.

Owns the table of supported architectures and the refusal of any other,
at start-up, naming the supported ones. Torch-free: a class is named by its
module and imported only when chosen. A new architecture adds a row here,
a model class (with its layers' KV specs, `kv_spec`), and nothing else.
"""

from __future__ import annotations

import importlib

from streamchat.config import ConfigError

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
ARCHITECTURES = {
    **dict.fromkeys(LLAMA_FAMILY, "streamchat.model.llama:LlamaModel"),
    "deepseek_v2": "streamchat.model.deepseek:DeepseekModel",
    "deepseek_v3": "streamchat.model.deepseek:DeepseekModel",
}
SUPPORTED = tuple(sorted(ARCHITECTURES))


class UnsupportedArchitecture(ConfigError):
    """A model folder whose config.json names an architecture no class here serves."""


def check(model_type, where) -> None:
    """Refuse (a ConfigError) a `model_type` no class serves; `where` names the folder."""
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitecture(f"{where} holds a {model_type!r} model; supported: {', '.join(SUPPORTED)}")


def model_class(model_type: str) -> type:
    """The class that serves `model_type` (checked first)."""
    check(model_type, "the model folder")
    module, name = ARCHITECTURES[model_type].split(":")
    return getattr(importlib.import_module(module), name)
