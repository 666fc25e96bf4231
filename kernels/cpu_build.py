"""Building the CPU kernels (cpu_decode.c, cpu_mla.c, cpu_linear*.c, cpu_forward.c, cpu_threads.c) once per
machine, into a cache only this user can change.

Build: `$CC` (default `cc`) with -O3 -march=native -fopenmp into
`$STREAMCHAT_KERNEL_CACHE` (default ~/.cache/streamchat/kernels, made 0700),
named by a hash of the source, the flags, the compiler's version and the
CPU's feature flags, so a changed source, compiler or machine builds afresh.

A library is loaded as code, so a cached one is used only if it and its
folder belong to this user and no one else may write them
(`streamchat.private_files`): another owner's, or one others may write, is
rebuilt into a fresh private file over it; in a folder others may write,
nothing is built or loaded (UntrustedCache). Knows nothing of the kernel's
functions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from streamchat import private_files

log = logging.getLogger("streamchat.kernels")

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_decode.c", "cpu_mla.c", "cpu_linear.c", "cpu_linear_x8.c", "cpu_forward.c",
                        "cpu_threads.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_common.h", "cpu_linear.h", "cpu_decode.h")]  # part of the build's key
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def cache_dir() -> Path:
    env = os.environ.get("STREAMCHAT_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streamchat" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


class UntrustedCache(Exception):
    """The kernel cache folder may be changed by someone else: nothing in it is loaded."""


def _key(cc: str, sources: list[Path]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    texts = [f.read_text() for f in sources + HEADERS]
    return hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version, _cpu_flags(),
                                      platform.machine()]).encode()).hexdigest()[:16]


def _compile(cc: str, sources: list[Path], out: str) -> None:
    include = f"-I{HEADERS[0].parent}"  # the shared headers, for a source built from elsewhere (benchmarks)
    subprocess.run([cc, *FLAGS, include, *map(str, sources), "-o", out, "-lm"], capture_output=True, text=True,
                   timeout=300, check=True)


def build(cc: str, sources: list[Path] | None = None) -> Path:
    """The library for these sources (default SOURCES), compiler and machine: the cached one if only this
    user can change it and its folder, else a fresh private build over it. UntrustedCache if others may
    write the folder. Benchmarks pass other versions of the sources to time them side by side."""
    sources = SOURCES if sources is None else sources
    folder = private_files.private_dir(cache_dir())
    why = private_files.distrust_dir(folder)
    if why is not None:
        raise UntrustedCache(f"kernel cache {why}")
    target = folder / f"cpu_decode-{_key(cc, sources)}.so"
    if os.path.lexists(target):
        why = private_files.distrust(target)
        if why is None:
            return target
        log.warning("not loading the kernel library: %s; building a fresh private copy", why)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)  # mode 0600: read is all dlopen needs
    os.close(fd)
    try:
        _compile(cc, sources, tmp)
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
