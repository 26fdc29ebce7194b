"""The run store as the commands reach it: one node per file, and checks before opening.

:class:`StoreLock` is the ``flock`` that keeps a second node off a database file (and
where a node notes its ops URL and which file its store is); :func:`require_store`,
:func:`check_store_writable` and :func:`open_store` are what ``serve`` and the ``runs``
and ``usage`` commands check and open.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..config import NodeConfig
from ..store import RunStore
from .errors import CliError


class StoreLock:
    """An exclusive ``flock`` on ``<db>.lock``: one node per database file.

    ``acquire`` raises CliError when another process holds it; ``held_elsewhere``
    tells without taking it, and ``holder`` what the holder noted, without making or
    writing anything. A node notes its ops URL and which file its store is.
    """

    def __init__(self, db_path: str) -> None:
        self.path = f"{db_path}.lock"
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"<StoreLock {self.path} {'held' if self._fd is not None else 'free'}>"

    def _try(self) -> bool:
        try:
            Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise CliError(f"cannot open the store's lock {self.path}: {exc.strerror}", 2) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def acquire(self) -> None:
        if not self._try():
            raise CliError(f"another node is using this store ({self.path} is locked)", code=2)

    def note(self, *lines: str) -> None:
        """Write ``lines`` after the pid (e.g. the ops URL, for other commands to find)."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, "\n".join([str(os.getpid()), *lines, ""]).encode(), 0)

    def read(self) -> list[str]:
        """What the holder wrote: its pid, then its notes ([] if none)."""
        try:
            return Path(self.path).read_text().splitlines()
        except OSError:
            return []

    def holder(self) -> list[str] | None:
        """What the process holding the lock wrote (its pid, then its notes), or None
        when none holds it (or there is no lock file). Makes and writes nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self.read()
        finally:
            os.close(fd)  # and with it a shared lock taken
        return None

    def held_elsewhere(self) -> bool:
        if self._try():
            self.release()
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: How a node notes in its lock which file its store is: ``store <st_dev>:<st_ino>``.
STORE_NOTE = "store "


def store_note(db_path: str) -> str:
    """The note that says which file ``db_path`` is now (see :data:`STORE_NOTE`)."""
    found = os.stat(db_path)
    return f"{STORE_NOTE}{found.st_dev}:{found.st_ino}"


def require_store(config: NodeConfig) -> None:
    """CliError unless the config names a store that a node has kept runs in, and, if a
    node runs on it, the file that node has open (not one put in its place)."""
    if config.store.kind == "memory":
        raise CliError(f"{config.source}: store.kind is memory, so the node keeps no runs to read")
    path = config.store.path
    holder = StoreLock(path).holder()
    noted = [n for n in holder or () if n.startswith(STORE_NOTE)]
    if holder and noted:
        try:
            now: str | None = store_note(path)
        except OSError:
            now = None
        if now != noted[0]:
            raise CliError(
                f"the run store {path} was {'deleted' if now is None else 'replaced'} under "
                f"the node that runs on it (pid {holder[0]}): that node refuses new runs, and "
                "an ERROR line in its log names the copy it made of its runs "
                "(docs/operations.md, 'When the store file is deleted')"
            )
    if not Path(path).exists():
        raise CliError(
            f"no run store at {config.store.path}: no node has run with this config yet "
            f"(store.path in {config.source})"
        )


def check_store_writable(config: NodeConfig) -> None:
    """CliError (exit 2) unless this process may write the store the config names: its
    folder (made 0700 if need be; SQLite makes its WAL, and the node its lock, there) and
    the file, if there is one. A mode, an owner, a read-only mount or an immutable file
    can each forbid it."""
    if config.store.kind != "sqlite":
        return
    db = Path(config.store.path)
    elsewhere = f"point store.path (in {config.source}) at one it may"
    effective = os.access in os.supports_effective_ids
    try:
        db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(
            f"cannot make the run store's folder {db.parent}: {exc.strerror}; make it, or "
            f"{elsewhere}",
            code=2,
        ) from None
    if not os.access(db.parent, os.W_OK | os.X_OK, effective_ids=effective):
        raise CliError(
            f"the node may not write the run store's folder {db.parent}: make it writable "
            f"for this user, or {elsewhere}",
            code=2,
        )
    if db.exists() and not os.access(db, os.W_OK, effective_ids=effective):
        raise CliError(
            f"the node may not write the run store's file {db}: make it writable for this "
            f"user (chmod u+w), or {elsewhere}",
            code=2,
        )


def open_store(config: NodeConfig, *, existing: bool = False) -> RunStore:
    """The store the config names (made if need be). With ``existing`` (the ``runs``
    commands, which read what a node kept) a store that is not there is a CliError,
    not an empty store made on the spot."""
    if existing:
        require_store(config)
    if config.store.kind == "memory":
        from ..store.memory import MemoryStore

        return MemoryStore()
    from ..store.sqlite import SqliteStore

    Path(config.store.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return SqliteStore(config.store.path, synchronous=config.store.synchronous)
