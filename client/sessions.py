"""The client's private session file: which sessions it knows and their resume tokens.

The daemon shows a session's resume token once, in `session.created`; the
client keeps it here so that `chat` and `feed` (any number of them, at once)
can attach to the session later. The file lives in the user's state
directory and is readable by its owner only (mode 0600, directory 0700).

    $XDG_STATE_HOME/streamchat/sessions.json   (default ~/.local/state/...)
    {"version": 1, "sessions": [{"id": ..., "resume_token": ..., ...}, ...]}

Writers take an advisory lock and replace the file atomically, so two
clients saving at once lose nothing. Knows nothing about websockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator, Mapping

from .errors import ClientError

try:
    import fcntl
except ImportError:  # not on POSIX: no locking, the atomic replace still holds
    fcntl = None  # type: ignore[assignment]

FILE_NAME = "sessions.json"


@dataclass
class SavedSession:
    """One remembered session."""

    id: str
    resume_token: str
    url: str = ""
    instructions: str = ""
    title: str = ""  # the first user message, shortened
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)


def state_dir(environ: Mapping[str, str]) -> Path:
    """$XDG_STATE_HOME/streamchat, or ~/.local/state/streamchat."""
    base = environ.get("XDG_STATE_HOME", "")
    if not base or not os.path.isabs(base):
        home = environ.get("HOME") or str(Path.home())
        base = os.path.join(home, ".local", "state")
    return Path(base) / "streamchat"


def private_dir(path: Path) -> Path:
    """Creates `path` (mode 0700) if missing; returns it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def private_file(path: Path) -> Path:
    """Creates an empty file readable by its owner only, if missing; returns it."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


class SessionStore:
    """Reads and updates the session file at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[SavedSession]:
        """All sessions, most recently used first."""
        sessions = self._read()
        return sorted(sessions, key=lambda s: s.last_used, reverse=True)

    def find(self, id_or_prefix: str) -> SavedSession | None:
        """The session with this id, or the only one whose id starts with it."""
        sessions = self._read()
        for saved in sessions:
            if saved.id == id_or_prefix:
                return saved
        matches = [s for s in sessions if id_or_prefix and s.id.startswith(id_or_prefix)]
        if len(matches) > 1:
            raise ClientError(f"{id_or_prefix!r} matches {len(matches)} sessions; "
                              "give more of the id.")
        return matches[0] if matches else None

    def save(self, saved: SavedSession) -> None:
        """Adds the session, or replaces the entry with the same id."""
        with self._locked():
            others = [s for s in self._read() if s.id != saved.id]
            self._write(others + [saved])

    def touch(self, session_id: str, **changes: object) -> SavedSession | None:
        """Sets fields of a known session and marks it used now."""
        with self._locked():
            sessions = self._read()
            found = next((s for s in sessions if s.id == session_id), None)
            if found is None:
                return None
            for name, value in changes.items():
                setattr(found, name, value)
            found.last_used = time.time()
            self._write(sessions)
            return found

    def _read(self) -> list[SavedSession]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise ClientError(f"cannot read the session file {self.path}: {exc}") from exc
        known = {f.name for f in fields(SavedSession)}
        rows = data.get("sessions", []) if isinstance(data, dict) else []
        return [SavedSession(**{k: v for k, v in row.items() if k in known})
                for row in rows if isinstance(row, dict) and "id" in row and "resume_token" in row]

    def _write(self, sessions: list[SavedSession]) -> None:
        private_dir(self.path.parent)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o600)
            json.dump({"version": 1, "sessions": [asdict(s) for s in sessions]}, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        lock = private_file(self.path.with_name(self.path.name + ".lock"))
        fd = os.open(lock, os.O_WRONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock
