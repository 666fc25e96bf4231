"""Chat framing derived from the model's own chat template.

A session is one long token sequence; each item joins it once and history is
never re-rendered. So the framing of one message is taken as the difference
between the template rendered with and without it, behind a fixed probe
system message (templates such as SmolLM2's insert a default system prompt
when the first message is not one). Knows nothing about tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROBE = "\u2063probe\u2063"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Frame:
    prefix: str
    suffix: str


class ChatFormat:
    """Turns items into text the way the model's template frames them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.frames = {role: self._frame(role) for role in ROLES}
        self.generation_prompt = self._generation_prompt()
        bos = tokenizer("", add_special_tokens=True)["input_ids"]
        self.bos_ids: list[int] = list(bos)

    def _render(self, messages: list[dict], generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation)

    def _frame(self, role: str) -> Frame:
        base = [{"role": "system", "content": _PROBE}]
        marker = "\u2062MARK\u2062"
        full = self._render(base + [{"role": role, "content": marker}])
        head = self._render(base)
        if not full.startswith(head) or marker not in full:
            raise ValueError("the chat template is not prefix-stable; cannot frame items incrementally")
        prefix, suffix = full[len(head):].split(marker)
        return Frame(prefix, suffix)

    def _generation_prompt(self) -> str:
        base = [{"role": "system", "content": _PROBE}, {"role": "user", "content": "x"}]
        with_prompt = self._render(base, generation=True)
        return with_prompt[len(self._render(base)):]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def message(self, role: str, text: str) -> list[int]:
        frame = self.frames[role]
        return self.encode(frame.prefix + text + frame.suffix)

    def open_message(self, role: str) -> list[int]:
        return self.encode(self.frames[role].prefix)

    def close_message(self, role: str) -> list[int]:
        return self.encode(self.frames[role].suffix)

    def reply_prompt(self) -> list[int]:
        return self.encode(self.generation_prompt)

    def reply_end(self) -> list[int]:
        """What follows a finished reply's text (the end-of-turn marker and newline)."""
        return self.close_message("assistant")
