"""Threads that give way to the step loop: Linux priorities a thread sets on itself.

On a machine whose cores the step's threads fill, any other thread that runs
at the same priority takes a slice of a step: one core lost to it for a
millisecond holds up the whole step (its threads meet at every product).
So the threads that do bookkeeping rather than make tokens lower their own
priority: the disk writer and the rescuing reader at BACKGROUND_NICE, the
first reader at the idle class (`tiers.idle_worker`), and the front's store
thread at BACKGROUND_NICE (`store.async_store`). They still run whenever a
core has room and take a share of a full one (nice 10 weighs about a tenth
of nice 0), so none is starved. A thread may always lower its own priority;
raising it again needs a privilege, so none does. Off Linux this does
nothing. Torch-free.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 10  # Linux nice, per thread


def lower_priority(idle: bool = False) -> None:
    """This thread at SCHED_IDLE (`idle`; nice 19 where that class is missing), else at BACKGROUND_NICE
    (or where it was, if that is lower still: a daemon started under `nice 19` stays there)."""
    tid = threading.get_native_id()
    try:
        if idle and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        target = 19 if idle else BACKGROUND_NICE
        os.setpriority(os.PRIO_PROCESS, tid, max(target, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass
