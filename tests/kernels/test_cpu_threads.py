"""kernels/cpu.py `bind_threads`: the engine core's OpenMP team, one thread to a CPU.

Each case runs in a process of its own: binding changes the calling thread's CPUs for good.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kernel_build import require_kernels  # tests/ is on sys.path (its conftest.py)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux and 2 CPUs")

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    allowed = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, allowed)  # a process of 2 CPUs, whatever the machine has
    import torch
    from streamchat.kernels import cpu
    torch.set_num_threads(int(sys.argv[1]))
    a = torch.randn(256, 256)
    want = a @ a
    before = threading.Thread(target=threading.Event().wait, daemon=True)
    before.start()
    bound = cpu.bind_threads(int(sys.argv[1]))
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        masks[tid] = sorted(os.sched_getaffinity(int(tid)))
    print(json.dumps({"allowed": allowed, "bound": bound, "main": sorted(os.sched_getaffinity(0)),
                      "before": masks[str(before.native_id)], "masks": masks,
                      "same": bool(torch.equal(a @ a, want))}))
""")


def run(threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_each_thread_of_the_team_runs_on_a_cpu_of_its_own():
    require_kernels()
    got = run(2)
    cpus = got["allowed"]
    assert got["bound"] == cpus
    assert got["main"] == [cpus[0]]  # the calling thread is the team's thread 0
    singles = [m for tid, m in got["masks"].items() if len(m) == 1]
    assert [cpus[1]] in singles, got["masks"]  # the team's other thread
    assert got["before"] == cpus  # a thread that was running before keeps both
    assert got["same"]  # and the products still come out the same


def test_a_team_that_is_not_one_thread_per_cpu_is_left_to_the_scheduler():
    require_kernels()
    for threads in (1, 3):
        got = run(threads)
        assert got["bound"] == []
        assert all(m == got["allowed"] for m in got["masks"].values()), got["masks"]
