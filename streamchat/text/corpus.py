"""The shipped text (Botchan) and cutting a text into a token slice: what evaluations and measurements read.

Torch-free; knows nothing of models but their tokenizer's call.
"""

from __future__ import annotations

import logging
from pathlib import Path

from streamchat.config import ConfigError

log = logging.getLogger(__name__)

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "botchan.txt"


def read_text(path: str | None) -> str:
    """The text to evaluate (the shipped botchan.txt when `path` is None); never empty."""
    p = Path(path) if path else DEFAULT_TEXT
    try:
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError(f"text file not found: {p}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"text file is not UTF-8: {p}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read text file {p}: {exc.strerror}") from None
    if not text.strip():
        raise ConfigError(f"text file is empty: {p}")
    return text


def tokenize(tokenizer, text: str, num_tokens: int) -> list[int]:
    ids = tokenizer(text, verbose=False)["input_ids"][:num_tokens]
    if len(ids) < 2:
        raise ConfigError(f"the text has {len(ids)} token(s); at least 2 are needed")
    if len(ids) < num_tokens:
        log.warning("the text has only %d tokens; evaluating all of them", len(ids))
    return ids
