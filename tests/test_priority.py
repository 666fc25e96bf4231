"""A thread lowers its own priority and only its own, never raising one already lower."""

from __future__ import annotations

import os
import threading

import pytest

from streamchat.priority import BACKGROUND_NICE, lower_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="Linux thread priorities")


def nice_of_a_thread(start_at: int | None) -> tuple[int, int]:
    """(its nice before lower_priority, after), on a new thread that first sets `start_at` if given."""
    got = []

    def run():
        tid = threading.get_native_id()
        if start_at is not None:
            os.setpriority(os.PRIO_PROCESS, tid, start_at)
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_priority()
        got.append((before, os.getpriority(os.PRIO_PROCESS, tid)))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return got[0]


def test_a_thread_goes_to_background_nice_and_the_caller_stays():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before, after = nice_of_a_thread(None)
    assert before == mine and after == max(BACKGROUND_NICE, mine)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_a_thread_already_lower_stays_there():
    assert nice_of_a_thread(BACKGROUND_NICE + 5) == (BACKGROUND_NICE + 5, BACKGROUND_NICE + 5)
