"""Incremental detokenizing: text deltas that never split a UTF-8 character.

Owns turning a growing list of token ids into deltas whose concatenation is
exactly the final text, and holding back text that a stop string might
still claim. Knows nothing about tensors or sessions.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get the new text each one completes."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._prefix = 0  # ids before this are settled text
        self._read = 0  # ids before this have been turned into text
        self.text = ""  # all text decoded so far (emitted + held back)
        self.emitted = 0  # chars of self.text already returned as deltas
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now safe to emit (maybe "")."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return self._release(final=False)  # an incomplete UTF-8 character: wait
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def _release(self, final: bool) -> str:
        if not self.stopped:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                final = True
        hold = 0 if final else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _find_stop(self) -> int | None:
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def flush(self) -> str:
        """The rest of the text, held-back and incomplete characters included."""
        if not self.stopped:
            rest = self._decode(self.ids[self._prefix:])
            done = self._decode(self.ids[self._prefix:self._read])
            self.text += rest[len(done):]
            self._read = len(self.ids)
        return self._release(final=True)
