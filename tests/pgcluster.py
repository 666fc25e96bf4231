"""A throwaway PostgreSQL cluster for tests: Debian's server binaries, one cluster per test session.

Shared by every test folder (`import pgcluster`, as `faults`): tests/conftest.py
starts one cluster per session (`pg_cluster`) and hands each test a database
of its own (`pg_url`), dropped when the test ends.

The cluster lives in a fresh folder in memory (/dev/shm; else the system
temp dir) and listens on a unix socket in that folder only (no TCP port, so concurrent test runs never
collide). PostgreSQL refuses to run as root, so as root `initdb` and `pg_ctl`
run as the `postgres` user that Debian's package creates; anyone else runs
them as themselves. fsync is off: these tests kill clients, never the server or
the machine, so what a commit promises them does not depend on the disk.

A cluster records the test process that owns it; the next run stops and
deletes any whose owner is gone (a run killed before its teardown).

Nothing here skips: a missing or broken server is a `ClusterError` whose
message says what to install or what the server logged.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

ADMIN_USER = "postgres"
SERVER_SETTINGS = {
    "listen_addresses": "''",
    "fsync": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "log_min_messages": "warning",
    "dynamic_shared_memory_type": "mmap",  # segments inside the data folder, deleted with it (not /dev/shm)
}
INSTALL_HINT = "install Debian's postgresql package (`make postgres`, as root)"
PREFIX = "streamchat-pg-"
OWNER_FILE = "owner.pid"  # the test process the cluster belongs to


class ClusterError(RuntimeError):
    """The test cluster could not be found, initialised or started; the message says why."""


def find_bindir() -> Path:
    """Where initdb and pg_ctl are: $STREAMCHAT_PG_BINDIR, Debian's newest version, else PATH."""
    override = os.environ.get("STREAMCHAT_PG_BINDIR")
    if override:
        candidates = [Path(override)]  # named on purpose: no silent fallback to another version
    else:
        debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _version(p.parent.name))
        on_path = shutil.which("initdb")
        candidates = list(reversed(debian)) + ([Path(on_path).resolve().parent] if on_path else [])
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    where = f" in STREAMCHAT_PG_BINDIR={override}" if override else ""
    raise ClusterError(f"PostgreSQL server binaries (initdb, pg_ctl) not found{where}: {INSTALL_HINT}")


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


class Cluster:
    """One initdb'd, started cluster in `root`; `url(name)` names a database in it."""

    def __init__(self, root: Path, bindir: Path) -> None:
        self.root = root
        self.bindir = bindir
        self.data = root / "data"
        self.log = root / "server.log"
        self._names = itertools.count()

    def url(self, dbname: str) -> str:
        """A SQLAlchemy URL for `dbname` over the cluster's unix socket."""
        return f"postgresql+psycopg://{ADMIN_USER}@/{dbname}?host={self.root}"

    def admin(self) -> psycopg.Connection:
        """An autocommit connection to the `postgres` database, for CREATE/DROP DATABASE."""
        return psycopg.connect(host=str(self.root), user=ADMIN_USER, dbname="postgres", autocommit=True)

    def create_database(self) -> str:
        """A fresh empty database (a copy of template0); returns its name."""
        name = f"test_{os.getpid()}_{next(self._names)}"
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 ENCODING \'UTF8\' STRATEGY FILE_COPY')
        return name

    def drop_database(self, name: str) -> None:
        """Drop `name`, ending any connection a test left open to it."""
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def start(self) -> None:
        """initdb, then pg_ctl start, waiting until the server takes connections."""
        initdb = [str(self.bindir / "initdb"), "-D", str(self.data), "-U", ADMIN_USER, "--auth=trust",
                  "--encoding=UTF8", "--locale=C", "--no-sync", "--no-instructions"]
        self._run(initdb, "initdb")
        with open(self.data / "postgresql.conf", "a") as conf:
            settings = {**SERVER_SETTINGS, "unix_socket_directories": f"'{self.root}'"}
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                   "start"], "pg_ctl start")

    def stop(self) -> None:
        """Stop the server at once (nothing in it is kept) and delete its folder."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                          "pg_ctl stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, argv: list[str], what: str) -> None:
        as_user = ["runuser", "-u", ADMIN_USER, "--"] if os.geteuid() == 0 else []
        done = subprocess.run(as_user + argv, capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise ClusterError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}\n{log}")


def start_cluster() -> Cluster:
    """A started cluster in a new temp folder; `stop()` it. ClusterError (and nothing left behind) if it fails."""
    bindir = find_bindir()
    _reap_orphans(bindir)
    root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=_memory_folder()))
    (root / OWNER_FILE).write_text(str(os.getpid()))
    cluster = Cluster(root, bindir)
    try:
        if os.geteuid() == 0:
            _give_to_admin_user(root)
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _reap_orphans(bindir: Path) -> None:
    """Stop and delete clusters left by test runs that were killed before they could (their owner is gone)."""
    for parent in {Path(_memory_folder() or tempfile.gettempdir()), Path(tempfile.gettempdir())}:
        for root in parent.glob(PREFIX + "*"):
            try:
                owner = int((root / OWNER_FILE).read_text())
                os.kill(owner, 0)
            except ProcessLookupError:
                Cluster(root, bindir).stop()
            except (OSError, ValueError):
                continue  # not ours to judge (unreadable, half written, another user's)


def _memory_folder() -> str | None:
    """/dev/shm where there is one: a CREATE DATABASE there takes ~30 ms, on a busy disk ~300."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _give_to_admin_user(root: Path) -> None:
    try:
        owner = pwd.getpwnam(ADMIN_USER)
    except KeyError:
        raise ClusterError(f"no `{ADMIN_USER}` user to run the server as: {INSTALL_HINT}") from None
    os.chown(root, owner.pw_uid, owner.pw_gid)
