"""Live sessions of the daemon: creation, settings, and the engine calls behind them, in tokens.

Owns the map of sessions the daemon holds (attached to sockets or idle),
their protocol-level state (instructions, open item, running response),
framing and tokenizing what clients send (the engine core sees token ids
only), and keeping the store and the engine in step: a session is stored on
its first item or update; every engine call for a session first makes sure
the session is in the engine core that runs now (after a core restart it
comes back from its checkpoint or transcript: `server.restore`). Knows
nothing about websockets or frames.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.model.sampling_params import SamplingParams, resolve_params
from streamchat.server.events import new_id, session_object
from streamchat.server.fleet import FencedStore, Fleet
from streamchat.server.protocol import SESSION_SAMPLING_FIELDS
from streamchat.server.restore import NOT_OPENED, Restorer, SessionNotFound, transcript_mark, transcript_messages
from streamchat.store import AsyncStore, hash_token, new_resume_token

log = logging.getLogger(__name__)

__all__ = ["Hub", "LiveSession", "SessionNotFound", "transcript_mark", "transcript_messages"]
OFF_LOOP_CHARS = 4096  # longer texts are tokenized on a worker thread, not the event loop
ENGINE_GONE = ("engine_restarting", "engine_unavailable")  # failures that leave no engine copy to mend


@dataclass
class LiveSession:
    id: str
    token_hash: str
    resume_token: str | None = None  # shown once, at creation
    instructions: str = ""
    max_output_tokens: int | str = "inf"
    sampling: dict = field(default_factory=dict)  # the session's own sampling defaults (session.update)
    stored: bool = False
    last_item_id: str | None = None
    open_item_id: str | None = None
    open_item_chars: int = 0  # characters appended to the open item by this daemon
    response_id: str | None = None
    response_owner: object = None  # the connection that asked for the running response
    response_over: asyncio.Event = field(default_factory=asyncio.Event)  # set when none runs
    attached: int = 0
    detached_at: float = 0.0  # when the last connection let go (monotonic)
    epoch: int = 0  # the engine core it is open in (CoreClient.epoch); older: it must come back first;
    # NOT_OPENED: in none yet (a connection's new session enters the engine with its first engine call)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def running(self, rid: str, owner) -> None:
        self.response_id, self.response_owner = rid, owner
        self.response_over.clear()

    def ended(self) -> None:
        self.response_id = self.response_owner = None
        self.response_over.set()


class Hub:
    """Every live session, shared by all connections of the daemon."""

    def __init__(self, engine, store: AsyncStore, model_name: str, cache_cfg,
                 model_defaults: SamplingParams, fleet: Fleet) -> None:
        self.engine = engine  # a CoreClient
        self.fleet = fleet
        self.store = FencedStore(store, fleet)  # writes for a session carry its lease epoch
        self.model_name = model_name
        self.cache_cfg = cache_cfg
        self.model_defaults = model_defaults  # what a field neither the response nor the session sets takes
        self.sessions: dict[str, LiveSession] = {}
        self.restore = Restorer(self)
        self.submit = engine.submit

    @property
    def chat(self):
        return self.engine.tokenizer.chat

    async def tokens(self, fn, *args) -> tuple[int, ...]:
        """`fn(*args)` (a ChatFormat call): on a worker thread when the text is long."""
        if sum(len(a) for a in args if isinstance(a, str)) > OFF_LOOP_CHARS:
            return tuple(await asyncio.to_thread(fn, *args))
        return tuple(fn(*args))

    async def instruction_tokens(self, fn, *args) -> tuple[int, ...]:
        """A system prompt framed by `fn`, refused `instructions_too_long` past the limit: by its length
        in characters before any tokenizing (a text longer than `limit` times the served vocabulary's
        longest token has more than `limit` tokens), then by its tokens (the engine checks again, and
        checks the pool)."""
        limit = self.cache_cfg.max_instructions_tokens
        chars = sum(len(a) for a in args if isinstance(a, str))
        if chars > limit * self.engine.tokenizer.max_token_chars:
            raise EngineError("instructions_too_long",
                              f"the instructions are {chars} characters, far more than the {limit} tokens "
                              "taken (--max-instructions-tokens); they were not read")
        tokens = await self.tokens(fn, *args)
        if len(tokens) > limit:
            raise EngineError("instructions_too_long",
                              f"the instructions are {len(tokens)} tokens with their framing; at most {limit} "
                              "are taken (--max-instructions-tokens)")
        return tokens

    def describe(self, s: LiveSession, with_token: bool = False) -> dict:
        return session_object(
            session_id=s.id, model=self.model_name, instructions=s.instructions,
            max_output_tokens=s.max_output_tokens, sampling=self.session_sampling(s),
            truncation={"sink_tokens": self.cache_cfg.sink_tokens,
                        "window_tokens": self.cache_cfg.window_tokens,
                        "block_size": self.cache_cfg.block_size},
            resume_token=s.resume_token if with_token else None)

    def session_sampling(self, s: LiveSession | None = None) -> dict:
        """A session's effective sampling defaults: its own over the model's (None: a new session's)."""
        params = resolve_params(self.model_defaults, s.sampling if s else {}, {})
        return {name: getattr(params, name) for name in SESSION_SAMPLING_FIELDS}

    def response_params(self, s: LiveSession, fields: dict) -> SamplingParams:
        """What one response samples with: its fields, else the session's, else the model's."""
        params = self._resolve(s.sampling, fields)
        try:
            return params.validate(self.vocab_size)
        except ValueError as exc:  # a logit_bias id past the vocabulary
            raise EngineError("invalid_event", f"response.{exc}") from None

    @property
    def vocab_size(self) -> int:
        return self.engine.tokenizer.vocab_size

    def _resolve(self, session_defaults: dict, fields: dict) -> SamplingParams:
        try:
            return resolve_params(self.model_defaults, session_defaults, fields)
        except ValueError as exc:
            raise EngineError("invalid_event", str(exc)) from None

    # -- sessions -----------------------------------------------------------------------

    async def create(self) -> LiveSession:
        """A new session for a connection; it enters the engine with its first engine call, so a
        connection that only resumes another session (or none) costs the engine nothing: an open and
        a close were two core round trips, about a third of the front's CPU for a bare connection."""
        token = new_resume_token()
        s = LiveSession(new_id("sess"), hash_token(token), token, epoch=NOT_OPENED)
        await self.engine.wait_ready()  # a connection made while the core restarts waits for it
        self.sessions[s.id] = s
        return s

    async def ensure_stored(self, s: LiveSession) -> None:
        """Store the session if it is not yet; it enters the engine first, so that a stored session has
        been opened (one that comes back after a core restart is rebuilt from the store)."""
        if not s.stored:
            await self.restore.ensure(s)
            await self.store.create_session(s.id, s.token_hash, s.instructions, self._settings(s))
            s.stored = True

    def _settings(self, s: LiveSession) -> dict:
        return {"max_output_tokens": s.max_output_tokens, "sampling": dict(s.sampling),
                "sink_tokens": self.cache_cfg.sink_tokens, "window_tokens": self.cache_cfg.window_tokens,
                "block_size": self.cache_cfg.block_size}

    async def update(self, s: LiveSession, instructions: str | None, max_output_tokens,
                     sampling: dict | None = None) -> None:
        """Stored first; then the engine takes the new prompt (rebuilt from the store if it fails).

        `sampling`: sampling defaults to set (SamplingParams names; others kept); a value
        out of range is `invalid_event` and changes nothing.
        """
        await self.restore.ensure(s)  # a new session enters the engine as it was made, before it changes
        new_instructions = instructions if instructions is not None else s.instructions
        new_max = max_output_tokens if max_output_tokens is not None else s.max_output_tokens
        new_sampling = {**s.sampling, **(sampling or {})}
        self._resolve(new_sampling, {})  # refuses a value out of range before anything changes
        prefix = await self.instruction_tokens(self.chat.system_prefix, new_instructions)
        old = (s.instructions, s.max_output_tokens, s.sampling)
        s.instructions, s.max_output_tokens, s.sampling = new_instructions, new_max, new_sampling
        try:
            if s.stored:
                await self.store.update_session(s.id, instructions=s.instructions, settings=self._settings(s))
            else:
                await self.ensure_stored(s)
        except BaseException:
            s.instructions, s.max_output_tokens, s.sampling = old
            raise
        if new_instructions != old[0]:
            await self.call(s, api.SetInstructions(s.id, prefix), rebuild_on_failure=True)

    # -- engine calls for a session -----------------------------------------------------

    async def call(self, s: LiveSession, cmd: api.Command, rebuild_on_failure: bool = False):
        """Run a command for `s` in the engine core that runs now (bringing `s` back into it first).

        `rebuild_on_failure`: the store already holds what the command adds, so if the engine
        refuses or fails it, the session is rebuilt from the store: its context never lacks
        what was acknowledged.
        """
        await self.restore.ensure(s)
        if not rebuild_on_failure:
            return await self.submit(cmd)
        try:
            return await self.submit(cmd)
        except EngineError as exc:
            # the core that failed it is gone: its successor opens `s` from the store on the next call
            if exc.code not in ENGINE_GONE:
                await self.restore.rebuild(s)
            raise
        except Exception:
            await self.restore.rebuild(s)
            raise

    async def item_tokens(self, s: LiveSession, role: str, text: str) -> tuple[int, ...]:
        """A whole message framed for the model; an open append item is closed first (the caller
        closes it in the store)."""
        return await self.tokens(self.chat.message, role, text)

    async def append_tokens(self, s: LiveSession, text: str, opens: bool) -> tuple[int, ...]:
        """Raw text for the open user item (framed open first when this append opens it)."""
        head = tuple(self.chat.open_message("user")) if opens else ()
        return head + await self.tokens(self.chat.encode, text)

    async def check_room(self, s: LiveSession, num_tokens: int) -> None:
        await self.call(s, api.CheckRoom(s.id, num_tokens))

    async def queue(self, s: LiveSession, tokens: tuple[int, ...], kind: str = "item", opens: bool = False,
                    closes: bool = False, want_ticket: bool = False) -> tuple[int, asyncio.Future | None]:
        """Queue work the store already holds: (context after it, a future done once it is in the
        cache, if asked for)."""
        ticket, fut = self.engine.new_ticket() if want_ticket else (None, None)
        try:
            context = await self.call(s, api.Queue(s.id, tokens, kind, opens, closes, ticket),
                                      rebuild_on_failure=True)
        except BaseException:
            if ticket is not None:
                self.engine.forget_ticket(ticket)
                if not fut.cancel():  # a core's death failed it already: seen here, not logged as lost
                    fut.exception()
            raise
        return context, fut

    async def start_response(self, s: LiveSession, cmd: api.StartResponse, stop: tuple[str, ...]) -> asyncio.Queue:
        """Start a reply; the queue of its TextDelta events and its ResponseFinished.

        The caller closes the stream (`engine.close_stream`) when it is done with it.
        """
        await self.restore.ensure(s)
        stream = self.engine.open_stream(cmd.response_id, s.id, stop)
        try:
            await self.submit(cmd)
        except BaseException:
            self.engine.close_stream(cmd.response_id)
            raise
        return stream

    async def turn_tokens(self, s: LiveSession, instructions: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(this turn's framed instructions, the tokens closing the open append item)."""
        turn = await self.instruction_tokens(self.chat.message, "system", instructions) if instructions else ()
        close = tuple(self.chat.close_message("user")) if s.open_item_id is not None else ()
        return turn, close

    @asynccontextmanager
    async def ephemeral(self, instructions: str, messages: tuple[api.Message, ...]):
        """A session for one stateless request (the HTTP API): built from the messages the
        client sent, its id yielded, closed on exit. Never stored: the client holds the
        conversation, and the prefix cache, not a transcript, makes its next request cheap.
        Refused `overloaded` past the daemon's pending limit."""
        session_id = new_id("http")
        prefix = await self.instruction_tokens(self.chat.system_prefix, instructions)
        body = await self._transcript(messages)
        await self.submit(api.RestoreTranscript(session_id, prefix, body, False, len(messages), admit=True))
        try:
            yield session_id
        finally:
            try:
                await self.submit(api.CloseSession(session_id))
            except EngineError as exc:
                log.debug("the stateless session %s was not closed: %s", session_id, exc)

    async def _transcript(self, messages) -> tuple[int, ...]:
        if sum(len(m[1]) for m in messages) > OFF_LOOP_CHARS:
            return tuple(await asyncio.to_thread(self.chat.transcript, messages))
        return tuple(self.chat.transcript(messages))

    async def detach(self, s: LiveSession) -> None:
        """A connection let go of the session; an unstored session with nobody left is dropped."""
        s.attached -= 1
        s.detached_at = time.monotonic()
        if s.attached <= 0 and not s.stored:
            self.sessions.pop(s.id, None)
            if s.epoch == NOT_OPENED:
                return
            try:
                await self.submit(api.CloseSession(s.id))
            except EngineError as exc:
                log.debug("session %s was not closed in the engine: %s", s.id, exc)
