"""Files only the daemon's user can change: made private, and checked before they are trusted.

Owns two rules the caches share. A folder the daemon makes is 0700 and a file
it writes 0600. A file it takes code or a trusted value from (a kernel
library, a cached weights digest) must be owned by the daemon's user and
writable by no one else, and so must the folder holding it: whoever else could
write either could swap in what the daemon then runs or believes. Knows
nothing of what the files hold.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


def private_dir(path: Path) -> Path:
    """`path`, made 0700 if missing (its parents as the umask says)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def distrust(path: Path) -> str | None:
    """Why the file `path` and its folder must not be trusted, or None if only this user can change them.

    The file itself is not followed if it is a link (a link is refused); the
    folder is (a cache folder may well sit behind one).
    """
    for target, st in ((path.parent, os.stat(path.parent)), (path, os.lstat(path))):
        why = _unsafe(st)
        if why is not None:
            return f"{target} {why}"
    return None


def distrust_dir(path: Path) -> str | None:
    """Why the folder `path` must not be trusted to hold such files, or None."""
    why = _unsafe(os.stat(path))
    return None if why is None else f"{path} {why}"


def _unsafe(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def write_private(path: Path, data: bytes) -> None:
    """`data` into `path`, all or nothing: a 0600 temp file beside it, renamed over it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
