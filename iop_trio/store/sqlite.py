"""A durable run store on SQLite (standard library :mod:`sqlite3`), with group commit.

The store is made of five modules: this one (the :class:`RunStore` interface and the
reads), :mod:`~iop_trio.store.group_commit` (the writer thread, for any storage),
:mod:`~iop_trio.store.sqlite_writer` (the plans and how they are written),
:mod:`~iop_trio.store.sqlite_file` (the checks of the file) and
:mod:`~iop_trio.store.sqlite_schema` (the tables and rows).

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
SQLITE_BUSY, ...: see :data:`~iop_trio.store.sqlite_writer.PASSING_CODES`) is
rolled back and retried, with backoff, on a fresh connection that first
checkpoints the WAL (a full disk may have stopped the last one, and a WAL not
checkpointed only grows), until it commits: nothing taken is lost or reordered. Meanwhile
:meth:`SqliteStore.health` says the store cannot write (and why), the change
is logged once each way and told to the
:meth:`~SqliteStore.watch_health` listeners, and ``create`` refuses new runs
at once with :class:`StoreUnavailable`. Once :meth:`aclose` is called, such
writes get ``close_timeout`` more seconds; the ones still not made then
fail with StoreUnavailable (their runs are INTERRUPTED at the next start).
The writer checkpoints the WAL between batches, never inside a commit a caller waits
for: when it is idle and the WAL holds :data:`IDLE_CHECKPOINT` bytes, or however busy
once it holds :data:`BUSY_CHECKPOINT`; SQLite's own checkpoint at
:data:`WAL_AUTOCHECKPOINT` pages stays as the bound, and the WAL is truncated when it
is reset (:data:`JOURNAL_SIZE_LIMIT`), so a small disk holds.

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
:mod:`iop_trio.store.group_commit`). Reads are not interrupted once their thread runs.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast

import attrs
import trio

from ..model import CHARS_PER_TOKEN, LATEST_RUNS, RunEvent, RunQuery, RunRecord
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
)
from .group_commit import CLOSE_TIMEOUT, LINGER, GroupCommit, HealthBoard, store_error
from .sqlite_file import ACCESS, GONE, StoreFile, uri
from .sqlite_schema import (
    EVENT_COLUMNS,
    RUN_COLUMNS,
    SCHEMA_VERSION,
    event_from_row,
    event_row,
    fold_record,
    fold_values,
    marks,
    run_from_row,
    run_row,
    usage_totals_sql,
)
from .sqlite_writer import (
    BUSY_CHECKPOINT,
    IDLE_CHECKPOINT,
    JOURNAL_SIZE_LIMIT,
    WAL_AUTOCHECKPOINT,
    AppendPlan,
    CreatePlan,
    InterruptPlan,
    Plan,
    PrunePlan,
    SqliteStoreHooks,
    SqliteWriter,
    SyncPlan,
    job_for,
)

__all__ = [
    "BUSY_CHECKPOINT",
    "CHECK_INTERVAL",
    "CLOSE_TIMEOUT",
    "IDLE_CHECKPOINT",
    "JOURNAL_SIZE_LIMIT",
    "LINGER",
    "SCHEMA_VERSION",
    "WAL_AUTOCHECKPOINT",
    "SqliteStore",
    "SqliteStoreHooks",
    "SqliteStoreStatistics",
    "usage_totals_sql",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What makes a store unwritable, in the order its health says them: its file deleted or
#: replaced under it, a file or folder it may not write, writes that fail.
PROBLEM_SOURCES = (GONE, ACCESS, "write")
#: Seconds between the writer's checks that the database file is the one it opened and
#: that it and its folder may be written (see the module docstring's The file).
CHECK_INTERVAL = 2.0
# LINGER (from group_commit): seconds the writer lets writes nobody waits for
# (``append_nowait``: a run's deltas) gather before it commits them. At a token every
# 20 ms a commit per delta cost more CPU than the rest of the node did. It bounds what a
# crash can lose of a run's output in time, as the run's every 64th delta (which it
# waits for) bounds it in count; the log left is whole either way.


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


def _check_options(
    path: str, synchronous: str, max_batch: int, readers: int, busy_timeout: float, every: float
) -> None:
    """Raise ValueError for options a SqliteStore cannot take."""
    if path in ("", ":memory:") or path.startswith("file:"):
        raise ValueError(f"SqliteStore needs the path of a database file, not {path!r}")
    if synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', not {synchronous!r}")
    if max_batch < 1 or readers < 1 or busy_timeout < 0 or not every > 0:
        raise ValueError(
            "max_batch and readers must be >= 1, busy_timeout >= 0, check_interval > 0"
        )


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
    how often the writer checks the file (see the module docstring's The file),
    ``hooks`` the test seams (a :class:`SqliteStoreHooks`; by default none).

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
        hooks: SqliteStoreHooks | None = None,
    ) -> None:
        self.path = os.fspath(path)
        _check_options(self.path, synchronous, max_batch, readers, busy_timeout, check_interval)
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.busy_timeout = busy_timeout
        self.close_timeout = close_timeout
        self.linger = linger
        self.check_interval = check_interval
        # whether writes go through: what each of PROBLEM_SOURCES finds wrong now
        self._board = HealthBoard(PROBLEM_SOURCES)
        self._file = StoreFile(self.path, self._board, check_interval=check_interval)
        writer = SqliteWriter(
            self._file,
            synchronous=synchronous,
            busy_timeout=busy_timeout,
            hooks=hooks or SqliteStoreHooks(),
        )
        self._engine: GroupCommit[Plan] = GroupCommit(
            writer,
            self._board,
            name=self.path,
            thread_name=f"SqliteStore writer {self.path}",
            logger=log,
            max_batch=max_batch,
            linger=linger,
            close_timeout=close_timeout,
            before_batch=None if hooks is None else hooks.before_batch,
        )
        # read connections: idle ones, guarded by _readers_lock
        self._readers_lock = threading.Lock()
        self._idle_readers: list[sqlite3.Connection] = []
        self._readers_closed = False
        self._read_limiter = trio.CapacityLimiter(readers)

    def __repr__(self) -> str:
        state = self._engine.state()
        health = self._board.health
        if state == "open" and not health.writable:
            state = f"open, {health}"
        return (
            f"<SqliteStore {self.path!r} {state} synchronous={self.synchronous} "
            f"commits={self._engine.commits} jobs={self._engine.jobs} "
            f"pending={self._engine.pending()}>"
        )

    def statistics(self) -> SqliteStoreStatistics:
        """The writer's counters; see :class:`SqliteStoreStatistics`."""
        engine = self._engine
        pending = engine.pending()
        return SqliteStoreStatistics(
            commits=engine.commits, jobs=engine.jobs, events=engine.events, pending=pending
        )

    # --- health ------------------------------------------------------------------------

    def health(self) -> StoreHealth:
        """Whether writes go through now (see the module docstring's Faults)."""
        return self._board.health

    def watch_health(self, listener: HealthListener) -> None:
        """Call ``listener(health)`` in this Trio run's thread whenever writes start or stop
        going through."""
        self._board.watch(listener)

    # --- the RunStore interface ----------------------------------------------------------

    async def ready(self) -> None:
        """Open the database now (if not yet) and raise StoreError if it cannot be used."""
        engine = self._engine
        engine.start()
        if not engine.started:  # closed before its first use
            await trio.lowlevel.checkpoint()
            raise StoreError(f"the store {self.path!r} is closed")
        if not engine.opened:
            await trio.to_thread.run_sync(engine.wait_opened, abandon_on_cancel=True)
        else:
            await trio.lowlevel.checkpoint()
        if engine.open_error is not None:
            raise StoreError(str(engine.open_error)) from engine.open_error

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
        health = self._board.health
        if not health.writable:
            await trio.lowlevel.checkpoint()
            raise StoreUnavailable(f"the run store cannot write: {health.problem}")
        try:
            created = created_record(record, event, then)
        except StoreError:
            await trio.lowlevel.checkpoint()
            raise
        try:
            row = run_row(created)
        except (TypeError, ValueError) as exc:
            await trio.lowlevel.checkpoint()
            raise StoreError(f"run {record.run_id}: options are not JSON: {exc}") from exc
        # what the writer keeps of the run to fold later appends into (nothing once it ended)
        kept = None
        if not created.status.terminal:
            kept = fold_record((record.run_id, *fold_values(created)))
        rows = tuple(event_row(e) for e in (event, *then))
        await self._write(CreatePlan(record.run_id, row, rows, kept))

    async def append(self, event: RunEvent) -> None:
        """Append one event to its run and fold it into the record; see :meth:`RunStore.append`.

        Raises StoreError, once the batch is committed, for an unknown run, a
        seq that is not the next one or a move the lifecycle table refuses;
        nothing of that event is stored. If the caller was cancelled while
        waiting, such an error is only logged.
        """
        await self._write(AppendPlan((event,)))

    def append_nowait(
        self, event: RunEvent, *, on_durable: Callable[[], None] | None = None
    ) -> None:
        """Queue ``event`` for the writer and return; see :meth:`RunStore.append_nowait`.

        StoreError if the store is closed; a refusal (decided by the writer) is
        logged. Must be called from the Trio thread. Without ``on_durable`` the write may
        gather with others for up to :data:`LINGER` seconds.
        """
        self._engine.submit_nowait(job_for(AppendPlan((event,))), on_durable=on_durable)

    async def append_many(self, events: Sequence[RunEvent]) -> None:
        """Append several events in one write; see :meth:`RunStore.append_many`."""
        refused = cast("list[str]", await self._write(AppendPlan(tuple(events), many=True)))
        if refused:
            raise refused_error(refused)

    async def get(self, run_id: str) -> RunRecord | None:
        def read(conn: sqlite3.Connection) -> RunRecord | None:
            rows = conn.execute(
                f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)
            ).fetchall()
            return run_from_row(rows[0]) if rows else None

        return await self._read(read)

    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[RunRecord]:
        """See :meth:`RunStore.list_runs`."""
        where: list[str] = []
        args: list[object] = []
        wanted = sorted(s.value for s in query.statuses)
        if wanted:
            where.append(f"status IN ({marks(len(wanted))})")
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
        sql = f"SELECT {RUN_COLUMNS} FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        args.append(max(query.limit, 0))

        def read(conn: sqlite3.Connection) -> list[RunRecord]:
            return [run_from_row(row) for row in conn.execute(sql, args).fetchall()]

        return await self._read(read)

    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        def read(conn: sqlite3.Connection) -> list[RunEvent]:
            rows = conn.execute(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE run_id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (run_id, after_seq, -1 if limit is None else max(limit, 0)),
            ).fetchall()
            return [event_from_row(row) for row in rows]

        return await self._read(read)

    async def interrupt_unfinished(
        self, *, time: float, message: str, chars_per_token: float = CHARS_PER_TOKEN
    ) -> list[RunEvent]:
        """Mark every QUEUED or RUNNING run INTERRUPTED (oldest first), in one transaction;
        see :meth:`RunStore.interrupt_unfinished` for the usage of those found RUNNING."""
        made = await self._write(InterruptPlan(time, message, chars_per_token))
        return cast("list[RunEvent]", made)

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
        return cast(int, await self._write(PrunePlan(finished_before)))

    async def sync(self) -> None:
        """Return once every write taken before the call is committed."""
        await self._write(SyncPlan())

    async def aclose(self) -> None:
        """Commit every write already taken, stop the writer and close the file.

        Safe to call more than once (and concurrently): each call returns once
        the store is closed. If cancelled, the closing goes on in the
        background. Writes and reads after the first call raise StoreError.
        Writes the store cannot make get ``close_timeout`` seconds more.
        """
        await self._engine.aclose(then=self._close_readers)

    # --- writes and reads ----------------------------------------------------------------

    async def _write(self, plan: Plan) -> object:
        """Have the writer make ``plan``: queued now (no checkpoint before), then wait for
        its batch to commit (see :meth:`GroupCommit.submit` for cancellation)."""
        return await self._engine.submit(job_for(plan))

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        engine = self._engine
        engine.start()
        if engine.closing or not engine.started:
            await trio.lowlevel.checkpoint()
            raise StoreError(f"the store {self.path!r} is closed")
        return await trio.to_thread.run_sync(self._read_sync, fn, limiter=self._read_limiter)

    def _read_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        engine = self._engine
        engine.wait_opened()
        if engine.open_error is not None:
            raise StoreError(str(engine.open_error)) from engine.open_error
        gone, found_now = self._file.check_on_read()
        if found_now:
            engine.nudge()  # the writer rescues the runs and says what to do
        if gone is not None:
            raise StoreUnavailable(f"the run store cannot be read: {gone}")
        with self._readers_lock:
            if self._readers_closed:
                raise StoreError(f"the store {self.path!r} is closed")
            conn = self._idle_readers.pop() if self._idle_readers else None
        try:
            if conn is None:
                conn = self._open_reader()
            # every statement is fetched to its end, so no read transaction stays open
            return fn(conn)
        except Exception as exc:  # sqlite3.Error, or a row this code cannot read
            raise store_error(exc, f"reading the run store {self.path!r} failed") from exc
        finally:
            if conn is not None:
                with self._readers_lock:
                    if self._readers_closed:
                        conn.close()
                    else:
                        self._idle_readers.append(conn)

    def _open_reader(self) -> sqlite3.Connection:
        # read-only: a reader never makes a file, so one where the store was deleted is
        # not taken for an empty store
        conn = sqlite3.connect(
            uri(self.path, "ro"),
            uri=True,
            timeout=self.busy_timeout,
            isolation_level=None,
            check_same_thread=False,
        )
        conn.execute("PRAGMA query_only = ON")
        return conn

    def _close_readers(self) -> None:
        with self._readers_lock:
            self._readers_closed = True
            idle, self._idle_readers = self._idle_readers, []
        for conn in idle:
            conn.close()
