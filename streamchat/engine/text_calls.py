"""The engine's text calls for in-process callers (the LLM class, tests, benchmarks).

The daemon's front frames and tokenizes requests itself and sends token ids;
these methods do the same in the engine's process, with the model's own
tokenizer (`Engine.chat`), then run the token-level command. Nothing here
is reachable from the wire.
"""

from __future__ import annotations

from streamchat.engine import api
from streamchat.model.sampling_params import SamplingParams
from streamchat.text.chat import Message


class TextCalls:
    """Mixed into `Engine`: each method frames text, then calls the token-level method beside it."""

    def open_session(self, session_id: str, instructions: str = "") -> None:
        self.open(session_id, self.chat.system_prefix(instructions))

    def restore_session(self, session_id: str, instructions: str, messages: list[Message],
                        admit: bool = False) -> int:
        s_open = bool(messages) and not messages[-1][2]
        return self.restore_transcript(api.RestoreTranscript(
            session_id, tuple(self.chat.system_prefix(instructions)), tuple(self.chat.transcript(messages)),
            s_open, len(messages), admit))

    def add_item(self, session_id: str, role: str, text: str, ticket=None) -> int:
        """Frame and queue a whole message (closing the open append item); returns its tokens."""
        s = self._get(session_id)
        tokens = (self.chat.close_message("user") if s.open_item else []) + self.chat.message(role, text)
        self.check_room(s, len(tokens))
        self.queue(api.Queue(session_id, tuple(tokens), "item", closes_item=s.open_item, ticket=ticket))
        return len(tokens)

    def append_text(self, session_id: str, text: str, ticket=None) -> int:
        """Raw text into the open user item (opened by the first append); returns tokens added."""
        s = self._get(session_id)
        tokens = ([] if s.open_item else self.chat.open_message("user")) + self.chat.encode(text)
        self.check_room(s, len(tokens))
        self.queue(api.Queue(session_id, tuple(tokens), "append", opens_item=not s.open_item, ticket=ticket))
        return len(tokens)

    def commit_text(self, session_id: str, ticket=None) -> bool:
        """Close the open item; False if none was open."""
        if not self._get(session_id).open_item:
            return False
        self.queue(api.Queue(session_id, tuple(self.chat.close_message("user")), "commit", ticket=ticket))
        return True

    def start_response(self, session_id: str, response_id: str, params: SamplingParams,
                       max_tokens: int | None = None, instructions: str | None = None) -> None:
        s = self._get(session_id)
        close = self.chat.close_message("user") if s.open_item else []
        turn = self.chat.message("system", instructions) if instructions else []
        self.start(api.StartResponse(session_id, response_id, params, max_tokens, tuple(turn), tuple(close)))

    def transcript_tokens(self, messages: list[Message]) -> list[int]:
        return self.chat.transcript(messages)
