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

from tokenizers import Tokenizer

from streamchat.text.chat import ChatFormat, Frames


class FrontTokenizer:
    def __init__(self, tokenizer_json: str, frames: Frames) -> None:
        self._control = Tokenizer.from_str(tokenizer_json)
        self._text = Tokenizer.from_str(tokenizer_json)
        self._text.encode_special_tokens = True
        self.chat = ChatFormat(frames, self.encode_text, self.encode_control)

    def encode_text(self, text: str) -> list[int]:
        return self._text.encode(text, add_special_tokens=False).ids

    def encode_control(self, text: str) -> list[int]:
        return self._control.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces=False) -> str:
        # the IncrementalDetokenizer's call, as on a transformers tokenizer (no clean-up: deltas must add up)
        return self._control.decode(ids, skip_special_tokens=skip_special_tokens)


def export_tokenizer(hf_tokenizer) -> str:
    """A transformers fast tokenizer as the JSON `FrontTokenizer` loads."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("the model's tokenizer has no fast (tokenizers) form; the front needs one")
    return backend.to_str()
