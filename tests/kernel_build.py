"""The CPU kernels for a test that needs them: built, or a skip that says no C compiler exists.

A machine with a compiler must build the kernels. When the build fails, a test that needs them fails
with the compiler's message: a skip there would leave the suite green over a kernel that does not
compile (cpu.library() only logs the failure and hands the daemon the torch reference).
"""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from streamchat.kernels import cpu, cpu_build


def require_kernels(sources: list[Path] | None = None) -> ctypes.CDLL:
    """The library of `sources` (default: the process's, cpu.library()); pytest.skip without $CC (default
    cc) on PATH, pytest.fail with the compiler's last lines when it is there and the build fails."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc!r} is not on PATH): the CPU kernels are neither built nor tested")
    if sources is None and cpu.library() is not None:
        return cpu.library()
    try:
        return cpu.build_library(sources)  # again, for the error library() only logged
    except (OSError, subprocess.SubprocessError, cpu_build.UntrustedCache) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()[-12:]
        pytest.fail(f"the CPU kernels failed to build with {cc}:\n" + "\n".join(detail), pytrace=False)
