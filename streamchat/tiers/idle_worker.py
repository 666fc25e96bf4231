"""Background work that takes only the CPU nothing else wants, and is never starved for long.

Owns the two threads that read saved sessions off the step loop's cores.
A job (a callable and the callback that gets its result) runs first on a
thread at Linux's idle scheduling class (SCHED_IDLE): it runs only while a
core would otherwise idle, and yields that core at once when a step's
thread wakes. At a nice level instead (BACKGROUND_NICE, 10) a disk resume's
read and checksum still took slices from the step's threads: `python
bench/pagein_itl.py` rounds, interleaved on 2 cores, put the median gap of a
stream while 3 sessions came back from disk at 1.41x and 1.39x of the quiet
one with the reader at nice 10 and 1.26x and 1.27x at SCHED_IDLE.

An idle thread can wait forever on a machine whose cores something else
fills, and an unprivileged thread cannot leave SCHED_IDLE again. So a
second thread at BACKGROUND_NICE runs any job still unfinished
`rescue_after_s` after it was queued, again, from the start; whichever run
ends first hands its result to the callback, exactly once, and the other's
is dropped (jobs must be repeatable: a read is). Where SCHED_IDLE is not
available the first thread runs at nice 19.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from streamchat.priority import lower_priority

log = logging.getLogger(__name__)

RESCUE_AFTER_S = 0.5  # a job queued this long and not finished is run again at BACKGROUND_NICE


@dataclass(eq=False)
class _Job:
    work: Callable[[], object]
    done: Callable[[object], None]
    queued_at: float
    started: bool = False  # taken by the idle thread
    rescued: bool = False  # taken by the rescuing thread
    finished: bool = False


class IdleWorker:
    def __init__(self, name: str, rescue_after_s: float = RESCUE_AFTER_S, clock=time.monotonic) -> None:
        self.rescue_after_s = rescue_after_s
        self.clock = clock
        self.num_rescued = 0  # jobs the rescuing thread delivered
        self._cv = threading.Condition()
        self._jobs: list[_Job] = []  # unfinished, oldest first
        self._stopping = False
        self._threads = [threading.Thread(target=self._idle_loop, name=f"{name}-idle", daemon=True),
                         threading.Thread(target=self._rescue_loop, name=f"{name}-rescue", daemon=True)]
        for t in self._threads:
            t.start()

    def submit(self, work: Callable[[], object], done: Callable[[object], None]) -> None:
        """Run `work()` off this thread; `done(its result)` is called once, on a worker thread."""
        with self._cv:
            if self._stopping:
                raise RuntimeError("the worker is closed")
            self._jobs.append(_Job(work, done, self.clock()))
            self._cv.notify_all()

    def close(self) -> None:
        """Finish every job submitted, then end both threads."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    # -- the threads ----------------------------------------------------------------------

    def _idle_loop(self) -> None:
        lower_priority(idle=True)
        while (job := self._take(lambda j: not j.started and not j.rescued)) is not None:
            self._run(job)

    def _rescue_loop(self) -> None:
        lower_priority(idle=False)
        while (job := self._take(self._overdue, rescue=True)) is not None:
            self._run(job, rescue=True)

    def _overdue(self, job: _Job) -> bool:
        # closing: nothing waits for the idle thread any more
        return not job.rescued and (self._stopping or self.clock() - job.queued_at >= self.rescue_after_s)

    def _take(self, wanted: Callable[[_Job], bool], rescue: bool = False) -> _Job | None:
        """The oldest unfinished job `wanted` says this thread should run (marked as taken), waiting
        for one; None once closing and nothing is left."""
        with self._cv:
            while True:
                job = next((j for j in self._jobs if wanted(j)), None)
                if job is not None:
                    if rescue:
                        job.rescued = True
                    else:
                        job.started = True
                    return job
                if self._stopping and not self._jobs:
                    return None
                wait = None
                if rescue and self._jobs:  # until the oldest job still to rescue is due
                    due = [j.queued_at + self.rescue_after_s for j in self._jobs if not j.rescued]
                    wait = max(0.0, min(due) - self.clock()) + 0.001 if due else None
                self._cv.wait(wait)

    def _run(self, job: _Job, rescue: bool = False) -> None:
        try:
            result = job.work()
        except Exception:  # noqa: BLE001 - a job's bug must not end the thread; the other run may deliver
            log.exception("background job failed")
            if not rescue:  # the rescue still runs it once it is due
                return
            result = None
        with self._cv:
            if job.finished:
                return
            job.finished = True
            self._jobs.remove(job)
            if rescue:
                self.num_rescued += 1
            self._cv.notify_all()
        job.done(result)
