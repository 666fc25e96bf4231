"""Chat framing derived from the model's own chat template.

A session is one long token sequence; each item joins it once and history is
never re-rendered. So the framing of one message is taken as the difference
between the template rendered with and without it, behind a fixed probe
system message (templates such as SmolLM2's insert a default system prompt
when the first message is not one).

`Frames` holds that framing as strings (plus the BOS ids): computed once where
the template can be rendered (the engine core, which has the model's
tokenizer), it crosses to the front, which frames and tokenizes requests.
`ChatFormat` turns items into token ids from frames and two encoders: one
for the template's control text, where special tokens act, and one for text
a user or a model wrote, where they are plain text, so a typed
`<|im_start|>system` is characters, never a turn. Knows nothing about tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_PROBE = "\u2063probe\u2063"
ROLES = ("system", "user", "assistant")

Encode = Callable[[str], list[int]]
Message = tuple[str, str, bool]  # (role, text, closed) of one transcript item, oldest first


@dataclass(frozen=True)
class Frames:
    """How the template frames each role's message, the reply prompt, and the BOS ids."""

    prefixes: dict[str, str]
    suffixes: dict[str, str]
    generation_prompt: str
    bos_ids: tuple[int, ...]

    @classmethod
    def from_template(cls, tokenizer) -> Frames:
        """Render a Hugging Face tokenizer's chat template into frames."""
        def render(messages: list[dict], generation: bool = False) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

        base = [{"role": "system", "content": _PROBE}]
        head = render(base)
        marker = "\u2062MARK\u2062"
        prefixes, suffixes = {}, {}
        for role in ROLES:
            full = render(base + [{"role": role, "content": marker}])
            if not full.startswith(head) or marker not in full:
                raise ValueError("the chat template is not prefix-stable; cannot frame items incrementally")
            prefixes[role], suffixes[role] = full[len(head):].split(marker)
        asked = base + [{"role": "user", "content": "x"}]
        generation_prompt = render(asked, generation=True)[len(render(asked)):]
        bos = tokenizer("", add_special_tokens=True)["input_ids"]
        return cls(prefixes, suffixes, generation_prompt, tuple(bos))


class ChatFormat:
    """Turns items into token ids the way the model's template frames them."""

    def __init__(self, frames: Frames, encode_text: Encode, encode_control: Encode) -> None:
        self.frames = frames
        self.encode = encode_text  # user and model text: special tokens are plain text
        self._control = encode_control
        self.bos_ids: list[int] = list(frames.bos_ids)
        self._reply_prompt = encode_control(frames.generation_prompt)

    @classmethod
    def of(cls, tokenizer) -> ChatFormat:
        """Frames and encoders from a Hugging Face tokenizer (in-process callers, the core)."""
        return cls(Frames.from_template(tokenizer), *hf_encoders(tokenizer))

    def message(self, role: str, text: str) -> list[int]:
        return self.open_message(role) + self.encode(text) + self.close_message(role)

    def open_message(self, role: str) -> list[int]:
        return self._control(self.frames.prefixes[role])

    def close_message(self, role: str) -> list[int]:
        return self._control(self.frames.suffixes[role])

    def reply_prompt(self) -> list[int]:
        return list(self._reply_prompt)

    def reply_end(self) -> list[int]:
        """What follows a finished reply's text (the end-of-turn marker and newline)."""
        return self.close_message("assistant")

    def system_prefix(self, instructions: str) -> list[int]:
        """The pinned head of a session: BOS, then the system prompt framed (if any)."""
        return self.bos_ids + (self.message("system", instructions) if instructions else [])

    def transcript(self, messages: tuple[Message, ...] | list[Message]) -> list[int]:
        """The context a transcript gives after the system prompt (an open item is left open)."""
        tokens: list[int] = []
        for role, text, closed in messages:
            tokens += self.message(role, text) if closed else self.open_message(role) + self.encode(text)
        return tokens


def hf_encoders(tokenizer) -> tuple[Encode, Encode]:
    """(plain text, control text) encoders over a Hugging Face tokenizer."""
    def text(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def control(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False)["input_ids"])

    return text, control
