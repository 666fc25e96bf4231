"""What the engine takes in: every request's tokens counted against the limits before they queue.

Mixed into `Engine`. A session's queued tokens count against its own limit
and, with every other active session's, against the daemon's; a system
prompt (the pinned prefix, or one turn's instructions) counts like any other
work, and one longer than `--max-instructions-tokens`, or whose pinned
blocks would leave the pool no room for a window, is refused outright: it
would otherwise sit pinned in every step's way, or never fit at all.
"""

from __future__ import annotations

from streamchat.engine.session import EngineSession
from streamchat.engine.api import EngineError


class Admission:
    def check_room(self, s: EngineSession, num_tokens: int) -> None:
        lim = self.sched_cfg
        if s.queued_tokens + num_tokens > lim.max_pending_tokens_per_session:
            raise EngineError("pending_limit_exceeded",
                              f"this session already has {s.queued_tokens} tokens waiting to enter the cache; "
                              f"at most {lim.max_pending_tokens_per_session} may wait; "
                              f"send more after conversation.item.done")
        self._check_load(num_tokens)

    def _check_load(self, num_tokens: int) -> None:
        total = sum(v.queued_tokens for v in self.scheduler.active.values())  # idle sessions queue nothing
        if total + num_tokens > self.sched_cfg.max_pending_tokens:
            raise EngineError("overloaded", f"the daemon has {total} tokens waiting to enter the cache; "
                                            f"retry later")

    def check_instructions(self, num_tokens: int, pinned: bool) -> None:
        """Refuse a system prompt of `num_tokens` (framed) over the limit, or, `pinned`, one whose
        sink region plus a window cannot fit the pool."""
        cache = self.cache_cfg
        if num_tokens > cache.max_instructions_tokens:
            raise EngineError("instructions_too_long",
                              f"the instructions are {num_tokens} tokens with their framing; at most "
                              f"{cache.max_instructions_tokens} are taken (--max-instructions-tokens)")
        need = cache.max_blocks_per_session(num_tokens) if pinned and cache.pin_system_prompt else 0
        if need > self.pool.num_usable:
            raise EngineError("instructions_too_long",
                              f"pinned instructions of {num_tokens} tokens plus a window need {need} KV blocks; "
                              f"the pool has {self.pool.num_usable}")
