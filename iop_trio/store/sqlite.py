"""A durable run store on SQLite (standard library :mod:`sqlite3`), with group commit.

Design
------

One dedicated **writer thread** owns the only writing connection. Every
write (``create``, ``append``, ``interrupt_unfinished``, ``prune``) is a job
put on a thread-safe FIFO, synchronously, before the calling task's first
checkpoint; the caller then parks in :func:`trio.lowlevel.wait_task_rescheduled`.
The writer takes *everything* pending (up to ``max_batch`` jobs), runs it in
one transaction, each job inside its own SAVEPOINT, commits once, and wakes
the waiters with one :meth:`trio.lowlevel.TrioToken.run_sync_soon` call per
Trio run. So one appender pays one commit, and 64 concurrent appenders share
a few: the batch grows by itself while the previous commit is on its way,
with no timer. Writes nobody waits for (a run's deltas, ``append_nowait``) are
the exception: alone, they wait up to :data:`LINGER` seconds for company (a write
somebody waits for ends the wait), so a stream of tokens costs a commit per
``LINGER``, not one per token. A job that fails (a refused event, a duplicate run) is rolled
back to its savepoint and raises :class:`StoreError` in its caller; the
other jobs of the batch are committed.

Each event is folded into the run's row with :func:`iop_trio.lifecycle.fold` itself,
in the writer, against the state committed before it (earlier jobs of the
same batch included). The writer keeps the fold state of live runs in memory
so that an append costs one INSERT and one UPDATE; it is dropped whenever a
job or a transaction fails, and reloaded from the file.

Reads (``get``, ``list_runs``, ``events``) run in Trio worker threads on a
small pool of separate connections, opened read-only (``mode=ro``: a reader never
creates a file where the database was). In WAL mode they never block
the writer nor wait for it, and each read starts a fresh snapshot, so a read
sees every write whose call has returned (those were committed first).

Durability
----------

The database is in WAL mode with ``synchronous=NORMAL`` by default: a commit
writes the WAL to the operating system without ``fsync``. What a returned
call wrote survives a crash or SIGKILL of the process, but a power loss or
OS crash may lose the last transactions before the next checkpoint (the
database stays consistent: whole transactions are lost, never half of one).
Pass ``synchronous="FULL"`` to fsync every commit (each batch) and survive
power loss too, at the cost of throughput.

Faults
------

A batch that fails for a passing reason (SQLITE_FULL, SQLITE_IOERR,
SQLITE_BUSY, ...: see :data:`_PASSING`) is rolled back and retried, with
backoff, on a fresh connection that first checkpoints the WAL (a full disk may
have stopped the last one, and a WAL not checkpointed only grows), until it
commits: nothing taken is lost or reordered. Meanwhile
:meth:`SqliteStore.health` says the store cannot write (and why), the change
is logged once each way and told to the
:meth:`~SqliteStore.watch_health` listeners, and ``create`` refuses new runs
at once with :class:`StoreUnavailable`. Once :meth:`aclose` is called, such
writes get ``close_timeout`` more seconds; the ones still not made then
fail with StoreUnavailable (their runs are INTERRUPTED at the next start).
The WAL is checkpointed every :data:`WAL_AUTOCHECKPOINT` pages and kept to
:data:`JOURNAL_SIZE_LIMIT` bytes.

The file
--------

The store remembers which file it opened (its ``st_dev`` and ``st_ino``), and the
writer checks every ``check_interval`` seconds (a few ``stat`` and ``access``
calls, in its own thread), as every read does for the file alone, that the
file at the path is still that one (and its WAL the one SQLite made), and that
the file and its folder may be written. A file or folder that may not be
written (a ``chmod``, a read-only mount) makes the store unwritable in
:meth:`~SqliteStore.health` until it may be written again, logged once each
way. A file (or WAL) deleted or replaced under the store makes it unwritable
for good: the writer's connection still holds the old file open, so the
runs are not lost yet, but nothing else can reach them, and the next start
would find an empty store or another one. So ``create`` and the writer refuse
new runs (:class:`StoreUnavailable`), reads raise StoreUnavailable, the
writer copies everything its connection holds to ``<db>.rescued-<time>``
(``VACUUM INTO``; tried again every check until it is made) and says in one
ERROR line what happened and what to do; writes of the runs the node has go
on into the old file, and when the store closes the copy is made anew with
them. An operator stops the node, moves the copy to the path and starts it
again, with every run it took.

Cancellation
------------

``append`` takes the event before its first checkpoint; if the caller is
cancelled while waiting, the event is still written, in order. ``create``,
``interrupt_unfinished`` and ``prune`` are all-or-nothing: cancelled while the
writer is not committing the job (before it took the job, or between two
attempts at a batch that failed for a passing reason, see Faults), it is
withdrawn, nothing happens and :class:`trio.Cancelled` is raised; cancelled
during an attempt, the call waits for that attempt: committed, it returns
normally (the cancellation is delivered at the caller's next checkpoint), else
it raises StoreUnavailable and nothing happens. So a caller can bound a create
by cancelling it (the run manager does, by ``store_grace``), and no run it gave
up on is stored later. A batch whose every job is withdrawn is done; the writer
then learns when writes go through again by a probe (see
:meth:`SqliteStore._probe`). Reads are not interrupted once their thread runs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

import attrs
import trio

from ..lifecycle import RunState, fold
from ..model import (
    CHARS_PER_TOKEN,
    LATEST_RUNS,
    LIVE_STATUSES,
    TERMINAL_STATUSES,
    EventKind,
    RunEvent,
    RunQuery,
    RunRecord,
    RunSpec,
    RunStatus,
    Usage,
)
from .base import (
    HealthListener,
    RunStore,
    StoreError,
    StoreHealth,
    StoreUnavailable,
    UsageGroup,
    UsageTotal,
    created_record,
    refused_error,
    unfinished_usage,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The schema this code writes; PRAGMA user_version of the file. Versions 1 (without
#: tenants, priorities and retry hints) and 2 (without the runs' token columns and the
#: deltas' token counts) are migrated in place when the store opens.
SCHEMA_VERSION = 3

#: Primary SQLite result codes of failures that pass (the disk fills, an I/O error,
#: another process holds a lock too long): the batch is retried, never refused.
_PASSING = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
    }
)
#: What makes a store unwritable, in the order its health says them: its file deleted or
#: replaced under it, a file or folder it may not write, writes that fail.
_PROBLEM_SOURCES = ("gone", "access", "write")
#: Seconds the writer lets writes nobody waits for (``append_nowait``: a run's deltas)
#: gather before it commits them, unless a write somebody waits for comes first. At a
#: token every 20 ms a commit per delta cost more CPU than the rest of the node did.
#: It bounds what a crash can lose of a run's output in time, as the run's every 64th
#: delta (which it waits for) bounds it in count; the log left is whole either way.
LINGER = 0.2
#: Backoff between attempts at a batch whose writes fail (seconds, doubling).
RETRY_INITIAL = 0.05
RETRY_MAX = 1.0
#: After aclose(), how long writes that cannot be made are still retried (by default).
CLOSE_TIMEOUT = 5.0
#: Seconds between the writer's checks that the database file is the one it opened and
#: that it and its folder may be written (see the module docstring's The file).
CHECK_INTERVAL = 2.0
#: Bytes a probe writes (see SqliteStore._probe): what the writes given up on needed,
#: within these bounds.
PROBE_MIN = 4096
PROBE_MAX = 1024 * 1024
#: The run id of a probe's row; no run has it (a run id starts with a letter or digit).
_PROBE_RUN = "\x00probe"
#: What the store logs of a file gone under it (see SqliteStore._rescue): once, at ERROR,
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
#: The WAL is checkpointed every this many pages (4 KiB each) ...
WAL_AUTOCHECKPOINT = 256
#: ... and truncated to at most this many bytes when it is reset, so a small disk holds.
JOURNAL_SIZE_LIMIT = 1024 * 1024

_SCHEMA = (
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,              -- creation order; newest first = id DESC
        run_id TEXT NOT NULL UNIQUE,
        target TEXT NOT NULL,
        status TEXT NOT NULL,
        background INTEGER NOT NULL,
        created REAL NOT NULL,
        prompt TEXT NOT NULL,
        messages TEXT NOT NULL,              -- JSON [[role, content], ...]
        options TEXT NOT NULL,               -- JSON object
        started REAL,
        finished REAL,
        reason TEXT NOT NULL,
        message TEXT NOT NULL,
        last_seq INTEGER NOT NULL,
        usage TEXT,                          -- JSON object or NULL
        tenant TEXT NOT NULL DEFAULT '',
        priority INTEGER NOT NULL DEFAULT 0,
        retry_after REAL,                    -- a REJECTED run's hint (seconds) or NULL
        -- the usage's counts again, as numbers, for totals (usage_totals); NULL: none
        prompt_tokens INTEGER,
        completion_tokens INTEGER,
        prompt_estimated INTEGER NOT NULL DEFAULT 0,
        completion_estimated INTEGER NOT NULL DEFAULT 0
    )
    """,
    "CREATE INDEX runs_status ON runs (status, id)",
    "CREATE INDEX runs_target ON runs (target, id)",
    "CREATE INDEX runs_tenant ON runs (tenant, id)",
    "CREATE INDEX runs_finished ON runs (finished)",
    """
    CREATE TABLE events (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        time REAL NOT NULL,
        text TEXT NOT NULL,
        reason TEXT NOT NULL,
        message TEXT NOT NULL,
        usage TEXT,                          -- JSON object or NULL
        retry_after REAL,
        tokens INTEGER,                      -- a delta's engine tokens; NULL: before v3
        PRIMARY KEY (run_id, seq)
    ) WITHOUT ROWID
    """,
)

#: From schema version 1 to 2.
_MIGRATE_1_TO_2 = (
    "ALTER TABLE runs ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE runs ADD COLUMN retry_after REAL",
    "CREATE INDEX runs_tenant ON runs (tenant, id)",
    "ALTER TABLE events ADD COLUMN retry_after REAL",
)
#: From schema version 2 to 3 (then :func:`_fill_token_columns`). A delta stored before
#: reads as one engine token (it holds one chunk at least).
_MIGRATE_2_TO_3 = (
    "ALTER TABLE runs ADD COLUMN prompt_tokens INTEGER",
    "ALTER TABLE runs ADD COLUMN completion_tokens INTEGER",
    "ALTER TABLE runs ADD COLUMN prompt_estimated INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE runs ADD COLUMN completion_estimated INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE events ADD COLUMN tokens INTEGER",
)

#: The columns that hold a run's usage as numbers (:func:`_usage_columns`).
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "prompt_estimated", "completion_estimated")
_RUN_COLUMNS = (
    "run_id, target, status, background, created, prompt, messages, options, "
    "started, finished, reason, message, last_seq, usage, tenant, priority, retry_after, "
    + ", ".join(_USAGE_FIELDS)
)
_EVENT_COLUMNS = "run_id, seq, kind, time, text, reason, message, usage, retry_after, tokens"
# Folding reads and writes only the columns lifecycle.fold() looks at or
# changes, so a delta does not reload a long prompt or chat history.
_FOLD_FIELDS = (
    "status", "last_seq", "started", "finished", "reason", "message", "usage", "retry_after",
    *_USAGE_FIELDS,
)  # fmt: skip
_FOLD_COLUMNS = "run_id, " + ", ".join(_FOLD_FIELDS)
_LIVE = tuple(sorted(s.value for s in LIVE_STATUSES))
_TERMINAL = tuple(sorted(s.value for s in TERMINAL_STATUSES))


@attrs.frozen
class SqliteStoreStatistics:
    """Counters of a :class:`SqliteStore`, for tests, benchmarks and debugging.

    * ``commits``: transactions the writer committed (one per batch).
    * ``jobs``: write calls the writer has run (refused ones and failed batches too).
    * ``events``: events written (a ``create`` writes one).
    * ``pending``: write calls waiting for the writer to take them.
    """

    commits: int
    jobs: int
    events: int
    pending: int

    @property
    def mean_batch(self) -> float:
        """Jobs per commit (0.0 before the first commit)."""
        return self.jobs / self.commits if self.commits else 0.0


class _Job(Generic[T]):
    """One write call: its work (run by the writer thread) and how to wake its task.

    ``plan`` describes a create, an append or a sync as data, so that a batch of
    only such jobs is made with a few statements (see :meth:`SqliteStore._bulk`);
    ``work`` makes the job alone, in its own savepoint.
    """

    __slots__ = (
        "done",
        "error",
        "events",
        "given_up",
        "label",
        "plan",
        "result",
        "settled",
        "size",
        "taken",
        "task",
        "token",
        "waited",
        "withdrawable",
        "withdrawn",
        "work",
    )

    def __init__(
        self,
        label: str,
        work: Callable[[sqlite3.Connection], T],
        *,
        withdrawable: bool,
        events: int = 0,
        plan: tuple[Any, ...] | None = None,
        size: int = 0,
    ) -> None:
        self.label = label
        self.size = size  # about how many bytes it writes (the room a probe asks for)
        self.work = work
        self.plan = plan
        self.withdrawable = withdrawable
        self.events = events
        self.token = trio.lowlevel.current_trio_token()
        # read and written only in the Trio thread
        self.task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        # whether a task waits for this job's commit (the writer lingers only if none does)
        self.waited = True
        # called (in the Trio thread) once it is committed
        self.done: Callable[[], None] | None = None
        # guarded by the store's lock: taken into a batch; left out of the batch's next
        # attempt (a withdrawable job cancelled while not being committed); its caller gave
        # up while an attempt was on (it ends with that attempt); the writer is done with it
        self.taken = False
        self.withdrawn = False
        self.given_up = False
        self.settled = False
        # written by the writer thread before the wake-up
        self.result: T | None = None
        self.error: StoreError | None = None


class SqliteStore(RunStore):
    """A :class:`RunStore` in one SQLite file, durable across process crashes.

    ``path`` is the database file; it is created (with its schema) if it does
    not exist, and its directory must exist. Nothing is opened until the first
    call; :meth:`ready` opens the file at once and reports a problem (not a
    database, a newer schema version) as :class:`StoreError`, which every
    later call raises too. See the module docstring for the writer thread,
    group commit, durability (``synchronous``) and cancellation.

    ``max_batch`` bounds the jobs committed in one transaction, ``readers`` the
    read connections (and so concurrent reads), ``busy_timeout`` (seconds) how
    long to wait for a lock held by another process before failing,
    ``close_timeout`` how long writes that fail are still retried after
    :meth:`aclose`, ``linger`` how long writes nobody waits for gather before they
    are committed (see :data:`LINGER`; 0 commits them at once), ``check_interval``
    how often the writer checks the file (see the module docstring's The file).

    The store must be closed with :meth:`aclose`, which waits until every write
    already taken is committed. Calls after it raise StoreError.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        max_batch: int = 4096,
        readers: int = 4,
        busy_timeout: float = 5.0,
        close_timeout: float = CLOSE_TIMEOUT,
        linger: float = LINGER,
        check_interval: float = CHECK_INTERVAL,
    ) -> None:
        self.path = os.fspath(path)
        if self.path in ("", ":memory:") or self.path.startswith("file:"):
            raise ValueError(f"SqliteStore needs the path of a database file, not {self.path!r}")
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', not {synchronous!r}")
        if max_batch < 1 or readers < 1 or busy_timeout < 0 or not check_interval > 0:
            raise ValueError(
                "max_batch and readers must be >= 1, busy_timeout >= 0, check_interval > 0"
            )
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.busy_timeout = busy_timeout
        self.close_timeout = close_timeout
        self.linger = linger
        self.check_interval = check_interval
        # the job queue and the writer's life, guarded by _lock
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._pending: collections.deque[_Job[Any]] = collections.deque()
        self._lingering = False  # the writer waits for company for writes nobody waits for
        self._thread: threading.Thread | None = None
        self._closing = False
        # set by the writer once the file is open (or failed to open)
        self._opened = threading.Event()
        self._open_error: StoreError | None = None
        # read connections: idle ones, guarded by _readers_lock
        self._readers_lock = threading.Lock()
        self._idle_readers: list[sqlite3.Connection] = []
        self._readers_closed = False
        self._read_limiter = trio.CapacityLimiter(readers)
        # test seam: called in the writer thread with the labels of each batch it has
        # taken, before its transaction begins (a test can hold the writer here)
        self._before_batch: Callable[[list[str]], None] | None = None
        # test seam: statements the writer runs before each attempt at a batch (a test
        # fills the "disk" with PRAGMA max_page_count, then lifts it)
        self._test_pragmas: list[str] = []
        # whether writes go through: what each of _PROBLEM_SOURCES finds wrong now (with
        # since when), and the health they make; guarded by _health_lock, read anywhere
        self._health_lock = threading.Lock()
        self._problems: dict[str, tuple[float, str]] = {}
        self._health = StoreHealth()
        self._health_listeners: list[tuple[trio.lowlevel.TrioToken, HealthListener]] = []
        self._close_deadline: float | None = None  # monotonic; set by aclose()
        self._conn: sqlite3.Connection | None = None  # the writer thread's connection
        # guarded by _lock: the writer is in an attempt at a batch (see _write)
        self._attempting = False
        # the writer thread's own: the room the last batch given up on needed (see _probe)
        self._probe_size = PROBE_MIN
        # (st_dev, st_ino) of the database file as first opened, set before _opened
        self._identity: tuple[int, int] | None = None
        # the writer thread's own: its WAL's (once seen), when the next check of the file
        # is due (monotonic), the rescue copy of a file gone (see _tend_file)
        self._wal_identity: tuple[int, int] | None = None
        self._next_check = 0.0
        self._rescue_path: str | None = None
        self._rescued = False
        self._gone_told = False
        # the writer thread's own: partial records (see _fold_record) of the live runs it
        # has seen, as in the database, so an append needs no SELECT; cleared when in doubt
        self._folds: dict[str, RunRecord] = {}
        # counters, written by the writer thread only
        self._commits = 0
        self._jobs = 0
        self._events = 0

    def __repr__(self) -> str:
        with self._lock:
            pending = len(self._pending)
            closing = self._closing
            started = self._thread is not None
        if closing:
            state = "closed"
        elif not started:
            state = "unopened"
        elif not self._opened.is_set():
            state = "opening"
        elif self._open_error is not None:
            state = "broken"
        elif not self._health.writable:
            state = f"open, {self._health}"
        else:
            state = "open"
        return (
            f"<SqliteStore {self.path!r} {state} synchronous={self.synchronous} "
            f"commits={self._commits} jobs={self._jobs} pending={pending}>"
        )

    def statistics(self) -> SqliteStoreStatistics:
        """The writer's counters; see :class:`SqliteStoreStatistics`."""
        with self._lock:
            pending = len(self._pending)
        return SqliteStoreStatistics(
            commits=self._commits, jobs=self._jobs, events=self._events, pending=pending
        )

    # --- health ------------------------------------------------------------------------

    def health(self) -> StoreHealth:
        """Whether writes go through now (see the module docstring's Faults)."""
        return self._health

    def watch_health(self, listener: HealthListener) -> None:
        """Call ``listener(health)`` in this Trio run's thread whenever writes start or stop
        going through."""
        self._health_listeners.append((trio.lowlevel.current_trio_token(), listener))

    def _set_problem(self, source: str, problem: str | None) -> bool:
        """Record what ``source`` (one of :data:`_PROBLEM_SOURCES`) finds wrong now, or
        None, and tell the listeners if that makes the store writable or not. Returns
        whether ``source`` began or ceased to find a problem (a new text for the same
        one is kept, and returns False). Any thread."""
        with self._health_lock:
            had = self._problems.get(source)
            if problem is None:
                self._problems.pop(source, None)
            else:
                self._problems[source] = (had[0] if had else time.time(), problem)
            health = next(
                (
                    StoreHealth(False, *self._problems[name])
                    for name in _PROBLEM_SOURCES
                    if name in self._problems
                ),
                StoreHealth(),
            )
            flipped = health.writable != self._health.writable
            self._health = health
            if flipped:  # told in the order the changes were made
                for token, listener in list(self._health_listeners):
                    with contextlib.suppress(trio.RunFinishedError):
                        token.run_sync_soon(listener, health)
        return (had is None) != (problem is None)

    def _gone(self) -> str | None:
        """What became of the file, if it was deleted or replaced under the store."""
        found = self._problems.get("gone")
        return None if found is None else found[1]

    def _writes_fail(self, problem: str) -> None:
        # in the writer thread
        if self._set_problem("write", problem):
            log.warning(
                "run store %s cannot write (%s); writes wait and are retried, new runs "
                "are refused until it can",
                self.path,
                problem,
            )

    def _writes_go_through(self) -> None:
        # in the writer thread, after each commit: only it sets "write", so the look is safe
        if "write" in self._problems and self._set_problem("write", None):
            log.warning("run store %s writes again", self.path)

    # --- the RunStore interface ----------------------------------------------------------

    async def ready(self) -> None:
        """Open the database now (if not yet) and raise StoreError if it cannot be used."""
        self._start()
        with self._lock:
            never_opened = self._thread is None
        if never_opened:  # closed before its first use
            await trio.lowlevel.checkpoint()
            raise StoreError(f"the store {self.path!r} is closed")
        if not self._opened.is_set():
            await trio.to_thread.run_sync(self._opened.wait, abandon_on_cancel=True)
        else:
            await trio.lowlevel.checkpoint()
        if self._open_error is not None:
            raise StoreError(str(self._open_error)) from self._open_error

    async def create(
        self, record: RunRecord, event: RunEvent, *, then: Sequence[RunEvent] = ()
    ) -> None:
        """Store a new run, its QUEUED event (seq 1) and the events ``then`` after it, in
        one transaction; durable when it returns.

        Raises StoreError if the run exists, if ``event`` is not the QUEUED
        event of ``record`` with seq 1 or the lifecycle refuses one of ``then``
        (checked before anything is written), or if ``record.options`` cannot be
        JSON (options are stored as JSON: a tuple comes back as a list, a
        non-string key as a string), and StoreUnavailable at once while the store
        cannot write. All or nothing under cancellation, however long the writes fail:
        cancelled while not being committed, it is withdrawn and never written (see the
        module docstring's Cancellation).
        """
        health = self._health
        if not health.writable:
            await trio.lowlevel.checkpoint()
            raise StoreUnavailable(f"the run store cannot write: {health.problem}")
        try:
            created = created_record(record, event, then)
        except StoreError:
            await trio.lowlevel.checkpoint()
            raise
        try:
            row = _run_row(created)
        except (TypeError, ValueError) as exc:
            await trio.lowlevel.checkpoint()
            raise StoreError(f"run {record.run_id}: options are not JSON: {exc}") from exc
        event_rows = [_event_row(e) for e in (event, *then)]
        # what the writer keeps of the run to fold later appends into (nothing once it ended)
        kept = None
        if not created.status.terminal:
            kept = _fold_record((record.run_id, *_fold_values(created)))

        def work(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES ({_marks(len(row))})", row)
            except sqlite3.IntegrityError as exc:
                raise StoreError(f"run {record.run_id} exists") from exc
            _insert_rows(conn, "events", _EVENT_COLUMNS, event_rows)
            if kept is not None:
                self._folds[record.run_id] = attrs.evolve(kept)

        plan = ("create", record.run_id, row, event_rows, kept)
        size = sum(len(v) for r in (row, *event_rows) for v in r if isinstance(v, str))
        job = _Job("create", work, withdrawable=True, events=len(event_rows), plan=plan, size=size)
        await self._write(job)

    async def append(self, event: RunEvent) -> None:
        """Append one event to its run and fold it into the record; see :meth:`RunStore.append`.

        Raises StoreError, once the batch is committed, for an unknown run, a
        seq that is not the next one or a move the lifecycle table refuses;
        nothing of that event is stored. If the caller was cancelled while
        waiting, such an error is only logged.
        """

        def work(conn: sqlite3.Connection) -> None:
            self._append(conn, event)

        plan = ("append", event)
        await self._write(_Job("append", work, withdrawable=False, events=1, plan=plan))

    def append_nowait(
        self, event: RunEvent, *, on_durable: Callable[[], None] | None = None
    ) -> None:
        """Queue ``event`` for the writer and return; see :meth:`RunStore.append_nowait`.

        StoreError if the store is closed; a refusal (decided by the writer) is
        logged. Must be called from the Trio thread. Without ``on_durable`` the write may
        gather with others for up to :data:`LINGER` seconds.
        """

        def work(conn: sqlite3.Connection) -> None:
            self._append(conn, event)

        job = _Job("append", work, withdrawable=False, events=1, plan=("append", event))
        job.task = None  # nobody waits for it
        job.done = on_durable
        job.waited = on_durable is not None  # somebody will want it: commit it at once
        self._start()
        with self._lock:
            if self._closing:
                raise StoreError(f"the store {self.path!r} is closed")
            self._pending.append(job)
            if job.waited or not self._lingering:
                # a lingering writer wakes at its deadline anyway: waking it for each
                # delta cost a thread switch a token
                self._wakeup.notify()

    async def append_many(self, events: Sequence[RunEvent]) -> None:
        """Append several events in one write; see :meth:`RunStore.append_many`."""
        taken = tuple(events)

        def work(conn: sqlite3.Connection) -> list[str]:
            refused = []
            for event in taken:
                try:
                    self._append(conn, event)  # a refused event writes nothing
                except StoreError as exc:
                    refused.append(str(exc))
            return refused

        job = _Job("append_many", work, withdrawable=False, events=len(taken), plan=("many", taken))
        refused = await self._write(job)
        if refused:
            raise refused_error(refused)

    async def get(self, run_id: str) -> RunRecord | None:
        def read(conn: sqlite3.Connection) -> RunRecord | None:
            rows = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)
            ).fetchall()
            return _record(rows[0]) if rows else None

        return await self._read(read)

    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[RunRecord]:
        """See :meth:`RunStore.list_runs`."""
        where: list[str] = []
        args: list[object] = []
        wanted = sorted(s.value for s in query.statuses)
        if wanted:
            where.append(f"status IN ({_marks(len(wanted))})")
            args.extend(wanted)
        if query.target:
            where.append("target = ?")
            args.append(query.target)
        if query.tenant is not None:
            where.append("tenant = ?")
            args.append(query.tenant)
        if query.run_id_prefix:
            where.append("substr(run_id, 1, ?) = ?")
            args.extend([len(query.run_id_prefix), query.run_id_prefix])
        sql = f"SELECT {_RUN_COLUMNS} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(max(query.limit, 0))

        def read(conn: sqlite3.Connection) -> list[RunRecord]:
            return [_record(row) for row in conn.execute(sql, args).fetchall()]

        return await self._read(read)

    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        def read(conn: sqlite3.Connection) -> list[RunEvent]:
            rows = conn.execute(
                f"SELECT {_EVENT_COLUMNS} FROM events WHERE run_id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (run_id, after_seq, -1 if limit is None else max(limit, 0)),
            ).fetchall()
            return [_event(row) for row in rows]

        return await self._read(read)

    async def interrupt_unfinished(
        self, *, time: float, message: str, chars_per_token: float = CHARS_PER_TOKEN
    ) -> list[RunEvent]:
        """Mark every QUEUED or RUNNING run INTERRUPTED (oldest first), in one transaction;
        see :meth:`RunStore.interrupt_unfinished` for the usage of those found RUNNING."""

        def work(conn: sqlite3.Connection) -> list[RunEvent]:
            live = f"status IN ({_marks(len(_LIVE))})"
            rows = conn.execute(
                f"SELECT {_FOLD_COLUMNS} FROM runs WHERE {live} ORDER BY id", _LIVE
            ).fetchall()
            # what those found RUNNING asked and were sent, for their usage: the deltas'
            # tokens (a delta stored before they were kept counts one)
            asked = {
                run_id: RunSpec("", prompt, tuple((r, c) for r, c in json.loads(messages)))
                for run_id, prompt, messages in conn.execute(
                    "SELECT run_id, prompt, messages FROM runs WHERE status = 'running'"
                )
            }
            sent = dict(
                conn.execute(
                    "SELECT e.run_id, SUM(COALESCE(e.tokens, 1)) FROM runs r JOIN events e "
                    "ON e.run_id = r.run_id WHERE r.status = 'running' AND e.kind = 'delta' "
                    "GROUP BY e.run_id"
                ).fetchall()
            )
            made = []
            for row in rows:
                record = _fold_record(row)
                usage = None
                if record.run_id in asked:
                    usage = unfinished_usage(
                        asked[record.run_id], sent.get(record.run_id, 0), chars_per_token
                    )
                event = RunState(record).interrupt(time=time, message=message, usage=usage)
                _write_event(conn, record, event)
                self._folds.pop(record.run_id, None)
                made.append(event)
            job.events = len(made)
            return made

        job = _Job("interrupt_unfinished", work, withdrawable=True)
        return await self._write(job)

    async def usage_totals(
        self, *, by: UsageGroup, since: float | None = None, until: float | None = None
    ) -> list[UsageTotal]:
        """One GROUP BY over the runs' token columns; see :meth:`RunStore.usage_totals`.
        A window reads only the runs that ended in it (the index on ``finished``)."""
        sql, args = usage_totals_sql(by, since, until)

        def read(conn: sqlite3.Connection) -> list[UsageTotal]:
            return [UsageTotal(*row) for row in conn.execute(sql, args).fetchall()]

        return await self._read(read)

    async def prune(self, *, finished_before: float) -> int:
        """Delete terminal runs with ``finished < finished_before`` and their events."""

        def work(conn: sqlite3.Connection) -> int:
            condition = f"status IN ({_marks(len(_TERMINAL))}) AND finished < ?"
            args = (*_TERMINAL, finished_before)
            conn.execute(
                f"DELETE FROM events WHERE run_id IN (SELECT run_id FROM runs WHERE {condition})",
                args,
            )
            return conn.execute(f"DELETE FROM runs WHERE {condition}", args).rowcount

        return await self._write(_Job("prune", work, withdrawable=True))

    async def sync(self) -> None:
        """Return once every write taken before the call is committed."""
        await self._write(_Job("sync", lambda conn: None, withdrawable=True, plan=("sync",)))

    async def aclose(self) -> None:
        """Commit every write already taken, stop the writer and close the file.

        Safe to call more than once (and concurrently): each call returns once
        the store is closed. If cancelled, the closing goes on in the
        background. Writes and reads after the first call raise StoreError.
        Writes the store cannot make get ``close_timeout`` seconds more.
        """
        with self._lock:
            if not self._closing:
                self._close_deadline = time.monotonic() + self.close_timeout
            self._closing = True
            self._wakeup.notify_all()
            thread = self._thread
        if thread is None:
            self._close_readers()
            await trio.lowlevel.checkpoint()
            return

        def finish() -> None:
            thread.join()
            self._close_readers()

        await trio.to_thread.run_sync(finish, abandon_on_cancel=True)

    # --- the Trio side of the writer -----------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(
                    target=self._writer_main, name=f"SqliteStore writer {self.path}", daemon=True
                )
                self._thread.start()

    async def _write(self, job: _Job[T]) -> T:
        """Queue ``job`` now (no checkpoint before), then wait for its batch to commit.

        A withdrawable job cancelled while the writer is not committing it (still queued,
        or between two attempts at a batch that failed) is withdrawn: nothing of it is
        written, and Cancelled is raised at once. Cancelled during an attempt, it ends
        with that attempt (short): committed, it returns (the cancellation is delivered
        at the caller's next checkpoint); else it is withdrawn then, and raises the
        attempt's StoreUnavailable. Any other job is written all the same."""
        self._start()
        with self._lock:
            if self._closing:
                raise StoreError(f"the store {self.path!r} is closed")
            self._pending.append(job)
            self._wakeup.notify()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            if job.withdrawable:
                with self._lock:
                    if not job.taken:
                        self._pending.remove(job)
                    elif job.settled or self._attempting:
                        job.given_up = True
                        return trio.lowlevel.Abort.FAILED  # the writer will wake us
                    job.withdrawn = True
            job.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if job.error is not None:
            raise job.error
        return cast(T, job.result)  # set by the writer when there is no error

    @staticmethod
    def _wake(jobs: list[_Job[Any]]) -> None:
        # runs in the Trio thread (run_sync_soon)
        for job in jobs:
            if job.done is not None:
                try:
                    job.done()
                except Exception:
                    log.exception("the callback of %s failed", job.label)
            task, job.task = job.task, None
            if task is not None:
                trio.lowlevel.reschedule(task)
            elif job.error is not None:
                log.error("%s that nobody waited for failed: %s", job.label, job.error)

    # --- the writer thread ---------------------------------------------------------------

    def _writer_main(self) -> None:
        try:
            self._conn = self._open_writer()
        except Exception as exc:
            self._open_error = _store_error(exc, f"cannot open run store {self.path!r}")
        finally:
            self._opened.set()
        try:
            while True:
                if self._tend_file() and "write" in self._problems and not self._pending:
                    self._probe()  # writes fail, and none is left to find when they do not
                with self._lock:
                    while not self._pending and not self._closing and not self._tending_due():
                        self._wakeup.wait(self._time_to_check())
                    if not self._pending:
                        if self._closing:
                            return  # closing, and everything taken is done
                        continue  # the file is due a check
                    self._linger()
                    batch: list[_Job[Any]] = []
                    while self._pending and len(batch) < self.max_batch:
                        job = self._pending.popleft()
                        job.taken = True
                        batch.append(job)
                    self._attempting = True  # the first attempt at it begins now
                if batch:
                    hook = self._before_batch
                    if hook is not None:
                        try:
                            hook([job.label for job in batch])
                        except Exception:
                            log.exception("run store: the before-batch hook failed")
                    self._run_batch(batch)
        finally:
            if self._conn is not None:
                if self._gone() is not None:
                    self._rescue(closing=True)
                self._conn.close()

    def _linger(self) -> None:
        """With the lock held and something pending: while nobody waits for any pending
        write, wait up to :data:`LINGER` seconds for more (a write somebody waits for, a
        full batch or closing ends the wait at once)."""
        if self.linger <= 0:
            return
        deadline = time.monotonic() + self.linger
        self._lingering = True
        try:
            while (
                not self._closing
                and len(self._pending) < self.max_batch
                and not any(job.waited for job in self._pending)
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wakeup.wait(left)
        finally:
            self._lingering = False

    def _open_writer(self) -> sqlite3.Connection:
        """Open the writer's connection: the first time making the file if need be and
        noting which it is; again (after a failure) only if it is still that file."""
        if self._identity is None:
            _create_private(self.path)
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=True
            )
        else:
            gone = self._gone() or self._identity_problem(wal=False)
            if gone is not None:
                self._set_problem("gone", gone)
                raise StoreUnavailable(gone)  # passing: the writes wait (for the close)
            conn = sqlite3.connect(
                _uri(self.path, "rw"),
                uri=True,
                timeout=self.busy_timeout,
                isolation_level=None,
                check_same_thread=True,
            )
        try:
            _check_or_create_schema(conn)
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"cannot use WAL journal mode on {self.path!r} (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT}")
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
            if self._identity is None:
                self._identity = _identity(self.path)
            self._wal_identity = _identity(self.path + "-wal")  # SQLite makes it lazily
        except BaseException:
            conn.close()
            raise
        return conn

    def _run_batch(self, batch: list[_Job[Any]]) -> None:
        """Commit ``batch`` (retrying a passing failure, see Faults), then wake its callers.

        Between two attempts its withdrawable jobs may be withdrawn (see :meth:`_write`):
        the next attempt leaves them out, and a batch left with none is done. Its callers
        given up during an attempt that failed are woken with StoreUnavailable."""
        attempt = 0
        room = sum(job.size for job in batch)  # what a probe asks for if all is withdrawn
        while True:
            with self._lock:
                batch = [job for job in batch if not job.withdrawn]
                self._attempting = bool(batch)
            if batch and self._gone() is not None:
                batch = self._refuse_creates(batch)
            if not batch:
                self._probe_size = room
                break
            for job in batch:
                job.error = None  # an earlier attempt's refusal is made again, or not
            try:
                if self._open_error is not None:
                    raise self._open_error
                if self._conn is None:
                    self._conn = self._open_writer()
                    if attempt:
                        # a full disk stops the checkpoint a closing connection makes, and
                        # a WAL not checkpointed is appended to, not reused, so each attempt
                        # would fill the room the disk got back: checkpoint first, and free
                        # the WAL's space (a checkpoint that still fails is retried too)
                        self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                for statement in self._test_pragmas:
                    self._conn.execute(statement)
                committed, events = self._transaction(self._conn, batch)
            except Exception as exc:
                passing = _passing(exc)
                if passing is not None:
                    self._writes_fail(passing)
                    batch = self._give_up(batch, passing)
                    if not batch:
                        continue  # to the end above: nothing is left to write
                    if self._wait_to_retry(passing, attempt):
                        attempt += 1
                        continue
                    error: StoreError = StoreUnavailable(
                        f"the run store could not write before it closed: {passing}"
                    )
                else:
                    error = _store_error(exc, "the run store could not commit")
                for job in batch:
                    job.result = None
                    job.error = type(error)(str(error))
                    job.error.__cause__ = error.__cause__ or exc
            else:
                self._commits += committed
                self._events += events
                self._writes_go_through()
                if self._wal_identity is None:  # its first write made it
                    self._wal_identity = _identity(self.path + "-wal")
            break
        self._settle(batch, last=True)

    def _give_up(self, batch: list[_Job[Any]], problem: str) -> list[_Job[Any]]:
        """After a failed attempt: end the jobs whose callers gave up during it (with
        StoreUnavailable: nothing of them was written); return the others. From now until
        the next attempt the batch's withdrawable jobs may be withdrawn."""
        with self._lock:
            self._attempting = False
            given_up = [job for job in batch if job.given_up]
        if not given_up:
            return batch
        for job in given_up:
            job.result = None
            job.error = StoreUnavailable(f"the run store cannot write: {problem}")
        self._settle(given_up)
        return [job for job in batch if not job.given_up]

    def _settle(self, jobs: list[_Job[Any]], *, last: bool = False) -> None:
        """The writer is done with ``jobs`` (their result or error is set): wake them.
        ``last``: they are what is left of the batch, which is done too."""
        with self._lock:  # at once: a job is never seen neither settled nor attempted
            if last:
                self._attempting = False
            for job in jobs:
                job.settled = True
        self._jobs += len(jobs)
        self._wake_soon(jobs)

    def _wake_soon(self, batch: list[_Job[Any]]) -> None:
        """Have each job's Trio run wake its callers (one call per run), or log the error
        of a job nobody waits for."""
        by_token: dict[trio.lowlevel.TrioToken, list[_Job[Any]]] = {}
        for job in batch:
            by_token.setdefault(job.token, []).append(job)
        for token, jobs in by_token.items():
            if not any(
                job.task is not None or job.error is not None or job.done is not None
                for job in jobs
            ):
                continue  # nobody to wake, nothing to log: spare the Trio thread a wake-up
            with contextlib.suppress(trio.RunFinishedError):  # nobody left to tell
                token.run_sync_soon(self._wake, jobs)

    def _refuse_creates(self, batch: list[_Job[Any]]) -> list[_Job[Any]]:
        """With the file gone: refuse the batch's creates (StoreUnavailable), which its
        rescue copy could miss, and return the other jobs. Those runs were never
        acknowledged; the runs the node has go on being written."""
        refused = [job for job in batch if job.label == "create"]
        if not refused:
            return batch
        for job in refused:
            job.error = StoreUnavailable(f"the run store cannot write: {self._gone()}")
        self._settle(refused)
        return [job for job in batch if job.label != "create"]

    # --- the file under the store (in the writer thread, but for _identity_problem) -------

    def _tending_due(self) -> bool:
        """Whether the file is due a check, or is gone and the writer has not said so."""
        if self._identity is None:  # never opened: nothing to check
            return False
        return time.monotonic() >= self._next_check or (
            not self._gone_told and self._gone() is not None
        )

    def _time_to_check(self) -> float | None:
        """Seconds until the file is due a check (None: never)."""
        if self._identity is None:
            return None
        return max(0.0, self._next_check - time.monotonic())

    def _tend_file(self, *, now: bool = False) -> bool:
        """When due (or ``now``): see that the file (and the WAL) is the one opened, and
        that the file and its folder may be written; tell the health what is wrong. A file
        gone is rescued (see :meth:`_rescue`) and never checked again. Returns whether it
        looked."""
        if self._identity is None or not (now or self._tending_due()):
            return False
        self._next_check = time.monotonic() + self.check_interval
        if self._gone() is None:
            if self._wal_identity is None:
                self._wal_identity = _identity(self.path + "-wal")
            gone = self._identity_problem(wal=True)
            if gone is None:
                problem = _access_problem(self.path)
                if self._set_problem("access", problem):
                    if problem is None:
                        log.warning("run store %s may be written again", self.path)
                    else:
                        log.warning(
                            "run store %s cannot be written: %s; new runs are refused until it can",
                            self.path,
                            problem,
                        )
                return True
            self._set_problem("gone", gone)
        if not self._rescued:
            self._rescue()
        return True

    def _probe(self) -> None:
        """While writes fail and none is left to try (their callers gave up on them):
        write a row of the size they needed and delete it, two commits, to learn whether
        the store writes again; its health says so either way. The row is an event of a
        run that cannot exist (:data:`_PROBE_RUN`), which nothing reads."""
        size = min(PROBE_MAX, max(PROBE_MIN, self._probe_size))
        try:
            if self._open_error is not None:
                return
            if self._conn is None:
                self._conn = self._open_writer()
            conn = self._conn
            for statement in self._test_pragmas:
                conn.execute(statement)
            with self._undone_on_error(conn):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("DELETE FROM events WHERE run_id = ?", (_PROBE_RUN,))
                conn.execute(
                    f"INSERT INTO events ({_EVENT_COLUMNS}) "
                    "VALUES (?, 0, 'probe', 0, zeroblob(?), '', '', NULL, NULL, NULL)",
                    (_PROBE_RUN, size),
                )
                conn.execute("COMMIT")
            conn.execute("DELETE FROM events WHERE run_id = ?", (_PROBE_RUN,))
        except Exception as exc:
            passing = _passing(exc)
            if passing is None:
                log.warning("run store %s: a probe of its writes failed: %s", self.path, exc)
                return
            self._writes_fail(passing)
            if self._conn is not None and self._gone() is None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None  # a fresh one next time, as for a batch
                self._wal_identity = None
            return
        self._writes_go_through()

    def _identity_problem(self, *, wal: bool) -> str | None:
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
                now = _identity(name, missing_ok=False)
            except FileNotFoundError:
                return f"its {what} {name} was deleted while the node had it open"
            except OSError:
                return None
            if now != opened:
                return f"its {what} {name} was replaced by another file while the node had it open"
        return None

    def _rescue(self, *, closing: bool = False) -> None:
        """With the file gone: copy what the writer's connection still holds (every run
        the node took) to the rescue file, ``<db>.rescued-<time>``, 0600; the first time,
        say in one ERROR line what happened and what to do. ``closing``: make the copy
        anew (beside it, then put in its place), with everything written since."""
        gone = self._gone()
        assert gone is not None
        target, conn, why = self._rescue_path, self._conn, ""
        if conn is None or conn.in_transaction:
            why = "the node does not hold it open: it let go of it after a write failed"
        else:
            try:
                made = _new_private_file(
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
                why = f"{type(exc).__name__}: {exc}"
            else:
                if target is None:
                    self._rescue_path = made
                    self._set_problem("gone", f"{gone}; its runs are copied to {made}")
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

    def _wait_to_retry(self, problem: str, attempt: int) -> bool:
        """After a passing failure: say so, drop the connection, wait the backoff.
        False once the store is closing and its ``close_timeout`` is over. A store whose
        file is gone keeps its connection: it is the only way left to its runs."""
        self._writes_fail(problem)
        self._tend_file(now=True)
        if self._conn is not None and self._gone() is None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None  # a fresh one for the next attempt
            self._wal_identity = None  # closing the last connection may delete the WAL
        delay = min(RETRY_MAX, RETRY_INITIAL * 2 ** min(attempt, 16))
        deadline = self._close_deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            delay = min(delay, left)
        time.sleep(delay)
        return True

    def _transaction(self, conn: sqlite3.Connection, batch: list[_Job[Any]]) -> tuple[bool, int]:
        """Run the batch in one transaction; return whether it committed, and the events written.

        A batch of creates, appends and syncs only is made in bulk; should that
        fail for a reason that does not pass, it is made again job by job, to
        refuse the job that caused it alone.
        """
        if all(job.plan is not None for job in batch):
            try:
                return self._bulk_transaction(conn, batch)
            except Exception as exc:
                if _passing(exc) is not None:
                    raise
                log.warning("run store: a batch failed in bulk (%s); making it job by job", exc)
                for job in batch:
                    job.error = None
        return self._per_job_transaction(conn, batch)

    def _bulk_transaction(
        self, conn: sqlite3.Connection, batch: list[_Job[Any]]
    ) -> tuple[bool, int]:
        conn.execute("BEGIN IMMEDIATE")
        with self._undone_on_error(conn):
            events = self._bulk(conn, batch)
            conn.execute("COMMIT")
        return True, events

    @contextlib.contextmanager
    def _undone_on_error(self, conn: sqlite3.Connection) -> Iterator[None]:
        """Roll the transaction back (and forget the folds, now in doubt) if the body raises."""
        try:
            yield
        except BaseException:
            self._folds.clear()
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _bulk(self, conn: sqlite3.Connection, jobs: list[_Job[Any]]) -> int:
        """Make create, append and sync jobs with a few statements; return the events written.

        The writer holds the GIL only between statements, so while the Trio thread
        is busy each statement costs a switch interval: a batch of any size takes a
        handful of them here, against four a job one by one. A job whose run exists
        (create) or is unknown (append), or whose event the lifecycle refuses, gets
        its StoreError and nothing of it is written; the others go on.
        """
        creates = [job.plan[1] for job in jobs if job.plan is not None and job.plan[0] == "create"]
        taken = _select_ids(conn, "SELECT run_id FROM runs WHERE run_id IN ({})", creates)
        unknown = {
            job.plan[1].run_id for job in jobs if job.plan is not None and job.plan[0] == "append"
        } - self._folds.keys()
        for row in _select_rows(
            conn, f"SELECT {_FOLD_COLUMNS} FROM runs WHERE run_id IN ({{}})", sorted(unknown)
        ):
            self._folds[row[0]] = _fold_record(row)
        run_rows: list[tuple[object, ...]] = []
        event_rows: list[tuple[object, ...]] = []
        folded: dict[str, RunRecord] = {}
        for job in jobs:
            assert job.plan is not None
            if job.plan[0] == "create":
                _, run_id, row, rows, kept = job.plan
                if run_id in taken:
                    job.error = StoreError(f"run {run_id} exists")
                    continue
                taken.add(run_id)
                run_rows.append(row)
                event_rows.extend(rows)
                if kept is not None:
                    self._folds[run_id] = attrs.evolve(kept)
            elif job.plan[0] in ("append", "many"):
                refused = []
                for event in _planned_events(job):
                    record = self._folds.get(event.run_id)
                    try:
                        if record is None:
                            raise StoreError(f"event for unknown run {event.run_id}")
                        fold(record, event)
                    except (StoreError, ValueError, RuntimeError) as exc:  # IllegalTransition
                        refused.append(str(exc))
                        continue
                    event_rows.append(_event_row(event))
                    folded[event.run_id] = record
                    if record.status.terminal:
                        del self._folds[event.run_id]
                if job.plan[0] == "many":
                    job.result = refused
                elif refused:
                    job.error = StoreError(refused[0])
        _insert_rows(conn, "runs", _RUN_COLUMNS, run_rows)
        _insert_rows(conn, "events", _EVENT_COLUMNS, event_rows)
        _update_folds(conn, list(folded.values()))
        return len(event_rows)

    def _per_job_transaction(
        self, conn: sqlite3.Connection, batch: list[_Job[Any]]
    ) -> tuple[bool, int]:
        """Run each job of the batch in its own savepoint, so a job that fails is undone
        alone (a batch of one is undone by rolling back); then commit."""
        conn.execute("BEGIN IMMEDIATE")
        events = 0
        alone = len(batch) == 1
        with self._undone_on_error(conn):
            for job in batch:
                if not alone:
                    conn.execute("SAVEPOINT job")
                try:
                    job.result = job.work(conn)
                except Exception as exc:  # this job only; the batch goes on
                    if _passing(exc) is not None:
                        raise  # the whole batch is retried
                    self._folds.clear()  # the job may have changed one before it failed
                    if not isinstance(exc, StoreError | sqlite3.Error):
                        log.exception("run store: %s failed unexpectedly", job.label)
                    job.error = _store_error(exc, f"{job.label} failed")
                    if alone:
                        conn.execute("ROLLBACK")
                        return False, 0
                    conn.execute("ROLLBACK TO job")
                else:
                    events += job.events
                if not alone:
                    conn.execute("RELEASE job")
            conn.execute("COMMIT")
        return True, events

    def _append(self, conn: sqlite3.Connection, event: RunEvent) -> None:
        record = self._folds.get(event.run_id)
        if record is None:
            rows = conn.execute(
                f"SELECT {_FOLD_COLUMNS} FROM runs WHERE run_id = ?", (event.run_id,)
            ).fetchall()
            if not rows:
                raise StoreError(f"event for unknown run {event.run_id}")
            record = _fold_record(rows[0])
        try:
            fold(record, event)
        except (ValueError, RuntimeError) as exc:  # IllegalTransition is a RuntimeError
            raise StoreError(str(exc)) from exc
        _write_event(conn, record, event)
        if record.status.terminal:
            self._folds.pop(event.run_id, None)
        else:
            self._folds[event.run_id] = record

    # --- reads ---------------------------------------------------------------------------

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._start()
        with self._lock:
            closing = self._closing or self._thread is None
        if closing:
            await trio.lowlevel.checkpoint()
            raise StoreError(f"the store {self.path!r} is closed")
        return await trio.to_thread.run_sync(self._read_sync, fn, limiter=self._read_limiter)

    def _read_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._opened.wait()
        if self._open_error is not None:
            raise StoreError(str(self._open_error)) from self._open_error
        gone = self._gone()
        if gone is None:
            gone = self._identity_problem(wal=False)  # a stat: each read looks too
            if gone is not None:
                self._set_problem("gone", gone)
                with self._lock:
                    self._wakeup.notify()  # the writer rescues the runs and says what to do
        if gone is not None:
            raise StoreUnavailable(f"the run store cannot be read: {gone}")
        with self._readers_lock:
            if self._readers_closed:
                raise StoreError(f"the store {self.path!r} is closed")
            conn = self._idle_readers.pop() if self._idle_readers else None
        try:
            if conn is None:
                # read-only: a reader never makes a file, so one where the store was
                # deleted is not taken for an empty store
                conn = sqlite3.connect(
                    _uri(self.path, "ro"),
                    uri=True,
                    timeout=self.busy_timeout,
                    isolation_level=None,
                    check_same_thread=False,
                )
                conn.execute("PRAGMA query_only = ON")
            # every statement is fetched to its end, so no read transaction stays open
            return fn(conn)
        except Exception as exc:  # sqlite3.Error, or a row this code cannot read
            raise _store_error(exc, f"reading the run store {self.path!r} failed") from exc
        finally:
            if conn is not None:
                with self._readers_lock:
                    if self._readers_closed:
                        conn.close()
                    else:
                        self._idle_readers.append(conn)

    def _close_readers(self) -> None:
        with self._readers_lock:
            self._readers_closed = True
            idle, self._idle_readers = self._idle_readers, []
        for conn in idle:
            conn.close()


# --- schema and rows -------------------------------------------------------------------------


def _uri(path: str, mode: Literal["ro", "rw"]) -> str:
    """A ``file:`` URI that opens ``path`` in ``mode`` and never creates it."""
    return f"{Path(os.path.abspath(path)).as_uri()}?mode={mode}"


def _identity(path: str, *, missing_ok: bool = True) -> tuple[int, int] | None:
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


def _access_problem(path: str) -> str | None:
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


def _new_private_file(prefix: str) -> str:
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


def _create_private(path: str) -> None:
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


def _check_or_create_schema(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the run store has schema version {version}, newer than this version of "
            f"iop-trio understands ({SCHEMA_VERSION}); upgrade iop-trio or use another file"
        )
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]  # another process?
        if version == 0:
            tables = conn.execute(
                "SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
            ).fetchall()
            if tables:
                raise StoreError(
                    "the file is a SQLite database but not an iop-trio run store "
                    f"(it has {', '.join(sorted(t[0] for t in tables))} and no schema version)"
                )
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version in (1, 2):
            for statement in _MIGRATE_1_TO_2 if version == 1 else ():
                conn.execute(statement)
            for statement in _MIGRATE_2_TO_3:
                conn.execute(statement)
            _fill_token_columns(conn)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:  # pragma: no cover - no other versions exist
            raise StoreError(f"the run store has schema version {version}; cannot migrate it")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def usage_totals_sql(
    by: UsageGroup, since: float | None, until: float | None
) -> tuple[str, list[object]]:
    """The statement (and its arguments) of :meth:`SqliteStore.usage_totals`."""
    column = {"tenant": "tenant", "target": "target"}[by]  # never the caller's text
    where = ["usage IS NOT NULL", "finished IS NOT NULL"]
    args: list[object] = []
    if since is not None:
        where.append("finished >= ?")
        args.append(since)
    if until is not None:
        where.append("finished < ?")
        args.append(until)
    sums = ", ".join(
        f"COALESCE(SUM({count}), 0)"
        for count in (
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens * prompt_estimated",
            "completion_tokens * completion_estimated",
        )
    )
    # a window reads the runs that ended in it, by the index on finished: left to choose,
    # SQLite takes the index on tenant (or target) to group without sorting, and reads
    # every run (a second for 500,000, against milliseconds for a day of them)
    source = "runs" if since is None and until is None else "runs INDEXED BY runs_finished"
    sql = (
        f"SELECT {column}, COUNT(*), {sums} FROM {source} WHERE {' AND '.join(where)} "
        f"GROUP BY {column} ORDER BY {column}"
    )
    return sql, args


def _fill_token_columns(conn: sqlite3.Connection) -> None:
    """Set the token columns of every run with a usage from its JSON (migrating to v3)."""
    rows = conn.execute("SELECT run_id, usage FROM runs WHERE usage IS NOT NULL").fetchall()
    assignments = ", ".join(f"{field} = ?" for field in _USAGE_FIELDS)
    conn.executemany(
        f"UPDATE runs SET {assignments} WHERE run_id = ?",
        [(*_usage_columns(_usage(usage)), run_id) for run_id, usage in rows],
    )


def _passing(exc: BaseException) -> str | None:
    """What went wrong, if ``exc`` (or its cause) is a passing SQLite failure (or the
    store's own StoreUnavailable); else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, StoreUnavailable):
            return str(seen)
        code = getattr(seen, "sqlite_errorcode", None)
        if isinstance(seen, sqlite3.Error) and code is not None and code & 0xFF in _PASSING:
            return str(seen) or type(seen).__name__
        seen = seen.__cause__
    return None


#: Values in one statement: SQLite's default bound since 3.32 (this module asks no more).
_MAX_VALUES = 32766


def _chunks(items: list[T], width: int) -> list[list[T]]:
    """``items`` in runs short enough that ``width`` values each fit in one statement."""
    size = max(1, _MAX_VALUES // width)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _select_rows(conn: sqlite3.Connection, sql: str, ids: list[str]) -> list[tuple[Any, ...]]:
    """``sql`` (with ``{}`` for the list of ids) over ``ids``, a statement per chunk."""
    rows: list[tuple[Any, ...]] = []
    for chunk in _chunks(ids, 1):
        rows += conn.execute(sql.format(_marks(len(chunk))), chunk).fetchall()
    return rows


def _select_ids(conn: sqlite3.Connection, sql: str, ids: list[str]) -> set[str]:
    return {row[0] for row in _select_rows(conn, sql, ids)}


def _insert_rows(
    conn: sqlite3.Connection, table: str, columns: str, rows: list[tuple[object, ...]]
) -> None:
    if not rows:
        return
    for chunk in _chunks(rows, len(rows[0])):
        values = ", ".join([f"({_marks(len(chunk[0]))})"] * len(chunk))
        conn.execute(
            f"INSERT INTO {table} ({columns}) VALUES {values}", [v for row in chunk for v in row]
        )


def _update_folds(conn: sqlite3.Connection, records: list[RunRecord]) -> None:
    """Set the fold columns of each run to its record's, a statement per chunk."""
    width = 1 + len(_FOLD_FIELDS)
    assignments = ", ".join(f"{field} = u.{field}" for field in _FOLD_FIELDS)
    for chunk in _chunks(records, width):
        values = ", ".join([f"({_marks(width)})"] * len(chunk))
        conn.execute(
            f"WITH u({_FOLD_COLUMNS}) AS (VALUES {values}) "
            f"UPDATE runs SET {assignments} FROM u WHERE runs.run_id = u.run_id",
            [value for r in chunk for value in (r.run_id, *_fold_values(r))],
        )


def _planned_events(job: _Job[Any]) -> tuple[RunEvent, ...]:
    """The events a planned append or append_many job writes (none for another job)."""
    plan = job.plan
    if plan is None:
        return ()
    if plan[0] == "append":
        return (plan[1],)
    if plan[0] == "many":
        return tuple(plan[1])
    return ()


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _store_error(exc: BaseException, context: str) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    error = StoreError(f"{context}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _usage_json(usage: Usage | None) -> str | None:
    if usage is None:
        return None
    return json.dumps(
        {
            "done_reason": usage.done_reason,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "prompt_estimated": usage.prompt_estimated,
            "completion_estimated": usage.completion_estimated,
        }
    )


def _usage(text: str | None) -> Usage | None:
    if text is None:
        return None
    data = json.loads(text)
    return Usage(
        data["done_reason"],
        data["prompt_tokens"],
        data["completion_tokens"],
        # absent: stored before the node settled usage, a count the engine's or none
        prompt_estimated=data.get("prompt_estimated", False),
        completion_estimated=data.get("completion_estimated", False),
    )


def _usage_columns(usage: Usage | None) -> tuple[object, ...]:
    """The values of :data:`_USAGE_FIELDS` for a run whose record holds ``usage``."""
    if usage is None:
        return (None, None, 0, 0)
    return (
        usage.prompt_tokens,
        usage.completion_tokens,
        int(usage.prompt_estimated),
        int(usage.completion_estimated),
    )


def _run_row(record: RunRecord) -> tuple[object, ...]:
    return (
        record.run_id,
        record.target,
        record.status.value,
        int(record.background),
        record.created,
        record.prompt,
        json.dumps([[role, content] for role, content in record.messages]),
        json.dumps(dict(record.options)),
        record.started,
        record.finished,
        record.reason,
        record.message,
        record.last_seq,
        _usage_json(record.usage),
        record.tenant,
        record.priority,
        record.retry_after,
        *_usage_columns(record.usage),
    )


def _record(row: tuple[Any, ...]) -> RunRecord:
    options: Mapping[str, Any] = json.loads(row[7])
    return RunRecord(
        run_id=row[0],
        target=row[1],
        status=RunStatus(row[2]),
        background=bool(row[3]),
        created=row[4],
        prompt=row[5],
        messages=tuple((role, content) for role, content in json.loads(row[6])),
        options=options,
        started=row[8],
        finished=row[9],
        reason=row[10],
        message=row[11],
        last_seq=row[12],
        usage=_usage(row[13]),
        tenant=row[14],
        priority=row[15],
        retry_after=row[16],
    )


def _event_row(event: RunEvent) -> tuple[object, ...]:
    return (
        event.run_id,
        event.seq,
        event.kind.value,
        event.time,
        event.text,
        event.reason,
        event.message,
        _usage_json(event.usage),
        event.retry_after,
        event.tokens,
    )


def _event(row: tuple[Any, ...]) -> RunEvent:
    kind = EventKind(row[2])
    tokens = row[9]
    if tokens is None:  # stored before v3: a delta holds one engine chunk at least
        tokens = 1 if kind is EventKind.DELTA else 0
    return RunEvent(
        run_id=row[0],
        seq=row[1],
        kind=kind,
        time=row[3],
        text=row[4],
        reason=row[5],
        message=row[6],
        usage=_usage(row[7]),
        retry_after=row[8],
        tokens=tokens,
    )


def _fold_record(row: tuple[Any, ...]) -> RunRecord:
    """A partial record (no target, prompt, options) for :func:`iop_trio.lifecycle.fold`."""
    return RunRecord(
        run_id=row[0],
        target="",
        status=RunStatus(row[1]),
        background=False,
        created=0.0,
        last_seq=row[2],
        started=row[3],
        finished=row[4],
        reason=row[5],
        message=row[6],
        usage=_usage(row[7]),
        retry_after=row[8],
    )


def _fold_values(record: RunRecord) -> tuple[object, ...]:
    """The values of :data:`_FOLD_FIELDS` for ``record``."""
    return (
        record.status.value,
        record.last_seq,
        record.started,
        record.finished,
        record.reason,
        record.message,
        _usage_json(record.usage),
        record.retry_after,
        *_usage_columns(record.usage),
    )


def _write_event(conn: sqlite3.Connection, record: RunRecord, event: RunEvent) -> None:
    """Insert ``event`` and update the run's row to ``record``, which ``event`` was folded into."""
    row = _event_row(event)
    conn.execute(f"INSERT INTO events ({_EVENT_COLUMNS}) VALUES ({_marks(len(row))})", row)
    if event.status is None:  # a delta moves only the seq
        conn.execute("UPDATE runs SET last_seq = ? WHERE run_id = ?", (event.seq, record.run_id))
        return
    assignments = ", ".join(f"{field} = ?" for field in _FOLD_FIELDS)
    conn.execute(
        f"UPDATE runs SET {assignments} WHERE run_id = ?",
        (*_fold_values(record), record.run_id),
    )
