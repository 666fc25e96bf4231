"""The disk tier: one file per saved session in a data directory, within a byte budget.

Owns the directory, claimed at start as `datadir` says (only the daemon's
own files in it are ever indexed, counted or deleted): file names (never
taken from client input unchecked), the index of what is there (size, last
use, and for copies written by this process the session version they hold),
deleting the least recently used files beyond the budget, removing
half-written temp files on start, and background threads: one writes, and
an `IdleWorker` reads (at idle priority, rescued at nice 10 when starved).
Saving hands a snapshot to the writer and returns at once; until it is on
disk, `load` serves it from memory. `load_async` reads and checks a file on
the reader's threads and hands the result to a callback, so the engine's
step loop never waits on a disk. The file format is `kvfile`'s.
Thread-safe: the engine's loop saves and asks for loads, the reader thread
loads, the writer thread writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from streamchat.priority import lower_priority
from streamchat.tiers import datadir, kvfile
from streamchat.tiers.idle_worker import IdleWorker
from streamchat.tiers.kvfile import ANY_MARK, KVFileError, KVLayout, Snapshot

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"sess_[0-9a-f]{32}")
MAX_PENDING_BYTES = 1 << 30  # snapshots waiting for the writer; save() waits beyond this
# A temp file younger than this may be another daemon's write in progress (a fleet shares the folder).
STALE_TEMP_S = 600.0


def file_name(session_id: str) -> str:
    """A server-made id as is; anything else by hash, so no input names a path."""
    if SESSION_ID.fullmatch(session_id):
        return session_id + kvfile.SUFFIX
    return "h" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest() + kvfile.SUFFIX


def default_data_dir(store_url: str) -> Path:
    """Next to the SQLite file (`x.db` -> `x.kv/`), else $XDG_DATA_HOME/streamchat/kv."""
    prefix = "sqlite:///"
    if store_url.startswith(prefix):
        db = store_url[len(prefix):].split("?")[0]
        if db and db != ":memory:":
            p = Path(db)
            return p.with_name(p.stem + ".kv")
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "streamchat" / "kv"


@dataclass
class Copy:
    """A file on disk or on its way there."""

    size: int
    last_used: float  # wall clock, persisted as the file's mtime
    version: int | None = None  # the engine session version it holds (this process only)
    mark: str | None = None


@dataclass
class _Job:
    snapshot: Snapshot | None  # None: re-stamp the file on disk with `copy.mark` (same KV)
    copy: Copy
    session_id: str = ""
    started: bool = False
    cancelled: bool = False


class DiskTier:
    def __init__(self, root: Path, budget_bytes: int, layout: KVLayout, *, vocab_size: int,
                 clock=time.time) -> None:
        self.root = Path(root)
        self.budget = budget_bytes
        self.layout = layout
        self.vocab_size = vocab_size  # token ids in a file must be below it
        self.clock = clock
        for warning in datadir.claim(self.root):  # ConfigError: not a folder the daemon may use
            log.warning(warning)
        self._lock = threading.Condition()
        self._files: OrderedDict[str, Copy] = OrderedDict()  # least recently used first
        self._pending: dict[str, _Job] = {}  # name -> the newest snapshot not yet written
        self._queue: list[str] = []
        self.num_writes = self.num_written_bytes = self.num_write_failures = self.num_deletions = 0
        self._scan()
        with self._lock:
            self._enforce_budget(keep=None)
        self._thread = threading.Thread(target=self._run, name="streamchat-disk-writer", daemon=True)
        self._stopping = False
        self._thread.start()
        self._reader = IdleWorker("streamchat-disk-reader")

    # -- figures ----------------------------------------------------------------------

    @property
    def num_files(self) -> int:
        with self._lock:
            return len(self._files) + sum(1 for n in self._pending if n not in self._files)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(c.size for c in self._files.values()) + sum(
                j.copy.size for n, j in self._pending.items() if n not in self._files)

    def path(self, session_id: str) -> Path:
        return self.root / file_name(session_id)

    # -- engine side ------------------------------------------------------------------

    def save(self, snap: Snapshot, version: int | None = None) -> bool:
        """Queue `snap` for writing (the newest of a session wins); False if over the budget.

        Waits while the snapshots queued before it hold more than
        MAX_PENDING_BYTES, so a burst of saves (shutdown) cannot exhaust memory.
        """
        size = snap.nbytes
        if size > self.budget:
            return False
        name = file_name(snap.session_id)
        with self._lock:
            while self._pending and sum(j.copy.size for j in self._pending.values()) + size > MAX_PENDING_BYTES:
                self._lock.wait()
            old = self._pending.get(name)
            if old is not None and not old.started:
                old.cancelled = True
            self._pending[name] = _Job(snap, Copy(size, self.clock(), version, snap.mark), snap.session_id)
            self._queue.append(name)
            self._lock.notify_all()
        return True

    def restamp(self, session_id: str, mark: str) -> bool:
        """Stamp the saved copy (the session's KV as it is now) with a newer transcript mark.

        The file is read back and rewritten on the writer thread; False if there is no copy.
        """
        name = file_name(session_id)
        with self._lock:
            job = self._pending.get(name)
            if job is not None and not job.started and job.snapshot is not None:
                job.snapshot = dataclasses.replace(job.snapshot, mark=mark)
                job.copy.mark = mark
                return True
            copy = job.copy if job is not None else self._files.get(name)
            if copy is None:
                return False
            if job is not None and not job.started:
                job.cancelled = True
            self._pending[name] = _Job(None, dataclasses.replace(copy, mark=mark), session_id)
            self._queue.append(name)
            self._lock.notify_all()
        return True

    def copy_of(self, session_id: str) -> Copy | None:
        """What the disk tier holds for the session (written or on its way), if anything."""
        name = file_name(session_id)
        with self._lock:
            job = self._pending.get(name)
            return job.copy if job is not None else self._files.get(name)

    def adopt(self, session_id: str, version: int) -> None:
        """The session's state now is what its file holds (it was just loaded from it)."""
        with self._lock:
            c = self._files.get(file_name(session_id))
            if c is not None:
                c.version = version

    def load(self, session_id: str, mark=ANY_MARK) -> Snapshot:
        """The session's saved snapshot, checked; KVFileError says why not."""
        name = file_name(session_id)
        with self._lock:
            job = self._pending.get(name)
            if job is not None:
                refusal = kvfile.mark_refusal(mark, job.copy.mark)
                if refusal is not None:
                    raise KVFileError("stale", refusal)
                if job.snapshot is not None:
                    return job.snapshot
        if job is not None:  # a re-stamp on its way: the file holds the same KV under the older mark
            return dataclasses.replace(kvfile.read(self.root / name, self.layout, session_id,
                                                   vocab_size=self.vocab_size), mark=job.copy.mark)
        snap = kvfile.read(self.root / name, self.layout, session_id, mark, vocab_size=self.vocab_size)
        self._touch(name)
        return snap

    def load_async(self, session_id: str, mark, done) -> None:
        """`load` on the reader's threads; `done(snapshot or KVFileError)` is called there, once."""
        self._reader.submit(lambda: self._read(session_id, mark), done)

    def _read(self, session_id: str, mark) -> Snapshot | KVFileError:
        try:
            return self.load(session_id, mark)
        except KVFileError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - a reader bug must not lose the request
            log.exception("reading the saved file of %s failed", session_id)
            return KVFileError("unreadable", repr(exc))

    def delete(self, session_id: str) -> None:
        """Forget the session's copy: cancel its write, remove its file."""
        name = file_name(session_id)
        with self._lock:
            job = self._pending.pop(name, None)
            if job is not None:
                job.cancelled = True
            if self._files.pop(name, None) is not None:
                (self.root / name).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued snapshot is written (or failed)."""
        with self._lock:
            while self._pending:
                self._lock.wait()

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join()
        self._reader.close()

    # -- the writer thread ------------------------------------------------------------

    def _run(self) -> None:
        lower_priority(idle=False)  # writing and checksumming at nice 0 slowed every stream's steps
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._lock.wait()
                if not self._queue:
                    return
                name = self._queue.pop(0)
                job = self._pending.get(name)
                if job is None or job.started or job.cancelled:
                    continue
                job.started = True
            self._write(name, job)

    def _write(self, name: str, job: _Job) -> None:
        try:
            snap = job.snapshot
            if snap is None:  # a re-stamp: the same KV under a newer mark
                snap = dataclasses.replace(kvfile.read(self.root / name, self.layout, job.session_id,
                                                       vocab_size=self.vocab_size),
                                           mark=job.copy.mark)
            size = kvfile.write_atomic(self.root / name, snap, self.layout)
        except Exception as exc:  # a full disk, a permission: the session is rebuilt from tokens
            size = None
            log.warning("could not save session %s to %s: %s", job.session_id, self.root, exc)
        with self._lock:
            if self._pending.get(name) is job:
                del self._pending[name]
            if size is None:
                self.num_write_failures += 1
            elif job.cancelled:
                (self.root / name).unlink(missing_ok=True)
                self._files.pop(name, None)
            else:
                self.num_writes += 1
                self.num_written_bytes += size
                job.copy.size = size
                self._files[name] = job.copy
                self._files.move_to_end(name)
                _set_mtime(self.root / name, job.copy.last_used)
                self._enforce_budget(keep=name)
            self._lock.notify_all()

    # -- the directory ----------------------------------------------------------------

    def _touch(self, name: str) -> None:
        now = self.clock()
        with self._lock:
            c = self._files.get(name)
            if c is None:
                return
            c.last_used = now
            self._files.move_to_end(name)
        _set_mtime(self.root / name, now)

    def _enforce_budget(self, keep: str | None) -> None:
        """Delete least recently used files until the directory fits the budget (lock held)."""
        total = sum(c.size for c in self._files.values())
        for name in list(self._files):
            if total <= self.budget:
                return
            if name == keep or name in self._pending:
                continue
            total -= self._files.pop(name).size
            try:
                (self.root / name).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not delete %s from the disk tier: %s", name, exc.strerror)
            self.num_deletions += 1
            log.info("disk tier over its budget: deleted %s (least recently used)", name)

    def _scan(self) -> None:
        """Index the session files, remove half-written temp files, leave anything else alone."""
        found, others = [], []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if datadir.is_own_file(entry):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime, entry.name, st.st_size))
                elif datadir.is_own_temp(entry):
                    if _age_s(entry) > STALE_TEMP_S:
                        log.warning("removing half-written session file %s (a write was cut short)", entry.name)
                        Path(entry.path).unlink(missing_ok=True)
                elif entry.name != datadir.MARKER:
                    others.append(entry.name)
        for mtime, name, size in sorted(found):
            self._files[name] = Copy(size, mtime)
        if found:
            log.info("disk tier %s: %d saved sessions, %.1f MiB", self.root, len(found),
                     sum(f[2] for f in found) / (1 << 20))
        if others:
            others.sort()
            log.warning("disk tier %s: %d entries are not streamchat session files and are left alone "
                        "(never read, counted or deleted): %s%s", self.root, len(others), ", ".join(others[:5]),
                        " ..." if len(others) > 5 else "")


def _age_s(entry: os.DirEntry) -> float:
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _set_mtime(path: Path, when: float) -> None:
    """The last use survives a restart as the file's mtime."""
    try:
        os.utime(path, (when, when))
    except OSError:
        pass
