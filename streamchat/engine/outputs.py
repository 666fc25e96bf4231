"""Turning the engine's token events into text: one incremental detokenizer per response.

Owns the text side of a response, wherever the engine runs: the front of the
daemon (the core sends token ids only) and in-process callers (the LLM
class). Deltas never split a UTF-8 character and add up to the final text;
a stop string ends the text where it starts, and the engine is told the
token it was met at (`StopResponse`) so the context ends there too. A
response that asked for log-probabilities gets each token's with its text
and bytes (`TokenLogprob`), on the delta its text belongs to. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from streamchat.engine.events import NewTokens, ResponseFinished, TextDelta, TokenLogprob, TokenLogprobs
from streamchat.text.detok import IncrementalDetokenizer


@dataclass(frozen=True)
class Stop:
    """Tell the engine: the response ends at its token `num_tokens` (a stop string was met)."""

    session_id: str
    response_id: str
    num_tokens: int


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._detoks: dict[str, IncrementalDetokenizer] = {}

    def start(self, response_id: str, stop: tuple[str, ...] = ()) -> None:
        self._detoks[response_id] = IncrementalDetokenizer(self.tokenizer, stop)

    def tokens(self, ev: NewTokens) -> tuple[TextDelta | None, Stop | None]:
        """The text these tokens complete (with their logprobs, when asked), and a Stop when one of them met a
        stop string (the tokens after it are dropped)."""
        detok = self._detoks.get(ev.response_id)
        if detok is None or detok.stopped:
            return None, None  # not ours, or past its stop: the engine is cutting it off
        text, stop, num_taken = "", None, 0
        for token in ev.token_ids:
            text += detok.add(token)
            num_taken += 1
            if detok.stopped:
                stop = Stop(ev.session_id, ev.response_id, len(detok.ids))
                break
        logprobs = tuple(self._logprob(t, lp) for t, lp in zip(ev.token_ids[:num_taken], ev.logprobs))
        delta = TextDelta(ev.session_id, ev.response_id, text, logprobs) if text or logprobs else None
        return delta, stop

    def _logprob(self, token_id: int, logprobs: TokenLogprobs) -> TokenLogprob:
        top = tuple(self._entry(t, lp) for t, lp in logprobs.top)
        return TokenLogprob(token_id, *self._text_and_bytes(token_id), logprobs.logprob, top)

    def _entry(self, token_id: int, logprob: float) -> TokenLogprob:
        return TokenLogprob(token_id, *self._text_and_bytes(token_id), logprob)

    def _text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        token_bytes = getattr(self.tokenizer, "token_bytes", None)  # a transformers tokenizer (LLM) has none
        raw = token_bytes(token_id) if token_bytes else self.tokenizer.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), raw

    def finished(self, ev: ResponseFinished) -> tuple[TextDelta | None, ResponseFinished]:
        """The response's last text and the event with its whole text (a met stop: completed)."""
        detok = self._detoks.pop(ev.response_id, None)
        if detok is None:
            return None, ev
        rest = detok.flush()
        delta = TextDelta(ev.session_id, ev.response_id, rest) if rest else None
        if detok.stopped:
            ev = replace(ev, status="completed", reason=None, token_ids=ev.token_ids[:len(detok.ids)])
        return delta, replace(ev, text=detok.text)

    def forget(self, response_id: str) -> None:
        """No more text is wanted for this response (it never started, or its reader has gone)."""
        self._detoks.pop(response_id, None)

    def text_so_far(self, response_id: str) -> str:
        detok = self._detoks.get(response_id)
        return detok.text[:detok.emitted] if detok is not None else ""

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._detoks
