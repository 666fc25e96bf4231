"""The data directory is the daemon's alone: the marker that claims a folder, and the names of its own files.

Owns which folders the disk tier may use and which of the files in one it
may touch. The disk tier deletes files (least recently used, beyond its
budget), so it must never take a folder that holds anyone else's:

    new or empty folder          claimed: mode 0700, a MARKER file (0600) written
    folder with the MARKER       used as is (a warning if group or others may enter it)
    anything else                refused at start-up: ConfigError saying what to do

Inside a claimed folder only names this module recognises are the daemon's:
session files (`sess_<32 hex>.safetensors`, `h<32 hex>.safetensors`) and its
temp files (`.<session file>.<8 hex>.tmp`, `.probe.<8 hex>.tmp`), each a
regular file, not a link. Everything else is left alone. Knows nothing about
the file format or the budget.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from pathlib import Path

from streamchat.config import ConfigError

MARKER = ".streamchat-data-dir"
MARKER_FORMAT = "streamchat.data-dir"
_SESSION = r"(?:sess_[0-9a-f]{32}|h[0-9a-f]{32})\.safetensors"
SESSION_FILE = re.compile(_SESSION)
TEMP_FILE = re.compile(rf"\.(?:{_SESSION}|probe)\.[0-9a-f]{{8}}\.tmp")


def claim(root: Path) -> list[str]:
    """Make `root` the daemon's data directory or refuse it; returns warnings for the log.

    Raises ConfigError for a non-empty folder without the marker, a path that
    is not a directory, or one the daemon cannot write.
    """
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        marker = _lstat(root / MARKER)
        if marker is None:
            _adopt_empty(root)
        elif not stat.S_ISREG(marker.st_mode):
            raise ConfigError(f"data_dir {root}: {MARKER} is not a regular file; remove it, or pass --data-dir "
                              "naming a new or empty folder")
        _probe(root)
    except OSError as exc:
        raise ConfigError(f"data_dir {root} is not a writable directory: {exc.strerror}; pass --data-dir naming "
                          "a folder the daemon's user may create or write") from None
    return _loose_mode(root)


def _adopt_empty(root: Path) -> None:
    """Claim a folder without the marker: only if nothing is in it."""
    with os.scandir(root) as entries:
        names = sorted(e.name for e in entries)
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"data_dir {root} is not empty ({shown}) and has no {MARKER} file, so streamchat did not make it. "
            f"The daemon deletes saved sessions in its data directory and will not share one with other files: "
            f"pass --data-dir naming a new or empty folder. If {root} holds only session files an earlier "
            f"streamchat wrote, claim it with `touch {root / MARKER}`.")
    os.chmod(root, 0o700)
    note = {"format": MARKER_FORMAT, "version": 1, "created_at": round(time.time(), 3),
            "note": "streamchat keeps saved sessions here and deletes only its own session files"}
    fd = os.open(root / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(note, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _probe(root: Path) -> None:
    """Fail now, not at the first save, if the folder cannot be written."""
    probe = root / f".probe.{secrets.token_hex(4)}.tmp"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    probe.unlink(missing_ok=True)  # another daemon sharing the folder may have swept it


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _loose_mode(root: Path) -> list[str]:
    st = root.stat()
    mode, warnings = stat.S_IMODE(st.st_mode), []
    if mode & 0o077:
        warnings.append(f"data_dir {root} has mode {mode:o}: others may read saved sessions; chmod 700 {root}")
    if st.st_uid != os.geteuid():
        warnings.append(f"data_dir {root} belongs to uid {st.st_uid}, not to the daemon's user ({os.geteuid()})")
    return warnings


def is_own_file(entry: os.DirEntry) -> bool:
    """A session file the daemon wrote: its name, a regular file (a link is never followed)."""
    return bool(SESSION_FILE.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False)


def is_own_temp(entry: os.DirEntry) -> bool:
    """A temp file of the daemon's, left by a write that was cut short."""
    return bool(TEMP_FILE.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False)
