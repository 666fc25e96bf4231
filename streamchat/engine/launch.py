"""Starting an engine core: its own process (the daemon), or a thread around a built engine (tests).

Owns how a core comes to life and what the front may watch of it: `pid`,
`sentinel` (a file descriptor readable once it has ended), `exitcode`,
`is_alive`, `join`, `kill`. The process is spawned (a fresh interpreter: no
state of the front's event loop is inherited) from the event loop's thread,
which the core's parent-death signal follows. Imports no torch.
"""

from __future__ import annotations

import multiprocessing
import os
import threading


def spawn_process(config, addresses: tuple[str, str], log_level: str, log_format: str):
    """The engine core in a process of its own (a started `multiprocessing.Process`)."""
    from streamchat.engine import core

    proc = multiprocessing.get_context("spawn").Process(
        target=core.main, args=(config, addresses, os.getpid(), log_level, log_format), daemon=True,
        name="streamchat-core")
    proc.start()
    return proc


class ThreadCore:
    """An engine core in a thread of this process, around an engine already built.

    For tests and in-process benchmarks: the same loop, sockets and messages as
    the process, without a second model load. It cannot be killed.
    """

    def __init__(self, engine, config, addresses: tuple[str, str]) -> None:
        from streamchat.engine.core import EngineCore

        self.pid = os.getpid()
        self.exitcode: int | None = None
        self.sentinel, self._done = os.pipe()
        self._core = EngineCore(config, addresses, engine)
        self._thread = threading.Thread(target=self._run, name="streamchat-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.exitcode = self._core.run()
        finally:
            os.write(self._done, b"x")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def kill(self) -> None:
        """A thread cannot be killed; it ends when told to stop."""

    def close(self) -> None:
        os.close(self.sentinel)
        os.close(self._done)


def running(proc) -> bool:
    """Whether a core's process (or thread) runs; one that the exit watcher closed meanwhile has ended."""
    try:
        return proc.is_alive()
    except ValueError:  # "process object is closed"
        return False


def disown(proc) -> None:
    """Let this interpreter exit without reaping a killed core.

    multiprocessing's exit handler joins every child it started. A core killed at a shutdown
    deadline is gone at once, but the kernel may take seconds to free its memory on a busy host
    (40 s was seen with both cores saturated), and the daemon's exit would wait for that. A
    disowned process is reaped by whoever inherits it (init) instead.
    """
    children = getattr(multiprocessing.process, "_children", None)  # the started processes themselves
    if children is not None:
        children.discard(proc)
