"""A model's card: what an engine core needs of a checkpoint besides its weights, cached so that a core's
start does not import transformers.

The config's values, the tokenizer as the JSON of its fast form, the chat
frames rendered from the template and the end-of-sequence id are read once
through transformers (whose import is 2-3 s of a daemon's ~8 s start on a
2-core machine) and written as one private JSON file under the model cache,
keyed by the weights' fingerprint and by the name, size and mtime of every
other file in the folder (config, tokenizer, chat template), so an edited
template or config is read afresh. A core (re)start with a card builds its
config view and a `tokenizers`-only tokenizer from it.

Only plain rotary configs use a card: other rope types are computed by
transformers' own initialisers, which want its config class.

Beside a card, a `.<weights>.checked` mark records that a load in that
weight format found every GGUF block the CPU kernels multiply with decoding
exactly to its converted weight, so later loads skip that comparison (a full
pass over the weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

from streamchat import private_files
from streamchat.text.chat import Frames
from streamchat.text.tokenizer import FrontTokenizer

log = logging.getLogger(__name__)

VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


class CardConfig(SimpleNamespace):
    """A config's values as attributes, as transformers' config class resolved them."""

    def to_dict(self) -> dict:
        return dict(vars(self))


class CardTokenizer(FrontTokenizer):
    """The front's tokenizer plus what the core reads of a transformers tokenizer."""

    def __init__(self, tokenizer_json: str, frames: Frames, eos_token_id: int | None) -> None:
        super().__init__(tokenizer_json, frames)
        self.tokenizer_json = tokenizer_json
        self.eos_token_id = eos_token_id
        self.chat_template = True  # a card is written only for a model with one

    def __call__(self, text: str, **_) -> dict:
        """`tokenizer(text)["input_ids"]`, as the corpus reader calls a transformers tokenizer."""
        return {"input_ids": self.encode_text(text)}


def plain_rope(config: dict) -> bool:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return params.get("rope_type", params.get("type", "default")) == "default"


def card_path(cache_dir: Path, folder: Path, fingerprint: str) -> Path:
    parts = [f"v{VERSION}", fingerprint, str(folder.resolve())]
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    return cache_dir / "cards" / f"{digest}.json"


def read(path: Path) -> tuple[CardConfig, CardTokenizer] | None:
    """The card at `path`, or None when there is none or it cannot be trusted or read (then the checkpoint
    is read through transformers and the card written anew)."""
    if not path.is_file():
        return None
    why = private_files.distrust(path)
    if why is not None:
        log.warning("model card not used: %s", why)
        return None
    try:
        card = json.loads(path.read_bytes())
        frames = Frames(**{**card["frames"], "bos_ids": tuple(card["frames"]["bos_ids"])})
        tokenizer = CardTokenizer(card["tokenizer_json"], frames, card["eos_token_id"])
        return CardConfig(**card["config"]), tokenizer
    except Exception as exc:  # a card of any wrong shape (tokenizers raises a bare Exception)
        log.warning("model card %s not used: %s", path, exc)
        return None


def write(path: Path, hf_config, tokenizer_json: str, frames: Frames, eos_token_id: int | None) -> None:
    """The card for a checkpoint just read through transformers (best effort: a failure is logged)."""
    config = hf_config.to_dict()
    if not plain_rope(config):
        return
    card = {"config": config, "tokenizer_json": tokenizer_json, "frames": dataclasses.asdict(frames),
            "eos_token_id": eos_token_id}
    try:
        private_files.private_dir(path.parent)
        private_files.write_private(path, json.dumps(card).encode())
    except OSError as exc:
        log.warning("model card %s not written: %s", path, exc)


def blocks_checked(path: Path, weights: str) -> bool:
    mark = path.with_suffix(f".{weights}.checked")
    return mark.is_file() and private_files.distrust(mark) is None


def mark_blocks_checked(path: Path, weights: str) -> None:
    """After a load in `weights` format found every block it compared equal to its weight."""
    try:
        private_files.private_dir(path.parent)
        private_files.write_private(path.with_suffix(f".{weights}.checked"), b"")
    except OSError as exc:
        log.warning("model card mark %s not written: %s", path, exc)
