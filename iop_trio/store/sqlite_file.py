"""The file under a :class:`~iop_trio.store.sqlite.SqliteStore`: is it still the one it opened?

The store remembers which file it opened (its ``st_dev`` and ``st_ino``), and its writer
checks every ``check_interval`` seconds (a few ``stat`` and ``access`` calls), as every
read does for the file alone, that the file at the path is still that one (and its WAL
the one SQLite made), and that the file and its folder may be written. A
:class:`StoreFile` does those checks and tells a
:class:`~iop_trio.store.group_commit.HealthBoard` what it finds, under the sources
``"access"`` (may not be written: until it may again) and ``"gone"`` (deleted or
replaced: for good). A file gone is rescued: what the writer's connection still holds
is copied to ``<db>.rescued-<time>`` (``VACUUM INTO``), tried again at every check until
made, and made anew when the store closes; one ERROR line says what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Literal

from .base import StoreUnavailable
from .group_commit import HealthBoard

#: The store's log: the file's news are the store's (logger ``iop_trio.store.sqlite``).
log = logging.getLogger("iop_trio.store.sqlite")

#: The health board's sources a StoreFile sets.
GONE = "gone"
ACCESS = "access"

#: What the store logs of a file gone under it (see StoreFile.rescue): once, at ERROR,
#: whether its runs could be copied or not; then as a copy is made later, or at the close.
_GONE_COPIED = (
    "run store %(db)s: %(gone)s; new runs are refused. Every run the node took is copied "
    "to %(copy)s (made again when the node stops): stop the node, remove %(db)s-wal and "
    "%(db)s-shm, move the copy to %(db)s and start the node again"
)
_GONE_NOT_COPIED = (
    "run store %(db)s: %(gone)s; new runs are refused, and no copy of its runs could be "
    "made (%(why)s): make its folder writable (or free space) and keep the node running; "
    "it tries again every %(every)gs and when it stops, and logs where the copy is"
)
_COPIED_AT_LAST = (
    "run store %(db)s: every run the node took is copied to %(copy)s at last: stop the "
    "node, remove %(db)s-wal and %(db)s-shm, move the copy to %(db)s and start it again"
)
_COPIED_AT_CLOSE = (
    "run store %(db)s: its rescue copy %(copy)s has every run as the node left it: move it "
    "to %(db)s (remove %(db)s-wal and %(db)s-shm first) before the next start"
)
_NOT_COPIED_AT_CLOSE = (
    "run store %(db)s: no rescue copy could be made when the node stopped (%(why)s)%(had)s"
)


def uri(path: str, mode: Literal["ro", "rw"]) -> str:
    """A ``file:`` URI that opens ``path`` in ``mode`` and never creates it."""
    return f"{Path(os.path.abspath(path)).as_uri()}?mode={mode}"


def identity(path: str, *, missing_ok: bool = True) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path``: which file it is; None if there is none (with
    ``missing_ok``; else FileNotFoundError)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise
    return found.st_dev, found.st_ino


_EFFECTIVE_IDS = os.access in os.supports_effective_ids


def access_problem(path: str) -> str | None:
    """Why this process may not write the database file or its folder (where SQLite
    makes its WAL and shared-memory files), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.access(folder, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE_IDS):
        return (
            f"its folder {folder} may not be written by the node (make it writable, or "
            "remount its file system read-write)"
        )
    if not os.access(path, os.W_OK, effective_ids=_EFFECTIVE_IDS):
        return (
            f"its file {path} may not be written by the node (chmod u+w it, or remount its "
            "file system read-write)"
        )
    return None


def new_private_file(prefix: str) -> str:
    """Make a new empty file ``<prefix><time>`` (``-2``, ``-3``... after it if taken),
    0600, and return its path: what ``VACUUM INTO`` may write (it holds every prompt)."""
    stamp = prefix + time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 101):
        name = stamp if n == 1 else f"{stamp}-{n}"
        try:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            continue
        return name
    raise FileExistsError(f"{stamp} and 99 more names after it are taken")


def create_private(path: str) -> None:
    """Create the database file 0600 (SQLite gives its WAL and shared-memory files the
    same mode): every prompt and output is in it. An existing file that others may read
    is left as it is, with a warning. A missing folder is left to SQLite to report (the
    CLI makes the store's folder, 0700)."""
    if path == ":memory:" or path.startswith("file:"):
        return
    if not os.path.isdir(os.path.dirname(path) or "."):
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if mode & 0o077:
        log.warning(
            "run store %s may be read by others (mode %04o): it holds every prompt and "
            "output; chmod 600 it",
            path,
            mode,
        )


class StoreFile:
    """The database file at ``path`` as a store opened it, and the checks that it still is.

    Made in the store's constructor; :meth:`identity_problem` (``wal=False``),
    :meth:`gone` and :meth:`check_on_read` may be called from any thread, the rest only
    from the writer thread. Problems go to ``board`` (see the module docstring).
    """

    def __init__(self, path: str, board: HealthBoard, *, check_interval: float) -> None:
        self.path = path
        self.check_interval = check_interval
        self._board = board
        # (st_dev, st_ino) of the database file as first opened (set before the writer
        # says it opened), and the writer thread's own: its WAL's (once seen), when the
        # next check of the file is due (monotonic), the rescue copy of a file gone
        self._identity: tuple[int, int] | None = None
        self._wal_identity: tuple[int, int] | None = None
        self._next_check = 0.0
        self._rescue_path: str | None = None
        self._rescued = False
        self._gone_told = False

    def __repr__(self) -> str:
        state = "unopened" if self._identity is None else self.gone() or "checked"
        return f"<StoreFile {self.path!r} {state} rescue={self._rescue_path!r}>"

    @property
    def opened(self) -> bool:
        """Whether the store has opened the file once (and knows which it is)."""
        return self._identity is not None

    def gone(self) -> str | None:
        """What became of the file, if it was deleted or replaced under the store."""
        return self._board.problem(GONE)

    def note_opened(self) -> None:
        """The writer opened the file: note which it is (the first time) and its WAL."""
        if self._identity is None:
            self._identity = identity(self.path)
        self._wal_identity = identity(self.path + "-wal")  # SQLite makes it lazily

    def note_wal(self) -> None:
        """After a commit: note the WAL if this is the first write to make it."""
        if self._wal_identity is None:
            self._wal_identity = identity(self.path + "-wal")

    def wal_size(self) -> int:
        """The WAL's size in bytes (0 if there is none): what it holds since it was last
        reset, as the writer truncates it then (``journal_size_limit``)."""
        try:
            return os.stat(self.path + "-wal").st_size
        except OSError:
            return 0

    def forget_wal(self) -> None:
        """The writer closed its connection: closing the last one may delete the WAL."""
        self._wal_identity = None

    def check_reopen(self) -> None:
        """Before the writer opens the file again: raise StoreUnavailable (a passing
        failure: the writes wait, for the close) if it is gone."""
        gone = self.gone() or self.identity_problem(wal=False)
        if gone is not None:
            self._board.set(GONE, gone)
            raise StoreUnavailable(gone)

    def check_on_read(self) -> tuple[str | None, bool]:
        """Any thread, before a read: what became of the file, if it is gone, and whether
        that was found just now (a stat: each read looks too)."""
        gone = self.gone()
        if gone is not None:
            return gone, False
        gone = self.identity_problem(wal=False)
        if gone is None:
            return None, False
        self._board.set(GONE, gone)
        return gone, True

    def tending_due(self) -> bool:
        """Whether the file is due a check, or is gone and the writer has not said so."""
        if self._identity is None:  # never opened: nothing to check
            return False
        return time.monotonic() >= self._next_check or (
            not self._gone_told and self.gone() is not None
        )

    def time_to_check(self) -> float | None:
        """Seconds until the file is due a check (None: never)."""
        if self._identity is None:
            return None
        return max(0.0, self._next_check - time.monotonic())

    def tend(self, conn: sqlite3.Connection | None, *, now: bool = False) -> bool:
        """When due (or ``now``): see that the file (and the WAL) is the one opened, and
        that the file and its folder may be written; tell the board what is wrong. A file
        gone is rescued from ``conn`` (see :meth:`rescue`) and never checked again.
        Returns whether it looked."""
        if self._identity is None or not (now or self.tending_due()):
            return False
        self._next_check = time.monotonic() + self.check_interval
        if self.gone() is None:
            self.note_wal()
            gone = self.identity_problem(wal=True)
            if gone is None:
                self._check_access()
                return True
            self._board.set(GONE, gone)
        if not self._rescued:
            self.rescue(conn)
        return True

    def _check_access(self) -> None:
        problem = access_problem(self.path)
        if self._board.set(ACCESS, problem):
            if problem is None:
                log.warning("run store %s may be written again", self.path)
            else:
                log.warning(
                    "run store %s cannot be written: %s; new runs are refused until it can",
                    self.path,
                    problem,
                )

    def identity_problem(self, *, wal: bool) -> str | None:
        """What became of the file the store opened (and, with ``wal``, of its WAL) if it is
        not at the path any more: deleted, or replaced by another. None if it is, or if
        that cannot be told (a folder that may not be searched: the access check says it).
        Any thread; with ``wal`` only the writer's (which makes the WAL anew)."""
        names = [(self.path, self._identity, "file")]
        if wal:
            names.append((self.path + "-wal", self._wal_identity, "WAL"))
        for name, opened, what in names:
            if opened is None:
                continue
            try:
                now = identity(name, missing_ok=False)
            except FileNotFoundError:
                return f"its {what} {name} was deleted while the node had it open"
            except OSError:
                return None
            if now != opened:
                return f"its {what} {name} was replaced by another file while the node had it open"
        return None

    def rescue(self, conn: sqlite3.Connection | None, *, closing: bool = False) -> None:
        """With the file gone: copy what the writer's connection ``conn`` still holds (every
        run the node took) to the rescue file, ``<db>.rescued-<time>``, 0600; the first
        time, say in one ERROR line what happened and what to do. ``closing``: make the
        copy anew (beside it, then put in its place), with everything written since."""
        gone = self.gone()
        assert gone is not None
        why = self._copy(conn, gone)
        had_copy, self._rescued = self._rescued, self._rescued or not why
        words = {
            "db": self.path,
            "gone": gone,
            "copy": self._rescue_path,
            "why": why,
            "every": self.check_interval,
            "had": f"; {self._rescue_path} has the runs as they were" if had_copy else "",
        }
        extra = {"store": self.path, "rescue": self._rescue_path}
        if not self._gone_told:
            self._gone_told = True
            log.error(_GONE_NOT_COPIED if why else _GONE_COPIED, words, extra=extra)
        elif closing:
            log.warning(_NOT_COPIED_AT_CLOSE if why else _COPIED_AT_CLOSE, words, extra=extra)
        elif not why:
            log.warning(_COPIED_AT_LAST, words, extra=extra)

    def _copy(self, conn: sqlite3.Connection | None, gone: str) -> str:
        """Make the rescue copy (see :meth:`rescue`); "" if made, else why not."""
        target = self._rescue_path
        if conn is None or conn.in_transaction:
            return "the node does not hold it open: it let go of it after a write failed"
        try:
            made = new_private_file(
                f"{self.path}.rescued-" if target is None else f"{target}.part-"
            )
            try:
                conn.execute("VACUUM INTO ?", (made,))
                if target is not None:
                    os.replace(made, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(made)
                raise
        except (sqlite3.Error, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if target is None:
            self._rescue_path = made
            self._board.set(GONE, f"{gone}; its runs are copied to {made}")
        return ""
