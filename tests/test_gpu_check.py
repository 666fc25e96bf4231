"""bench/gpu_check.sh refuses, with its reason, to run its GPU figures where there is no CUDA device."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_without_cuda_exits_2_with_a_message():
    """No visible CUDA device: exit status 2 and a message naming the --smoke alternative, no traceback."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    result = subprocess.run([str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no CUDA device here" in result.stderr and "--smoke" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
