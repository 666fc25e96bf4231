"""The idle-priority worker that reads saved sessions: priorities, the rescue of a starved job, one result."""

from __future__ import annotations

import os
import threading
import time

import pytest

from streamchat.priority import BACKGROUND_NICE
from streamchat.tiers.idle_worker import IdleWorker


def wait_for(cond, timeout_s: float = 20.0) -> None:  # a bound for a saturated machine, not a timing
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_job_runs_off_the_caller_and_delivers_once():
    w = IdleWorker("t", rescue_after_s=30)
    got = []
    w.submit(lambda: (threading.current_thread().name, 7), got.append)
    wait_for(lambda: got)
    w.close()
    assert got == [("t-idle", 7)] and w.num_rescued == 0


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_the_first_run_is_at_idle_priority():
    w = IdleWorker("t", rescue_after_s=30)

    def work():
        tid = threading.get_native_id()
        return threading.current_thread().name, os.sched_getscheduler(tid)

    got = []
    w.submit(work, got.append)
    wait_for(lambda: got)
    w.close()
    assert got == [("t-idle", os.SCHED_IDLE)]


def test_a_starved_job_is_run_again_at_background_nice_and_only_the_first_result_counts():
    w = IdleWorker("t", rescue_after_s=0.1)
    release = threading.Event()
    calls = []

    def work():
        name = threading.current_thread().name
        calls.append(name)
        if name == "t-idle":  # the idle run never gets the CPU until released
            release.wait(20)
        return name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    got = []
    started = time.monotonic()
    w.submit(work, got.append)
    wait_for(lambda: got)
    took = time.monotonic() - started
    assert got == [("t-rescue", BACKGROUND_NICE)] and took >= 0.1 and w.num_rescued == 1
    release.set()  # an idle run that had started ends now: its result is dropped
    w.close()
    assert got == [("t-rescue", BACKGROUND_NICE)] and calls.count("t-rescue") == 1 and calls.count("t-idle") <= 1


def test_jobs_queued_behind_a_starved_one_are_rescued_in_order():
    w = IdleWorker("t", rescue_after_s=0.05)
    release = threading.Event()

    def work(i):
        if threading.current_thread().name == "t-idle":
            release.wait(5)
        return i

    got = []
    for i in range(3):
        w.submit(lambda i=i: work(i), got.append)
    wait_for(lambda: len(got) == 3)
    release.set()
    w.close()
    assert got == [0, 1, 2]


def test_close_finishes_what_was_submitted_and_refuses_more():
    w = IdleWorker("t", rescue_after_s=30)
    got = []
    for i in range(5):
        w.submit(lambda i=i: i * i, got.append)
    w.close()
    assert sorted(got) == [0, 1, 4, 9, 16]
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(lambda: 1, got.append)


def test_a_failing_job_is_delivered_by_its_rescue():
    w = IdleWorker("t", rescue_after_s=0.05)
    got = []

    def work():
        if threading.current_thread().name == "t-idle":
            raise ValueError("a reader bug")
        return "ok"

    w.submit(work, got.append)
    wait_for(lambda: got)
    w.close()
    assert got == ["ok"]
