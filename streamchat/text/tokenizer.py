"""The front's tokenizer: the model's fast tokenizer through the `tokenizers` library alone.

The front frames, tokenizes and detokenizes; the engine core only sees ids.
`tokenizers` (the Rust library under transformers' fast tokenizers) needs
neither torch nor transformers, so the front process stays small and starts
fast. The core exports its tokenizer as JSON (`export_tokenizer`); the front
builds two instances from it: one where special tokens in the text act
(the template's control text) and one where they are plain characters
(everything a user or a model wrote). Their ids equal the core's
`hf_encoders` for the same text (tested).
"""

from __future__ import annotations

import functools
import re

from tokenizers import Tokenizer

from streamchat.text.chat import ChatFormat, Frames

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the others for 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + n)) for n, b in enumerate(extra))
    return {c: b for b, c in chars.items()}


class FrontTokenizer:
    def __init__(self, tokenizer_json: str, frames: Frames) -> None:
        self._control = Tokenizer.from_str(tokenizer_json)
        self._text = Tokenizer.from_str(tokenizer_json)
        self._text.encode_special_tokens = True
        self.chat = ChatFormat(frames, self.encode_text, self.encode_control)
        # no token covers more characters of text than its piece has (a byte-level piece has one per byte,
        # a byte-fallback piece six for one): a text longer than n times this has more than n tokens
        self.max_token_chars = max(map(len, self._control.get_vocab(with_added_tokens=True)), default=1)

    def encode_text(self, text: str) -> list[int]:
        return self._text.encode(text, add_special_tokens=False).ids

    def encode_control(self, text: str) -> list[int]:
        return self._control.encode(text, add_special_tokens=False).ids

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 below this (added tokens included)."""
        return self._control.get_vocab_size(with_added_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, a part of a UTF-8 character included (what logprobs report).

        Byte-level vocabularies (GPT-2's alphabet) map back exactly; a
        SentencePiece byte token (<0xE2>) is its byte; any other token is
        its decoded text.
        """
        piece = self._control.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self._control.decoder).__name__ == "ByteLevel":
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return self._control.decode([token_id], skip_special_tokens=False).encode()

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces=False) -> str:
        # the IncrementalDetokenizer's call, as on a transformers tokenizer (no clean-up: deltas must add up)
        return self._control.decode(ids, skip_special_tokens=skip_special_tokens)


def export_tokenizer(hf_tokenizer) -> str:
    """A transformers fast tokenizer (or a model card's) as the JSON `FrontTokenizer` loads."""
    if isinstance(getattr(hf_tokenizer, "tokenizer_json", None), str):
        return hf_tokenizer.tokenizer_json
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("the model's tokenizer has no fast (tokenizers) form; the front needs one")
    return backend.to_str()
