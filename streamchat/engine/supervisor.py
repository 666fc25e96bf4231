"""Keeping an engine core alive: start it, watch it, restart it when it dies, give up when it keeps dying.

Owns the life of the front's engine core and the two zmq sockets to it
(commands out, outputs in; fresh ones for every start, so nothing queued for
a dead core reaches the next). A core's exit is seen at once (its sentinel);
a core silent past `heartbeat_s` is killed. Either way what was in flight
fails (`fail_in_flight`, the client's), `epoch` advances and the core is
started again, unless it died more than `max_restarts` times within
`restart_window_s`: then `fatal` is set and `on_fatal` tells the daemon to
exit non-zero for its own supervisor. Runs on the event loop; imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from streamchat.engine import launch, outreader, wire
from streamchat.engine.api import EngineSnapshot

log = logging.getLogger(__name__)

SEND_WAIT_S = 1.0  # a core that takes no command for this long has died (its restart fails what was sent)
KILLED_WAIT_S = 0.5  # how long a shutdown waits for a killed core to be reaped before leaving it to init


@dataclass(frozen=True)
class Supervision:
    heartbeat_s: float = 10.0  # a core silent this long is hung: killed and restarted
    start_timeout_s: float = 600.0  # a first start may convert the bundled model (about 20 s)
    max_restarts: int = 5  # deaths within the window before the daemon gives up
    restart_window_s: float = 300.0


class CoreSupervisor:
    def __init__(self, config, supervision: Supervision, log_level: str, log_format: str, engine=None) -> None:
        """`engine`: run the core in a thread around this engine (tests, benches), not a process."""
        self.config = config
        self.sup = supervision
        self._log = (log_level, log_format)
        self._engine = engine
        self.ctx = zmq.asyncio.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # or a GC'd context holding a dead core's command blocks in term()
        self._dir = tempfile.mkdtemp(prefix="streamchat-core-")  # private (0700): the sockets live here
        self.info: wire.CoreInfo | None = None
        self.snapshot = EngineSnapshot()
        self.epoch = 0  # advances with every core start: sessions opened in an older one are gone
        self.fatal: str | None = None  # why the engine cannot go on; None while it can
        self.on_fatal: Callable[[str], None] | None = None
        self._ready = asyncio.Event()
        self._deaths: deque[float] = deque()
        self._proc = None
        self._socks: tuple | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_heard = time.monotonic()
        self._last_word = ""  # the core's own last fatal report
        self._stopping = False

    # the client's part
    def on_ready(self, info: wire.CoreInfo) -> None: ...
    def take(self, kind: bytes, body: bytes) -> None: ...
    def fail_in_flight(self, code: str, message: str) -> None: ...

    async def start(self) -> wire.CoreInfo:
        """Start the core and wait until it serves; ConfigError (a setting or the model is wrong)
        or RuntimeError with the core's reason if it cannot."""
        reason = await self._spawn()
        if reason is not None:
            from streamchat.config import ConfigError

            kind, message = reason
            raise (ConfigError if kind == "config" else RuntimeError)(message)
        self._own(self._watch())
        return self.info

    async def _spawn(self) -> tuple[str, str] | None:
        """Start a core and wait for its `ready`; None, or (kind, why) it did not start."""
        self._ready.clear()
        self.epoch += 1
        self._close_sockets()
        tag = f"{self.epoch}-{os.getpid()}"
        cmd, out = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        addresses = (f"ipc://{self._dir}/cmd-{tag}", f"ipc://{self._dir}/out-{tag}")
        for sock, address in zip((cmd, out), addresses):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
        self._socks = (cmd, out)
        if self._engine is not None:
            proc = launch.ThreadCore(self._engine, self.config, addresses)
        else:  # from the event loop's thread: the core's parent-death signal follows this thread
            proc = launch.spawn_process(self.config, addresses, *self._log)
        self._proc = proc
        kind, body = await self._first_message(proc, out)
        if kind != wire.READY:
            self._kill()
            return body
        self.info = wire.decode_info(body)
        self.snapshot = self.info.snapshot
        self.on_ready(self.info)
        self._last_heard = time.monotonic()
        ended = asyncio.Event()
        asyncio.get_running_loop().add_reader(proc.sentinel, ended.set)
        self._own(self._read(out, proc, self.epoch, ended))
        self._ready.set()
        log.info("engine core %d serving (start %d)", proc.pid, self.epoch)
        return None

    async def _first_message(self, proc, out) -> tuple[bytes, bytes | tuple[str, str]]:
        """(READY, its body), or (FATAL, (kind, why not)): the core's word, its death, or the timeout."""
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(proc.sentinel, lambda: died.done() or died.set_result(None))

        async def said():
            while True:
                frames = await out.recv_multipart()
                if frames[0] in (wire.READY, wire.FATAL):
                    return frames[0], frames[1]

        heard = loop.create_task(said())
        try:
            await asyncio.wait({heard, died}, timeout=self.sup.start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(proc.sentinel)
        if heard.done():
            kind, body = heard.result()
            return kind, body if kind == wire.READY else wire.decode_fatal(body)
        heard.cancel()
        if died.done():
            proc.join(1.0)
            return wire.FATAL, ("error", f"the engine core exited while starting (exit code {proc.exitcode})")
        return wire.FATAL, ("error", f"the engine core did not start within {self.sup.start_timeout_s:g} s")

    async def _read(self, sock, proc, epoch: int, ended: asyncio.Event) -> None:
        """Take the core's messages until it has ended and said all it had to say."""
        await outreader.read_until_ended(sock, ended, self._heard)
        self._exited(proc, epoch)

    def _heard(self, frames: list[bytes]) -> None:
        self._last_heard = time.monotonic()
        if frames[0] == wire.FATAL:
            self._last_word = wire.decode_fatal(frames[1])[1]
            log.error("the engine core reports: %s", self._last_word)
        elif frames[0] != wire.BEAT:
            try:
                self.take(frames[0], frames[1])
            except Exception:  # noqa: BLE001 - a bad message must not stop the reading
                log.exception("could not take an output of the engine core")

    async def send(self, frames: list[bytes]) -> bool:
        """Hand `frames` to the core that runs now; False if it takes none within SEND_WAIT_S.

        Never waits on the socket itself: a dead core's socket would hold a send until the
        restart closes it, and the close cancels it (a CancelledError in a task nobody cancelled).
        """
        socks = self._socks
        deadline = time.monotonic() + SEND_WAIT_S
        while socks is not None and socks is self._socks:
            try:
                await socks[0].send_multipart(frames, flags=zmq.NOBLOCK)  # done at once: sent, or Again
                return True
            except zmq.Again:  # no core connected (it died), or its queue is full
                pass
            except zmq.ZMQError:  # closed under us: that core is gone
                return False
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return False

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once a core serves (a restart within `timeout_s`), False if none does by then."""
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                return False
        return True

    async def stop(self, timeout_s: float = 10.0) -> bool:
        """Ask the core to end after its current step; False if it had to be killed."""
        self._stopping = True
        proc = self._proc
        if proc is None or not launch.running(proc) or self._socks is None:
            return True
        await self.send([wire.STOP])
        await asyncio.to_thread(proc.join, timeout_s)
        if launch.running(proc):
            self._kill()
            deadline = time.monotonic() + KILLED_WAIT_S
            while launch.running(proc) and time.monotonic() < deadline:  # is_alive reaps it once it has ended
                await asyncio.sleep(0.02)
            if launch.running(proc):
                log.warning("the killed engine core (pid %d) is still being torn down; not waiting for it", proc.pid)
                launch.disown(proc)
            return False
        return True

    async def aclose(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self._proc is not None and launch.running(self._proc)

    @property
    def restarting(self) -> bool:
        return self.fatal is None and not self._ready.is_set() and not self._stopping

    def _own(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kill(self) -> None:
        if self._proc is not None and launch.running(self._proc):
            self._proc.kill()

    def _close_sockets(self) -> None:
        if self._socks is not None:
            for sock in self._socks:
                sock.close(linger=0)
            self._socks = None

    # -- watching -------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Kill a core that stopped talking (hung in a step, stopped by a signal)."""
        while not self._stopping:
            await asyncio.sleep(1.0)
            silent = time.monotonic() - self._last_heard
            if self._ready.is_set() and silent > self.sup.heartbeat_s and self.alive:
                log.error("the engine core has been silent for %.0f s; killing it", silent)
                self._kill()

    def _exited(self, proc, epoch: int) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1.0)
        code, pid = proc.exitcode, proc.pid
        if code is not None:
            proc.close()
            if self._proc is proc:
                self._proc = None
        if self._stopping or epoch != self.epoch:
            return
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if self._last_word:
            how += f": {self._last_word}"
        log.error("the engine core (pid %d) died (%s); failing what was in flight", pid, how)
        self._ready.clear()
        self.fail_in_flight("engine_restarting", "the engine restarted; the session is intact, retry")
        self._died(how)

    def _died(self, how: str) -> None:
        """Count a death; restart, or give up past the limit (or when the core cannot be restarted)."""
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.sup.restart_window_s:
            self._deaths.popleft()
        if len(self._deaths) > self.sup.max_restarts or self._engine is not None:
            self._give_up(f"the engine core died {len(self._deaths)} times within {self.sup.restart_window_s:g} s "
                          f"(last: {how})")
            return
        self._own(self._restart())

    async def _restart(self) -> None:
        self._last_word = ""
        reason = await self._spawn()
        if reason is not None:
            log.error("the engine core did not come back: %s", reason[1])
            self._died(reason[1])

    def _give_up(self, reason: str) -> None:
        log.critical("the engine cannot go on: %s", reason)
        self.fatal = reason
        self._ready.set()  # waiters wake and see `fatal`
        self.fail_in_flight("engine_unavailable", f"the engine has stopped: {reason}")
        if self.on_fatal is not None:
            self.on_fatal(reason)
